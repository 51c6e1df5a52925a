"""``python -m services.worker`` takes its role from ``worker.role``; the role entry points
(``python -m services.prefill`` ...) keep their own; the cluster tests start those."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest


def _run(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("CPD_")}
    return subprocess.run([sys.executable, "-m", "services.worker"], env={**clean, **env},
                          capture_output=True, text=True, timeout=60)


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("env", "message"), [
    ({}, "set worker.role (CPD_WORKER__ROLE) to one of preprefill, prefill, decode"),
    ({"CPD_WORKER__ROLE": "router"}, "worker.role 'router' is not one of"),
])
def test_a_worker_without_a_valid_role_stops_with_a_message(env: dict[str, str],
                                                            message: str) -> None:
    out = _run(env)
    assert out.returncode != 0
    assert message in out.stdout + out.stderr, out.stderr[-2000:]

