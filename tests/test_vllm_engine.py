"""The vLLM engine wrapper (AsyncLLM + CPD connector) streams deltas, loads and saves
through the arena with identical outputs, and aborts cleanly."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

HELPER = Path(__file__).parent / "helpers" / "engine_check.py"
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def results(model_cache: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    shm = Path("/dev/shm") if Path("/dev/shm").is_dir() else tmp_path_factory.mktemp("shm")
    path = shm / f"cpd-test-engine-{tmp_path_factory.getbasetemp().name}"
    try:
        out = subprocess.run([sys.executable, str(HELPER), str(model_cache), str(path)],
                             capture_output=True, text=True, timeout=540)
    finally:
        path.unlink(missing_ok=True)
    line = next((x for x in out.stdout.splitlines() if x.startswith("RESULT ")), None)
    assert line, out.stdout[-3000:] + out.stderr[-5000:]
    return json.loads(line[len("RESULT "):])


def test_streams_deltas_to_the_end(results: dict) -> None:
    plain = results["plain"]
    assert len(plain["tokens"]) == 10 and plain["finished"] and plain["reason"] == "length"
    assert plain["steps"] >= 2  # streamed, not one final blob
    assert results["max_model_len"] == 8192


def test_save_then_load_is_token_identical(results: dict) -> None:
    assert results["save"]["saved"] == 3 and results["save"]["tokens"] == results["plain"]["tokens"]
    load = results["load"]
    assert load["loaded"] == 3 and load["cached"] == 3 * 256
    assert load["tokens"] == results["plain"]["tokens"]


def test_abort_ends_the_stream_and_the_engine_keeps_serving(results: dict) -> None:
    assert 3 <= results["aborted_tokens"] < 2000
    assert results["after_abort"]["tokens"] == results["plain"]["tokens"]
