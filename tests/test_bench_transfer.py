"""``cpd bench transfer --quick`` end to end: real peer processes, real UCX and NATS; the
JSON carries the documented keys with sane values. The benchmark itself checks that CPD,
raw UCX and NATS delivered the same bytes (it fails otherwise). Speed is measured by the
benchmark, never asserted here."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.timeout(180)
def test_quick_transfer_bench_reports_every_case_side_by_side(tmp_path: Path) -> None:
    out = tmp_path / "transfer.json"
    # A process of its own: the benchmark initialises UCX for the process.
    proc = subprocess.run(
        [sys.executable, "-m", "tools.cli", "bench", "transfer", "--quick", "--json", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=170)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(out.read_text())

    assert r["quick"] is True
    assert r["headline_case"] == {"blocks": 16, "block_bytes": 1 << 20}
    cases = {(c["blocks"], c["block_bytes"]): c for c in r["cases"]}
    # Batches of 1, 16 and 256 blocks, capped at 64 MiB a case.
    assert set(cases) == {(min(b, (64 << 20) // s), s) for s in (64 << 10, 1 << 20, 8 << 20)
                          for b in (1, 16, 256)}
    for c in r["cases"]:
        assert c["total_bytes"] == c["blocks"] * c["block_bytes"]
        for key in ("gbps", "raw_ucx_gbps", "nats_gbps", "memcpy_gbps", "cpd_ms"):
            assert c[key] > 0, (key, c)
        # Each figure has 4 significant digits: ratios of them agree within 0.2 %.
        assert c["vs_raw_ucx"] == pytest.approx(c["gbps"] / c["raw_ucx_gbps"], rel=0.002)
        assert c["vs_nats"] == pytest.approx(c["gbps"] / c["nats_gbps"], rel=0.002)
    head = cases[(16, 1 << 20)]
    for key in ("gbps", "raw_ucx_gbps", "nats_gbps", "memcpy_gbps", "vs_raw_ucx", "vs_nats"):
        assert r[key] == head[key], key
    # The same-host transport of the data plane, not TCP loopback (docs/benchmarks/transfer.md).
    assert "posix" in r["ucx"]["active_transports"]
    assert r["ucx"]["options"]["POSIX_ERROR_HANDLING"] == "y"
    assert r["reps"] >= 3 and r["min_seconds_per_way"] > 0
