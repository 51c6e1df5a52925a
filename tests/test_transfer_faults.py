"""The UCX fault cases (tests/helpers/ucx_fault_cases.py), each in a fresh Python process."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

CASES = Path(__file__).parent / "helpers" / "ucx_fault_cases.py"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("case", [
    "test_peer_killed_mid_transfer_is_peer_gone_within_the_deadline",
    "test_peer_killed_mid_coalesced_get_is_peer_gone_within_the_deadline",
    "test_paused_peer_times_out_within_the_deadline",
    "test_paused_peer_times_out_a_coalesced_get_within_the_deadline",
    "test_a_dead_address_fails_typed_within_the_deadline",
    "test_a_resumed_peer_serves_a_fresh_connection",
    "test_connecting_ahead_to_a_dead_peer_is_one_bounded_silent_dial",
    "test_a_handshake_answered_after_its_timeout_writes_into_kept_buffers",
])
def test_fault_case_in_its_own_process(case: str) -> None:
    out = subprocess.run([sys.executable, "-m", "pytest", f"{CASES}::{case}", "-q",
                          "-p", "no:cacheprovider"], capture_output=True, text=True,
                         timeout=110)
    tail = out.stdout.strip().splitlines()[-1] if out.stdout.strip() else ""
    assert "1 passed" in tail and "failed" not in tail, \
        out.stdout[-3000:] + out.stderr[-2000:]
