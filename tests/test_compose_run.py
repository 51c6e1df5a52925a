"""docker-compose.yml, started: the images built with podman here (``cpd images build``:
a Debian base from mmdebstrap, the Dockerfile's ``control`` and ``worker-cpu`` targets),
the file run by ``podman-compose`` with least-privilege NATS secrets, a completion served
through the gateway, and a cold → warm pair whose warm request loads the prefix from the
pre-prefill container's arena over UCX (TCP between containers). Everything is removed
after: containers, their network and volumes; the images keep their fixed tags."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from tests.helpers.cluster import free_ports
from tools.images import build, podman

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500)]

ROOT = Path(__file__).resolve().parent.parent
PROJECT = "cpdtest"
BS = 256


def _compose_cmd() -> list[str]:
    found = shutil.which("podman-compose") or str(Path(sys.executable).parent / "podman-compose")
    assert Path(found).exists(), "podman-compose is missing (a dev dependency)"
    return [found, "-p", PROJECT]


class _Stack:
    def __init__(self, folder: Path) -> None:
        self.folder = folder
        nats_port, gateway_port = free_ports(2)
        self.env = {**os.environ, "CPD_NATS_PUBLISH": str(nats_port),
                    "CPD_GATEWAY_PUBLISH": str(gateway_port)}

    def compose(self, *args: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
        return subprocess.run([*_compose_cmd(), *args], cwd=self.folder, env=self.env,
                              capture_output=True, text=True, timeout=timeout)

    def container(self, service: str) -> str:
        return f"{PROJECT}_{service}_1"

    def logs(self, service: str) -> str:
        return subprocess.run([podman(), "logs", "--tail", "60", self.container(service)],
                              capture_output=True, text=True).stdout[-4000:]

    def down(self) -> None:
        self.compose("down", "-v", "-t", "10", timeout=300)
        # Whatever a failed start left behind under this project's name.
        names = subprocess.run([podman(), "ps", "-a", "--filter", f"name={PROJECT}_",
                                "--format", "{{.Names}}"], capture_output=True,
                               text=True).stdout.split()
        if names:  # --depend: dependents first (compose's depends_on links them)
            subprocess.run([podman(), "rm", "-f", "--depend", *names], capture_output=True)
        for kind in ("network", "volume"):
            listed = subprocess.run([podman(), kind, "ls", "--format", "{{.Name}}"],
                                    capture_output=True, text=True).stdout.split()
            mine = [n for n in listed if n.startswith(f"{PROJECT}_")]
            if mine:
                subprocess.run([podman(), kind, "rm", "-f", *mine], capture_output=True)


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[_Stack]:
    build(["control", "worker-cpu"])
    folder = tmp_path_factory.mktemp("compose")
    # The warm request must cross containers over UCX, even with pre-prefill idle.
    compose = (ROOT / "docker-compose.yml").read_text()
    knob = "      CPD_ROUTER__POLICY: cpd\n"
    assert knob in compose
    (folder / "docker-compose.yml").write_text(compose.replace(
        knob, knob + '      CPD_ROUTER__WARM_ON_IDLE_PREPREFILL: "false"\n'))
    subprocess.run([sys.executable, "-m", "tools.cli", "secure", "init",
                    str(folder / "secrets")], check=True, capture_output=True)
    s = _Stack(folder)
    s.down()  # a previous run's leftovers
    try:
        up = s.compose("up", "-d", "--no-build")
        assert up.returncode == 0, up.stderr[-4000:]
        _wait_ready(s)
        yield s
    finally:
        s.down()


_REQUEST = """
import json, sys, urllib.request
body = json.loads(sys.argv[1])
req = urllib.request.Request("http://127.0.0.1:8000" + body.pop("path"),
                             data=json.dumps(body).encode(),
                             headers={"Content-Type": "application/json"})
with urllib.request.urlopen(req, timeout=240) as r:
    print(r.read().decode())
"""


def _wait_ready(s: _Stack, timeout: float = 900) -> None:
    # Ready (a prefill side and a decode node) and all three workers alive: the first
    # cold request must find the pre-prefill node, not overflow to prefill.
    probe = ("import json, urllib.request, sys\n"
             "try:\n"
             "    r = urllib.request.urlopen('http://127.0.0.1:8000/ready', timeout=5)\n"
             "    sys.exit(0 if json.loads(r.read())['workers'] >= 3 else 1)\n"
             "except Exception:\n"
             "    sys.exit(1)\n")
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done = subprocess.run([podman(), "exec", s.container("gateway"), "python", "-c", probe],
                              capture_output=True)
        if done.returncode == 0:
            return
        time.sleep(5)
    raise AssertionError("the stack never became ready: " + "\n".join(
        f"--- {svc}\n{s.logs(svc)}" for svc in ("nats", "kvindex", "router", "gateway",
                                                 "preprefill", "prefill", "decode")))


def _complete(s: _Stack, **body: object) -> dict:
    done = subprocess.run([podman(), "exec", s.container("gateway"), "python", "-c", _REQUEST,
                           json.dumps({"path": "/v1/completions", **body})],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:] + s.logs("router")
    return json.loads(done.stdout)


def test_compose_serves_a_completion_and_a_cold_then_warm_pair(stack: _Stack) -> None:
    first = _complete(stack, model="cpd-tiny", prompt="def fib(n):", max_tokens=8)
    assert first["usage"]["completion_tokens"] == 8 and first["choices"][0]["text"]

    rng = np.random.default_rng(5)
    prefix = rng.integers(0, 1900, size=5 * BS).tolist()
    cold = _complete(stack, model="cpd-tiny", prompt=prefix + rng.integers(0, 1900, 40).tolist(),
                     max_tokens=4, temperature=0)
    route = cold["cpd"]["route"]
    assert (route["path"], route["prefill_node"]) == ("cold", "preprefill-0"), route
    time.sleep(2)  # the sealed blocks' events reach kvindex (milliseconds here)
    warm = _complete(stack, model="cpd-tiny", prompt=prefix + rng.integers(0, 1900, 70).tolist(),
                     max_tokens=4, temperature=0)
    route = warm["cpd"]["route"]
    assert (route["path"], route["prefill_node"], route["remote_node"]) == (
        "warm", "prefill-0", "preprefill-0"), route
    assert route["tokens"]["remote"] == 5 * BS and not route.get("load_error"), route
