"""The planner against the real services (``cpd bench plan --fidelity``): the pure
comparison table-driven, the plan configured from a sweep's own JSON, and the quick
benchmark end to end on real services (a sweep on sim engines, then the plan)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from cpd.ops.config import Settings
from cpd.protocol import wire
from cpd.protocol.errors import CpdError
from cpd.sim.costmodel import PRESETS
from tools.bench.fidelity import data_plane_gbps, merged, plan_config
from tools.bench.loaddriver import Result
from tools.bench.sweep import request_record
from tools.cli import build_parser
from tools.plan.cli import config_for
from tools.plan.fidelity import compare, rel_diff, services_latency, ttft_loads

ROOT = Path(__file__).resolve().parent.parent
RECORDED = ROOT / "docs/benchmarks/sweep/coding-agent-1d.json"


def _point(q: float, ok: bool = True, p50: float | None = 0.1,
           p90: float | None = 0.5) -> dict:
    return {"target_qps_per_gpu": q, "sustainable": ok, "ttft_p50_s": p50,
            "ttft_p90_s": p90}


def _sweep(points: list[dict], sustainable: float) -> dict:
    return {"points": points, "sustainable_qps_per_gpu": sustainable}


def _plan(points: list[dict], sustainable: float) -> dict:
    return {"seeds": [{"points": points, "sustainable_qps_per_gpu": sustainable}]}


@pytest.mark.parametrize(("plan", "real", "want"), [
    (1.1, 1.0, 0.1), (0.9, 1.0, 0.1), (1.0, 1.0, 0.0), (0.0, 0.0, 0.0),
    (0.5, 0.0, None), (None, 1.0, None), (1.0, None, None), (0.0292, 0.0250, 0.168),
])
def test_rel_diff_is_relative_to_the_real_services(plan: float | None, real: float | None,
                                                   want: float | None) -> None:
    assert rel_diff(plan, real) == want


@pytest.mark.parametrize(("real", "plan", "want"), [
    # the two lowest loads both sustained
    ([_point(0.4), _point(0.6), _point(0.8)], [_point(0.4), _point(0.6), _point(0.8)],
     [0.4, 0.6]),
    # a load one side did not sustain, or did not run, is not compared
    ([_point(0.4, ok=False), _point(0.6), _point(0.8)],
     [_point(0.4), _point(0.6), _point(0.8)], [0.6, 0.8]),
    ([_point(0.4), _point(0.8)], [_point(0.4), _point(0.6)], [0.4]),
    ([_point(0.4, ok=False)], [_point(0.4)], []),
])
def test_ttft_loads_are_the_lowest_both_sustained(real: list[dict], plan: list[dict],
                                                  want: list[float]) -> None:
    assert ttft_loads(real, plan) == want


def test_compare_reports_each_topology_and_the_worst_difference() -> None:
    sweep = {"topologies": {
        "2P1D pd-kv": _sweep([_point(0.4, p50=0.04, p90=0.1), _point(0.6, p50=0.05, p90=0.2),
                              _point(0.8, ok=False)], 0.6),
        "CPD-1D": _sweep([_point(0.4, p50=0.04, p90=0.1), _point(0.6, p50=0.05, p90=0.2),
                          _point(0.8)], 0.8)}}
    plan = {"topologies": {
        "2P1D pd-kv": _plan([_point(0.4, p50=0.04, p90=0.11), _point(0.6, p50=0.05, p90=0.2),
                             _point(0.8, ok=False)], 0.6),
        "CPD-1D": _plan([_point(0.4, p50=0.046, p90=0.1), _point(0.6, p50=0.05, p90=0.2),
                         _point(0.8), _point(1.0, ok=False)], 0.88)}}
    r = compare(sweep, plan)
    assert set(r["topologies"]) == {"2P1D pd-kv", "CPD-1D"}   # pd-rr: not run
    kv, cpd = r["topologies"]["2P1D pd-kv"], r["topologies"]["CPD-1D"]
    assert kv["sustainable_rel_diff"] == 0.0 and cpd["sustainable_rel_diff"] == 0.1
    assert kv["ttft_loads"] == [0.4, 0.6]
    assert kv["ttft"]["0.4"]["ttft_p90_rel_diff"] == 0.1
    assert kv["ttft_max_rel_diff"] == 0.1 and cpd["ttft_max_rel_diff"] == 0.15
    assert r["fidelity_max_rel_diff"] == 0.1 and r["fidelity_met"] is True
    assert r["ttft_max_rel_diff"] == 0.15 and r["ttft_met"] is True
    plan["topologies"]["CPD-1D"]["seeds"][0]["sustainable_qps_per_gpu"] = 0.6
    r = compare(sweep, plan)
    assert r["fidelity_max_rel_diff"] == 0.25 and r["fidelity_met"] is False


def test_nothing_compared_meets_no_target() -> None:
    r = compare({"topologies": {}}, {"topologies": {}})
    assert r["fidelity_max_rel_diff"] is None and r["fidelity_met"] is False
    assert r["ttft_met"] is False


# (sweep: id → TTFT s, computed, outside the router s; plan: id → TTFT s, computed) →
# (paired, gap p50 ms, dispatch ms, relay ms), or None when nothing pairs.
LATENCY_CASES = [
    ({"a": [0.030, 64, 0.003], "b": [0.050, 0, 0.004], "c": [0.040, 16, 0.002]},
     {"a": (0.020, 64), "b": (0.038, 0), "c": (0.030, 16)}, (3, 10.0, 7.0, 3.0)),
    # other cache hits on one side (computed differs), no first token, unknown id
    ({"a": [0.030, 64, 0.003], "b": [0.050, 32, 0.004], "c": [None, 16, None],
      "d": [0.02, 0, 0.001]},
     {"a": (0.020, 64), "b": (0.038, 0), "c": (0.030, 16), "x": (0.01, 0)}, (1, 10.0, 7.0, 3.0)),
    # not timed by the router: all of the gap is charged before the engine
    ({"a": [0.030, 64, None], "b": [0.034, 0, None]}, {"a": (0.020, 64), "b": (0.020, 0)},
     (2, 12.0, 12.0, 0.0)),
    # the plan slower than the services: nothing to charge
    ({"a": [0.010, 0, 0.002]}, {"a": (0.020, 0)}, (1, -10.0, 0.0, 0.0)),
    ({"a": [None, 0, None]}, {"a": (0.020, 0)}, None),
    ({}, {}, None),
]


@pytest.mark.parametrize(("sweep", "plan", "expected"), LATENCY_CASES)
def test_services_latency_pairs_the_same_requests(sweep: dict, plan: dict,
                                                  expected: tuple | None) -> None:
    got = services_latency(sweep, plan)
    if expected is None:
        assert got is None
        return
    assert got is not None and got["requests"] == len(sweep)
    assert (got["paired"], got["gap_p50_ms"], got["dispatch_ms"], got["relay_ms"]) == expected


def test_a_sweep_request_is_kept_with_the_part_the_router_did_not_see() -> None:
    r = Result(request_id="r", arrival_s=1.0, prompt_tokens=64, sent_s=1.5,
               first_token_s=1.54, tokens=wire.PromptTokens(computed=16),
               timings={"ttft_ms": 30.0})
    assert request_record(r) == [0.54, 16, 0.01]
    assert request_record(r, time_scale=0.5) == [0.54, 16, 0.025]
    assert request_record(Result(request_id="r", arrival_s=1.0, prompt_tokens=64,
                                 first_token_s=1.2)) == [0.2, 0, None]
    assert request_record(Result(request_id="r", arrival_s=1.0, prompt_tokens=64,
                                 error="x")) == [None, 0, None]


def test_the_plan_takes_the_recorded_sweep_configuration() -> None:
    sweep = json.loads(RECORDED.read_text())
    cfg = plan_config(Settings(), sweep, jobs=1)
    c = sweep["config"]
    assert [t.label for t in cfg.topologies] == c["topologies"]
    assert cfg.ladder == tuple(c["qps_per_gpu"]) and cfg.seeds == 1
    assert (cfg.phases.ramp_s, cfg.phases.settle_s, cfg.phases.steady_s) == (
        c["ramp_s"], c["settle_s"], c["steady_s"])
    assert cfg.preset == c["preset"] and cfg.max_inflight == c["max_inflight"]
    assert cfg.slo_ttft_p90_s == c["ttft_slo_s"] and cfg.stop_after == 1
    assert (cfg.settings.worker.long_prefill_token_threshold
            == c["long_prefill_token_threshold"])


KV = PRESETS["b200-tp4-llama-3.1-8b-fp8"].kv_bytes_per_token


def _pulled(*loads: tuple[int, float], time_scale: float = 1.0,
            preset: str = "b200-tp4-llama-3.1-8b-fp8") -> dict:
    return {"config": {"preset": preset, "time_scale": time_scale},
            "topologies": {"CPD-1D": {"points": [
                {"remote_load": {"tokens": t, "wall_s": w}} for t, w in loads]}}}


@pytest.mark.parametrize(("sweep", "want"), [
    # 1M tokens pulled in 2 s over two points: the preset's bytes of them per second.
    (_pulled((600_000, 1.0), (400_000, 1.0)), round(1_000_000 * KV / 2 / 1e9, 2)),
    # Twice the simulated seconds per wall second: half the rate in simulated time.
    (_pulled((1_000_000, 2.0), time_scale=2.0), round(1_000_000 * KV / 4 / 1e9, 2)),
    (_pulled((0, 0.0)), None),                            # nothing pulled
    (_pulled(), None),                                    # no points
    ({"config": {"preset": "b200-tp4-llama-3.1-8b-fp8"},  # recorded before the key
      "topologies": {"CPD-1D": {"points": [{}]}}}, None),
    (_pulled((1000, 1.0), preset="nope"), None),          # an unknown preset
])
def test_the_plan_runs_at_the_rate_the_sweeps_pulls_achieved(sweep: dict,
                                                            want: float | None) -> None:
    assert data_plane_gbps(sweep) == want


def test_the_plan_of_a_sweep_that_pulled_runs_on_its_network() -> None:
    sweep = json.loads(RECORDED.read_text())
    base = plan_config(Settings(), sweep, jobs=1).network_gbps
    label = next(iter(sweep["topologies"]))
    sweep["topologies"][label]["points"][0]["remote_load"] = {"tokens": 10**6, "wall_s": 1.0}
    assert plan_config(Settings(), sweep, jobs=1).network_gbps == round(KV / 1e3, 2) != base


def test_sweeps_of_one_configuration_merge() -> None:
    a = {"config": {"preset": "p", "topologies": ["2P1D pd-kv"]}, "wall_s": 10.0,
         "topologies": {"2P1D pd-kv": {"points": []}}}
    b = {"config": {"preset": "p", "topologies": ["CPD-1D"]}, "wall_s": 5.0,
         "topologies": {"CPD-1D": {"points": []}}}
    m = merged([a, b])
    assert list(m["topologies"]) == ["2P1D pd-kv", "CPD-1D"] == m["config"]["topologies"]
    assert m["wall_s"] == 15.0 and a["config"]["topologies"] == ["2P1D pd-kv"]
    with pytest.raises(CpdError):
        merged([a, {**b, "config": {"preset": "q", "topologies": ["CPD-1D"]}}])
    with pytest.raises(CpdError):
        merged([])


def test_a_file_that_is_not_a_sweep_is_a_typed_error(tmp_path: Path) -> None:
    with pytest.raises(CpdError, match="not a cpd bench sweep result"):
        plan_config(Settings(), {"config": {"workload": "coding-agent"}}, jobs=1)
    from tools.bench import fidelity

    bad = tmp_path / "x.json"
    bad.write_text("{")
    with pytest.raises(CpdError, match="cannot read the sweep result"):
        fidelity.run(Settings(), sweep_json=[str(bad)])


def test_fidelity_flags_parse() -> None:
    args = build_parser().parse_args(["bench", "plan", "--fidelity", "--sweep-json", "s.json"])
    assert (args.fidelity, args.sweep_json, args.quick) == (True, ["s.json"], False)
    args = build_parser().parse_args(["bench", "plan", "--fidelity", "--sweep-json", "a.json",
                                      "b.json"])
    assert args.sweep_json == ["a.json", "b.json"]
    args = build_parser().parse_args(["plan", "--max-inflight", "64", "--dispatch-ms", "3",
                                      "--relay-ms", "1.5"])
    assert (args.max_inflight, args.dispatch_ms, args.relay_ms) == (64, 3.0, 1.5)
    cfg = config_for(Settings(), args)
    assert (cfg.max_inflight, cfg.dispatch_s, cfg.relay_s) == (64, 0.003, 0.0015)
    for bad in (["--max-inflight", "0"], ["--relay-ms", "-1"]):
        with pytest.raises(CpdError):
            config_for(Settings(), build_parser().parse_args(["plan", *bad]))


@pytest.mark.timeout(300)
def test_against_the_recorded_sweep(tmp_path: Path) -> None:
    """The plan of the recorded sweep's protocol, compared with that sweep's result:
    every topology compared on its sustainable load and at two loads."""
    out = tmp_path / "fidelity.json"
    proc = subprocess.run(
        [sys.executable, "-m", "tools.cli", "bench", "plan", "--fidelity", "--sweep-json",
         str(RECORDED), "--json", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(out.read_text())
    assert set(r["topologies"]) == {"2P1D pd-rr", "2P1D pd-kv", "CPD-1D"}
    for label, t in r["topologies"].items():
        assert t["plan_sustainable_qps_per_gpu"] > 0, label
        assert len(t["ttft_loads"]) == 2, label
    assert r["fidelity_max_rel_diff"] == max(
        t["sustainable_rel_diff"] for t in r["topologies"].values())
    assert r["fidelity_met"] == (r["fidelity_max_rel_diff"] <= r["fidelity_target"])


@pytest.mark.timeout(400)
def test_quick_fidelity_runs_the_real_services_and_agrees_at_low_load(tmp_path: Path) -> None:
    """``--fidelity --quick``: a sweep of CPD-1D on the real services (sim engines), the
    plan of the same, compared. The planner's median TTFT at the lowest load is within
    twice the benchmark's tolerance of the services' (a 2-core host is noisy; leaving
    out the services' own latency alone is a third of it)."""
    out = tmp_path / "fidelity.json"
    proc = subprocess.run(
        [sys.executable, "-m", "tools.cli", "bench", "plan", "--fidelity", "--quick",
         "--json", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=380)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(out.read_text())
    assert r["quick"] is True and r["sweep_wall_s"] > 0
    assert list(r["topologies"]) == ["CPD-1D"]
    t = r["topologies"]["CPD-1D"]
    assert t["ttft_loads"] == [0.4], t
    low = t["ttft"]["0.4"]
    assert low["sweep_ttft_p50_s"] > 0 and low["plan_ttft_p50_s"] > 0
    assert low["ttft_p50_rel_diff"] <= 2 * r["ttft_target"], low
    lat = r["services_latency"]["CPD-1D"]
    assert lat["qps_per_gpu"] == 0.4 and 0 < lat["paired"] <= lat["requests"], lat
    assert lat["dispatch_ms"] >= 0 and lat["relay_ms"] >= 0, lat
