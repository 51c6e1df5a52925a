"""CPU lists and the placement of a host's engines on its cores (pure logic)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from cpd.modelbuild.runtime import engine_thread_env
from cpd.ops.config import load_settings
from cpd.ops.cpuset import format_cpu_list, parse_cpu_list, place_engines
from cpd.protocol.errors import ConfigError
from tools.supervisor import engine_placements, plan_nodes

PP, P, D = "preprefill", "prefill", "decode"


@pytest.mark.parametrize(("text", "cpus"), [
    ("", []),
    ("3", [3]),
    ("0-3", [0, 1, 2, 3]),
    ("0-1,4,6-7", [0, 1, 4, 6, 7]),
    (" 2 , 0-1 ", [0, 1, 2]),
    ("1,1,0-1", [0, 1]),
])
def test_parse_cpu_list(text: str, cpus: list[int]) -> None:
    assert parse_cpu_list(text) == cpus
    assert parse_cpu_list(format_cpu_list(cpus)) == cpus


@pytest.mark.parametrize("text", ["a", "1-", "-1", "3-1", "0,,1", "1.5", "0-70000", ","])
def test_bad_cpu_lists_are_refused(text: str) -> None:
    with pytest.raises(ValueError):
        parse_cpu_list(text)


@pytest.mark.parametrize(("cpus", "text"), [
    ([], ""), ([5], "5"), ([0, 1, 2, 5], "0-2,5"), ([7, 6, 0], "0,6-7"), ([1, 3], "1,3"),
])
def test_format_cpu_list(cpus: list[int], text: str) -> None:
    assert format_cpu_list(cpus) == text


@pytest.mark.parametrize(("cpus", "roles", "want"), [
    # One core: everything shares it.
    ([0], [PP, P, D], ["0", "0", "0"]),
    # Two cores, three engines (the local default): decode alone on one core.
    ([0, 1], [PP, P, D], ["0", "0", "1"]),
    # Enough cores: one each, the rest to the prefill side in turn.
    ([0, 1, 2], [PP, P, D], ["1", "2", "0"]),
    ([0, 1, 2, 3, 4], [PP, P, D], ["1,3", "2,4", "0"]),
    # Two decode engines on three cores with two prefill engines: decodes keep theirs.
    ([0, 1, 2], [PP, P, D, D], ["0", "0", "2", "1"]),
    # Only decode engines, more cores than engines: the leftovers go to them.
    ([0, 1, 2, 3], [D, D], ["0,2", "1,3"]),
    # Only prefill-side engines on fewer cores: they share.
    ([4, 5], [PP, P, P], ["4-5", "4-5", "4-5"]),
    # Decode engines alone on fewer cores than engines: they share what there is.
    ([0], [D, D], ["0", "0"]),
])
def test_place_engines(cpus: list[int], roles: list[str], want: list[str]) -> None:
    placed = place_engines(cpus, roles)
    assert [p.cpu_list for p in placed] == want
    assert [p.threads for p in placed] == [len(parse_cpu_list(w)) for w in want]
    assert all(set(p.cpus) <= set(cpus) for p in placed)


def test_place_engines_refuses_nonsense() -> None:
    with pytest.raises(ValueError, match="no CPUs"):
        place_engines([], [D])
    with pytest.raises(ValueError, match="unknown engine roles"):
        place_engines([0], ["gpu"])


@pytest.mark.parametrize(("threads", "cpus", "env"), [
    (0, [], {}),
    (2, [], {"OMP_NUM_THREADS": "2"}),
    (0, [0, 3], {"OMP_NUM_THREADS": "2", "OMP_PLACES": "{0},{3}", "OMP_PROC_BIND": "close"}),
    (1, [1], {"OMP_NUM_THREADS": "1", "OMP_PLACES": "{1}", "OMP_PROC_BIND": "close"}),
])
def test_engine_thread_env(threads: int, cpus: list[int], env: dict[str, str]) -> None:
    assert engine_thread_env(threads, cpus) == env


def test_cpd_up_places_workers_unless_the_settings_name_their_cpus() -> None:
    nodes = plan_nodes(["kvindex", PP, P, D, "router", "gateway"], None)
    placed = engine_placements(load_settings(environ={}), nodes)
    assert set(placed) == {"preprefill-0", "prefill-0", "decode-0"}
    for overrides in (["worker.engine_cpus=0"], ["worker.engine_threads=2"],
                      ["worker.engine=sim"]):
        assert engine_placements(load_settings(environ={}, overrides=overrides), nodes) == {}


def test_a_bad_engine_cpu_list_fails_when_the_settings_load() -> None:
    with pytest.raises(ConfigError):
        load_settings(environ={}, overrides=["worker.engine_cpus=0-"])


_NICE_PROBE = r"""
import os, subprocess, sys, time
from cpd.ops.cpuset import lower_descendants
# A child with a second thread, and a grandchild: an engine core and its model process.
code = ("import subprocess, sys, threading, time; "
        "threading.Thread(target=time.sleep, args=(30,), daemon=True).start(); "
        "g = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(30)']); "
        "print(g.pid, flush=True); time.sleep(30)")
child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
grandchild = int(child.stdout.readline())
time.sleep(0.2)
nice = int(sys.argv[1])
changed = lower_descendants(nice)
tids = [int(t) for p in (child.pid, grandchild) for t in os.listdir(f"/proc/{p}/task")]
print(changed, len(tids), sorted({os.getpriority(os.PRIO_PROCESS, t) for t in tids}),
      os.getpriority(os.PRIO_PROCESS, 0))
again = lower_descendants(nice)
print(again)
child.kill(); os.kill(grandchild, 9)
"""


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="needs Linux /proc")
def test_engine_processes_run_at_a_lower_priority_than_their_worker() -> None:
    """Every thread of every descendant (an engine's core and model processes) gets the
    niceness; the calling process keeps its own; a second call changes nothing."""
    own = os.getpriority(os.PRIO_PROCESS, 0)
    # Lower than this process where it can be; at the lowest priority already (19), no
    # thread changes: the call never raises a priority.
    nice = min(19, own + 5)
    out = subprocess.run([sys.executable, "-c", _NICE_PROBE, str(nice)], capture_output=True,
                         text=True, timeout=60, check=True).stdout.split("\n")
    changed, threads, nices, probe = out[0].split(" ", 3)
    assert int(threads) >= 3
    assert int(changed) == (int(threads) if nice > own else 0)
    assert nices == f"[{nice}]" and int(probe) == own
    assert out[1] == "0"
