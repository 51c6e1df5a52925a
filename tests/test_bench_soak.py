"""``cpd bench soak``: which round injects which fault, growth per hour from samples,
and a short real soak (the fault harness's cluster, a kill -9 in it) that loses nothing
and reports every process."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tools.bench.soak import SoakConfig, growth, per_hour, proc_sample, run_async

pytestmark = pytest.mark.timeout(300)


@pytest.mark.parametrize(("every", "faults", "names"), [
    (4, ("a", "b"), ["baseline"] * 3 + ["a"] + ["baseline"] * 3 + ["b"] + ["baseline"] * 3
     + ["a"]),
    (2, ("a", "b", "c"), ["baseline", "a", "baseline", "b", "baseline", "c", "baseline", "a",
                          "baseline", "b", "baseline", "c"]),
    (1, ("a",), ["a"] * 12),
])
def test_every_nth_round_injects_the_next_fault(every: int, faults: tuple[str, ...],
                                                names: list[str]) -> None:
    cfg = SoakConfig(fault_every=every, faults=faults)
    assert [cfg.round_name(i) for i in range(12)] == names


@pytest.mark.parametrize(("points", "want"), [
    ([(0, 10), (1800, 15), (3600, 20)], 10.0),       # +10 per hour
    ([(0, 5), (60, 5), (120, 5), (180, 5)], 0.0),    # flat
    ([(0, 1), (60, 2)], None),                        # too few points to say
    ([(60, 1), (60, 2), (60, 3)], None),              # no spread in time
])
def test_growth_per_hour_is_a_least_squares_slope(points: list, want: float | None) -> None:
    assert per_hour(points) == want


def test_a_process_sample_splits_private_from_shared_memory() -> None:
    got = proc_sample(os.getpid())
    assert got is not None
    assert got["rss_mib"] > 0 and 0 < got["anon_mib"] <= got["rss_mib"]
    assert got["shmem_mib"] >= 0 and got["open_files"] > 0
    assert proc_sample(2**22 + 7) is None  # no such process


def test_growth_uses_each_nodes_last_incarnation_after_the_warm_up() -> None:
    samples = [{"t_s": t, "node": "p0", "pid": 1, "rss_mib": 100 + t} for t in range(0, 50, 10)]
    # Restarted at 50 s: a new pid, lower memory, then flat.
    samples += [{"t_s": t, "node": "p0", "pid": 2, "rss_mib": 80.0, "open_files": 30}
                for t in range(50, 100, 10)]
    got = growth(samples, since_s=40)
    assert got == {"p0": {"rss_mib": 0.0, "open_files": 0.0}}


@pytest.mark.slow
async def test_a_short_soak_loses_nothing_and_samples_every_process(tmp_path: Path) -> None:
    cfg = SoakConfig(minutes=0.5, concurrency=30, round_s=8.0, fault_every=2,
                     faults=("kill-prefill",), progress=False)
    result = await run_async(cfg, tmp_path)
    assert result["rounds_run"] >= 2 and result["faults_injected"] >= 1
    assert result["lost"] == result["wrong_tokens"] == 0
    assert result["unsealed_served"] == result["invisible_reads"] == 0
    assert result["kvindex_consistent"]
    assert result["min_completed_ok_ratio"] >= 0.9
    # Every service process and NATS sampled after every round; the killed node twice
    # over (two pids), kvindex with its block count, workers with their arena bytes.
    nodes = {s["node"] for s in result["samples"]}
    assert {"kvi", "router", "p0", "d0", "nats"} <= nodes
    assert len({s["pid"] for s in result["samples"] if s["node"] == "p0"}) == 2
    assert all(s["rss_mib"] > 0 and s["open_files"] > 0 for s in result["samples"])
    # Private memory apart from shared: a worker's arena is shared memory.
    assert all(0 < s["anon_mib"] <= s["rss_mib"] for s in result["samples"])
    assert any(s["shmem_mib"] > 0 for s in result["samples"] if s["node"] == "p0")
    assert any(s.get("kvindex_blocks", 0) > 0 for s in result["samples"])
    assert any(s.get("arena_bytes", 0) > 0 for s in result["samples"])
    assert set(result["growth_per_hour"]) == nodes
