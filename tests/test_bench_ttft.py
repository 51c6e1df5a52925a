"""The pure parts of ``cpd bench ttft`` (medians, ratios, path checks) and the GPU check
script's environment report on a machine without CUDA. No servers, no engines."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from cpd.protocol import wire
from services.router.outcome import Reports
from tools.bench.ttft import Sample, prompt_lengths, route_mismatches, summarize

ROOT = Path(__file__).resolve().parent.parent
BS = 256


def _samples(n: int, cold: list[float], remote: list[float], dram: list[float],
             gpu: list[float]) -> list[Sample]:
    out = []
    for case, xs in (("cold", cold), ("warm_remote", remote), ("warm_local_dram", dram),
                     ("gpu_hit", gpu)):
        out += [Sample(prompt_tokens=n, case=case, ttft_ms=x, path_ok=True) for x in xs]
    return out


def test_summarize_takes_medians_and_ratios_to_cold_per_length() -> None:
    samples = (_samples(1024, [100, 300, 200], [50, 60, 70], [40, 40, 41], [20, 10, 30])
               + _samples(8178, [2000, 2100, 1900], [400, 500, 600], [300, 300, 300],
                          [200, 100, 150]))
    r = summarize(samples)
    short, long_ = r["lengths"]
    assert short["prompt_tokens"] == 1024 and long_["prompt_tokens"] == 8178
    assert short["ttft_ms"] == {"cold": 200, "warm_remote": 60, "warm_local_dram": 40,
                                "gpu_hit": 20}
    assert short["warm_remote_over_cold"] == 0.3
    assert short["ttft_ms_all"]["cold"] == [100, 300, 200]
    assert long_["warm_remote_over_cold"] == 0.25
    assert r["max_prompt_tokens"] == 8178
    assert r["warm_remote_over_cold_at_max"] == 0.25
    assert r["warm_local_dram_over_cold_at_max"] == 0.15
    assert r["gpu_hit_over_cold_at_max"] == 0.075
    assert r["target_warm_remote_over_cold_at_max"] == 0.5
    assert r["path_ok"] and r["path_errors"] == [] and r["met_target"]


def test_summarize_misses_the_target_when_warm_is_too_slow() -> None:
    r = summarize(_samples(4096, [100], [60], [50], [10]))
    assert r["warm_remote_over_cold_at_max"] == 0.6
    assert r["path_ok"] and not r["met_target"]


def test_a_wrong_path_is_reported_and_never_meets_the_target() -> None:
    samples = _samples(2048, [100], [10], [10], [10])
    samples[1] = Sample(prompt_tokens=2048, case="warm_remote", ttft_ms=10, path_ok=False,
                        path_error="remote=0 (want 1792)")
    r = summarize(samples)
    assert not r["path_ok"] and not r["met_target"]
    assert not r["lengths"][0]["path_ok"]
    assert r["path_errors"] == ["warm_remote at 2048 tokens: remote=0 (want 1792)"]


def test_summarize_of_nothing_reports_no_headline() -> None:
    r = summarize([])
    assert r["lengths"] == [] and r["warm_remote_over_cold_at_max"] is None
    assert not r["path_ok"] and not r["met_target"]


def test_summarize_rejects_unknown_cases() -> None:
    with pytest.raises(ValueError):
        summarize([Sample(prompt_tokens=1, case="lukewarm", ttft_ms=1, path_ok=True)])


def test_prompt_lengths_run_from_1k_to_the_model_limit() -> None:
    assert prompt_lengths(True, 8192) == [1024, 8178]
    assert prompt_lengths(False, 8192) == [1024, 2048, 4096, 8178]
    assert prompt_lengths(False, 2048) == [1024, 2034]


def _reports(prefill: str, decode: str = "d0", **tokens: int) -> Reports:
    return Reports(
        prefill=wire.PrefillReport(request_id="r", seq=1, node=prefill,
                                   tokens=wire.PromptTokens(**tokens)),
        decode=wire.DecodeReport(request_id="r", seq=2, node=decode) if decode else None)


@pytest.mark.parametrize(("case", "n", "reports", "wrong"), [
    # n = 1300: 5 full blocks (1280 tokens) before the last prompt token.
    ("cold", 1300, _reports("pp0", computed=1300), {}),
    ("warm_remote", 1300, _reports("p0", remote=1280, computed=20), {}),
    ("warm_local_dram", 1300, _reports("p0", dram=1280, computed=20), {}),
    ("gpu_hit", 1300, _reports("p0", gpu=1280, computed=20), {}),
    # An exact multiple of the block size still computes its last block.
    ("gpu_hit", 1024, _reports("p0", gpu=768, computed=256), {}),
    # A "remote" request that the peer could not serve was recomputed: say so.
    ("warm_remote", 1300, _reports("pp0", computed=1300),
     {"remote": (0, 1280), "computed": (1300, 20), "prefill_node": ("pp0", "p0")}),
    # The prefill node finished the request itself: no decode node took it.
    ("cold", 1300, _reports("pp0", decode="", computed=1300), {"decode_node": ("", "d0")}),
    ("cold", 1300, Reports(), {"prefill_report": (None, "a report")}),
])
def test_route_mismatches_accept_each_intended_path_and_name_what_differs(
        case: str, n: int, reports: Reports, wrong: dict) -> None:
    assert route_mismatches(case, n, BS, reports) == wrong


def test_gpu_check_dry_run_reports_no_cuda_with_its_own_exit_code(tmp_path: Path) -> None:
    from tools.bench.gpu_check import EXIT_NO_CUDA

    env = {**os.environ, "OUT": str(tmp_path), "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run([sys.executable, "-m", "tools.bench.gpu_check", "--dry-run"], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == EXIT_NO_CUDA, proc.stderr[-3000:]
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert report["environment"]["cuda_available"] is False
    assert report["ok"] is False and "CUDA" in report["reason"]
    assert json.loads(proc.stdout) == report
