"""``cpd bench router --quick`` end to end on a small index: the JSON carries the documented
keys with sane values. Speed is measured by the benchmark, never asserted here."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.timeout(120)
def test_quick_router_bench_reports_latency_throughput_and_breakdown(
        tmp_path: Path, model_cache: Path) -> None:
    out = tmp_path / "router.json"
    # A process of its own: the benchmark configures telemetry and runs its own loop.
    env = {**os.environ, "CPD_MODEL__CACHE_DIR": str(model_cache)}
    proc = subprocess.run(
        [sys.executable, "-m", "tools.cli", "bench", "router", "--quick", "--blocks", "20000",
         "--json", str(out)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=110)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(out.read_text())
    assert json.loads(proc.stdout) == r

    assert r["quick"] is True and r["prompt_tokens"] == 100_000
    assert r["prompt_blocks"] == 100_000 // 256
    assert r["index_blocks"] >= 20_000 // 391 * 391
    assert "process" in r["kvindex"] and r["cpu_count"] >= 1
    assert r["nodes"] == {"preprefill": 2, "prefill": 4, "decode": 2}
    assert r["decision_p99_ms"] >= r["decision_p50_ms"] > 0
    for kind in ("all", "warm", "cold"):
        st = r["decision_ms"][kind]
        assert st["max"] >= st["p99"] >= st["p90"] >= st["p50"] > 0 and st["n"] > 0
    assert r["decisions_per_s"] > 0
    assert [lv["concurrency"] for lv in r["throughput"]] == [8, 32]
    assert all(lv["decisions_per_s"] > 0 and lv["decisions"] > 0 for lv in r["throughput"])
    for key in ("hash_ms_p50", "lookup_ms_p50", "lookup_ms_p99", "policy_ms_p50",
                "validate_ms_p50", "request_decode_ms_p50"):
        assert r[key] > 0, key
    assert r["lookup_ms_p99"] >= r["lookup_ms_p50"]
    # Every decision made with kvindex's answer took the path its prompt calls for (a
    # lookup past the router's timeout on a busy machine is counted, not failed).
    assert r["decision_errors"] == 0, r["decision_error_examples"]
    assert r["decisions_without_kvindex_answer"] < r["decision_ms"]["all"]["n"]
    assert r["paths"].get("warm->warm", 0) + r["paths"].get("warm->overflow", 0) > 0
    assert r["paths"].get("cold->cold", 0) + r["paths"].get("cold->overflow", 0) > 0
    t = r["targets"]
    assert t["decision_p99_ms"] == 2.0 and t["decisions_per_s"] == 2000
    assert t["decision_p99_met"] == (r["decision_p99_ms"] < 2.0)
    assert t["decisions_per_s_met"] == (r["decisions_per_s"] >= 2000)
    # The agent-turn mix runs with the memo on: it must reuse hashes, and decide the same
    # way (every turn warm, nothing without a kvindex answer, no errors).
    assert r["decisions_per_s_agent_turns"] > 0
    assert r["decision_p99_ms_agent_turns"] >= r["decision_p50_ms_agent_turns"] > 0
    assert 0 < r["hash_memo_reuse_ratio"] < 1
    # A router in a front end decides the same prompts the same way, its lookups
    # answered in the process (a lookup and its answer per decision).
    fe = r["front_end"]
    assert fe["decision_errors"] == 0
    assert fe["decision_ms"]["n"] == fe["separate_decision_ms"]["n"] > 0
    assert fe["in_process_messages"] >= 2 * (fe["decision_ms"]["n"]
                                             - fe["decisions_without_kvindex_answer"])
    assert fe["decision_p50_over_separate"] == pytest.approx(
        fe["decision_ms"]["p50"] / fe["separate_decision_ms"]["p50"], abs=0.01)
    for mode in ("sequential", "throughput"):
        a = r["agent_turns"][mode]
        assert a["decision_errors"] == 0, a["decision_error_examples"]
        assert a["decisions_without_kvindex_answer"] == 0
        assert a["hash_memo"]["hits"] > 0 and a["hash_memo"]["misses"] > 0
        assert set(a["paths"]) <= {"agent->warm", "agent->overflow"}
    assert t["decisions_per_s_agent_turns_met"] == (r["decisions_per_s_agent_turns"] >= 2000)
    assert t["decision_p99_agent_turns_met"] == (r["decision_p99_ms_agent_turns"] < 2.0)
    # Single-flight: both kinds of waiter resumed in every round, after the seal.
    assert r["single_flight_rounds"] == 20
    for kind in ("", "_poll"):
        assert r[f"single_flight_wake_p90_ms{kind}"] >= r[f"single_flight_wake_p50_ms{kind}"]
        assert r[f"single_flight_seal_to_wake_p50_ms{kind}"] > 0
    assert t["single_flight_wake_p50_met"] == (r["single_flight_wake_p50_ms"] <= 5.0)
