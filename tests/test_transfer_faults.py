"""The UCX fault cases (tests/ucx_fault_cases.py), each in a fresh Python process."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

CASES = Path(__file__).with_name("ucx_fault_cases.py")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("case, want", [
    ("test_peer_killed_mid_transfer_is_peer_gone_within_the_deadline", "1 passed"),
    ("test_peer_killed_mid_coalesced_get_is_peer_gone_within_the_deadline", "1 passed"),
    ("test_paused_peer_times_out_within_the_deadline", "1 passed"),
    ("test_paused_peer_times_out_a_coalesced_get_within_the_deadline", "1 passed"),
    ("test_a_dead_address_fails_typed_within_the_deadline", "1 passed"),
    # Known stall after an aborted endpoint (issue 4): passes or xfails with a typed
    # TransferTimeout; any other outcome (a hang, another error) fails here.
    ("test_a_resumed_peer_serves_a_fresh_connection", ("1 xpassed", "1 xfailed")),
])
def test_fault_case_in_its_own_process(case: str, want: str | tuple[str, ...]) -> None:
    out = subprocess.run([sys.executable, "-m", "pytest", f"{CASES}::{case}", "-q",
                          "-p", "no:cacheprovider"], capture_output=True, text=True,
                         timeout=110)
    tail = out.stdout.strip().splitlines()[-1] if out.stdout.strip() else ""
    wants = (want,) if isinstance(want, str) else want
    assert any(w in tail for w in wants) and "failed" not in tail.replace("xfailed", ""), \
        out.stdout[-3000:] + out.stderr[-2000:]
