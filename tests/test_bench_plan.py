"""``cpd bench plan``: the quick run end to end (every key, positive figures) and the
benchmark's pure helpers. Speed is measured by the benchmark, never asserted here."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tools.bench.plan import _met, _split, large_topology
from tools.bench.registry import BENCHMARKS
from tools.cli import build_parser

ROOT = Path(__file__).resolve().parent.parent

# The figures of a run: each must be a positive number.
POSITIVE = ("paper_protocol_s", "large_cluster_s", "sim_requests_per_cpu_s",
            "simulated_requests", "cpu_s", "jobs", "paper_protocol_target_s",
            "large_cluster_target_s")
RUN_POSITIVE = ("wall_s", "cpu_s", "simulated_requests", "jobs")


def test_the_registry_lists_plan_and_its_flags_parse() -> None:
    assert BENCHMARKS["plan"].module == "tools.bench.plan"
    args = build_parser().parse_args(["bench", "plan", "--quick", "--jobs", "2",
                                      "--json", "p.json"])
    assert (args.what, args.quick, args.jobs, args.json) == ("plan", True, 2, "p.json")
    args = build_parser().parse_args(["bench", "plan"])
    assert (args.quick, args.jobs, args.json) == (False, 0, None)


@pytest.mark.timeout(120)
def test_quick_plan_bench_reports_every_key(tmp_path: Path) -> None:
    out = tmp_path / "plan.json"
    proc = subprocess.run(
        [sys.executable, "-m", "tools.cli", "bench", "plan", "--quick", "--json", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=110)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(out.read_text())
    assert json.loads(proc.stdout) == r
    assert r["quick"] is True
    for key in POSITIVE:
        assert isinstance(r[key], int | float) and r[key] > 0, key
    for run in ("paper_protocol", "large_cluster"):
        for key in RUN_POSITIVE:
            assert r[run][key] > 0, (run, key)
        assert r[f"{run}_met"] == (r[f"{run}_s"] <= r[f"{run}_target_s"])
        assert r[f"{run}_s"] == r[run]["wall_s"]
    assert r["simulated_requests"] == (r["paper_protocol"]["simulated_requests"]
                                       + r["large_cluster"]["simulated_requests"])
    assert r["paper_protocol"]["topologies"] == ["2P1D pd-kv", "CPD-1D"]
    assert r["paper_protocol"]["seeds"] == 1
    large = r["large_cluster"]
    assert large["split"] == {"preprefill": 8, "prefill": 8, "decode": 16}
    assert large["nodes"] == 32 and large["completed_requests"] > 0
    assert r["host"]["cpu_count"] >= 1 and "load_average_before" in r["host"]


@pytest.mark.parametrize(("nodes", "ratio", "expected"), [
    (256, (1, 1, 2), (64, 64, 128)),
    (32, (1, 1, 2), (8, 8, 16)),
    (4, (1, 1, 2), (1, 1, 2)),
    (3, (1, 1, 2), (1, 1, 1)),      # remainders .75, .75, .5: the first two get one
    (10, (1, 1, 2), (3, 2, 5)),     # a tie in remainders goes to the earlier pool
    (5, (1, 8, 1), (1, 3, 1)),      # pools raised to one node give it back from the largest
    (7, (1, 1), (4, 3)),
])
def test_split_is_proportional_and_complete(nodes: int, ratio: tuple[int, ...],
                                            expected: tuple[int, ...]) -> None:
    got = _split(nodes, ratio)
    assert got == expected
    assert sum(got) == nodes and min(got) >= 1


@pytest.mark.parametrize(("nodes", "ratio"), [(2, (1, 1, 2)), (8, (0, 1, 2))])
def test_split_refuses_what_it_cannot_split(nodes: int, ratio: tuple[int, ...]) -> None:
    with pytest.raises(ValueError, match="cannot split"):
        _split(nodes, ratio)


@pytest.mark.parametrize(("seconds", "target", "met"), [
    (59.9, 60.0, True), (60.0, 60.0, True), (60.01, 60.0, False), (301.0, 300.0, False),
])
def test_met_is_within_the_target(seconds: float, target: float, met: bool) -> None:
    assert _met(seconds, target) is met


def test_the_large_cluster_is_the_paper_cpd_2d_scaled() -> None:
    top = large_topology(256)
    assert (top.policy, top.preprefill, top.prefill, top.decode) == ("cpd", 64, 64, 128)
    assert top.label == "CPD-64:64:128"
