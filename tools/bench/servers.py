"""The two servers ``cpd bench client`` compares, started as a user would: ``cpd up`` and
vLLM's own OpenAI server on the same model folder (also the reference server tests
compare CPD's prompts with). Each runs in a session of its own, stopped with Ctrl-C and
then whatever is left of its session."""

from __future__ import annotations

import abc
import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Coroutine, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

from cpd.engines.servedmodel import FALLBACK_CHAT_TEMPLATE, ServedModel
from cpd.modelbuild.runtime import prepare_cpu_env
from cpd.ops.config import Settings
from tools.bench.hostinfo import free_port, machine_info
from tools.cluster import stop_tree
from tools.supervisor import UP_BANNER

PRESET = "tiny"
START_TIMEOUT_S = 600.0  # three engines on a busy two-core host
STOP_TIMEOUT_S = 60.0
HEALTH_POLL_S = 1.0
LOG_TAIL_CHARS = 3000

T = TypeVar("T")


class Server(abc.ABC):
    """A server process in its own session (its engines die with it)."""

    name = ""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.log_path = tmp / f"{self.name}.log"
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None
        self.started_s = 0.0

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    @abc.abstractmethod
    def command(self) -> tuple[list[str], dict[str, str]]:
        """The server's argv and environment."""

    async def start(self) -> None:
        import httpx

        argv, env = self.command()
        t0 = time.perf_counter()
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT,
                                         start_new_session=True,
                                         cwd=Path(__file__).resolve().parents[2])
        deadline = time.monotonic() + START_TIMEOUT_S
        async with httpx.AsyncClient(timeout=5) as http:
            while True:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"{self.name} exited during start-up:\n{self.log_tail()}")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{self.name} not ready in {START_TIMEOUT_S:.0f} s:\n"
                                       + self.log_tail())
                with contextlib.suppress(httpx.HTTPError):
                    if (await http.get(self.base_url.removesuffix("/v1") + "/health")
                            ).status_code == 200 and self.serving():
                        break
                await asyncio.sleep(HEALTH_POLL_S)
        self.started_s = time.perf_counter() - t0

    def stop(self) -> None:
        """Ctrl-C as a user would (``cpd up`` then stops its services, each in a session
        of its own), then whatever is left of the process's own session."""
        if self.proc is not None:
            if self.proc.poll() is None:
                self.proc.send_signal(signal.SIGINT)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self.proc.wait(STOP_TIMEOUT_S)
            stop_tree(self.proc, STOP_TIMEOUT_S)
            self.proc = None

    def serving(self) -> bool:
        """Beyond a healthy HTTP endpoint: whatever else must be up to serve."""
        return True

    def log_tail(self) -> str:
        with contextlib.suppress(OSError):
            return self.log_path.read_text(errors="replace")[-LOG_TAIL_CHARS:]
        return ""


class CpdUpServer(Server):
    """``cpd up``: NATS, a front end (gateway, router, kvindex), pre-prefill, prefill,
    decode; ``env``
    (settings as ``CPD_…`` variables) and ``args`` (``cpd up``'s flags) vary it, under
    another ``name``."""

    name = "cpd"

    def __init__(self, tmp: Path, settings: Settings, *, name: str = "cpd",
                 env: Mapping[str, str] | None = None, args: Sequence[str] = ()) -> None:
        self.name = name
        super().__init__(tmp)
        self.settings = settings
        self.extra_env = dict(env or {})
        self.args = list(args)

    def command(self) -> tuple[list[str], dict[str, str]]:
        env = {**os.environ, "CPD_GATEWAY__PORT": str(self.port),
               "CPD_GATEWAY__HOST": "127.0.0.1",
               "CPD_NATS__EMBEDDED_STORE_DIR": str(self.tmp / "cpd" / "nats"),
               "CPD_KVINDEX__SNAPSHOT_DIR": str(self.tmp / "cpd" / "snap"),
               "CPD_MODEL__PRESET": PRESET, "CPD_WORKER__ENGINE": "vllm",
               "CPD_MODEL__CACHE_DIR": str(self.settings.model_cache_dir),
               "CPD_TELEMETRY__LOG_JSON": "false", "PYTHONUNBUFFERED": "1",
               **self.extra_env}
        return [sys.executable, "-m", "tools.cli", "up", "--port", str(free_port()),
                *self.args], env

    def serving(self) -> bool:
        # The gateway answers once a router does; requests need the workers too, which
        # `cpd up` reports with its banner.
        with contextlib.suppress(OSError):
            return UP_BANNER in self.log_path.read_text(errors="replace")
        return False


class VllmServer(Server):
    """vLLM's own OpenAI server on the same model folder, with vLLM's defaults."""

    name = "monolithic"

    def __init__(self, tmp: Path, model: ServedModel, served_name: str,
                 block_size: int, *, args: Sequence[str] = ()) -> None:
        super().__init__(tmp)
        self.args = list(args)  # more of vLLM's server flags
        self.folder = model.folder
        self.served_name = served_name
        self.block_size = block_size
        # The chat template the gateway renders with, so both servers see the same prompt.
        self.chat_template = tmp / "chat_template.jinja"
        self.chat_template.write_text(model.chat_template or FALLBACK_CHAT_TEMPLATE)

    def command(self) -> tuple[list[str], dict[str, str]]:
        prepare_cpu_env()  # the same bounded KV cache and offline flags as CPD's engines
        env = {k: v for k, v in os.environ.items() if not k.startswith("OMP_")}
        argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server",
                "--model", str(self.folder), "--served-model-name", self.served_name,
                "--host", "127.0.0.1", "--port", str(self.port), "--dtype", "float32",
                "--block-size", str(self.block_size), "--enable-prefix-caching",
                "--gpu-memory-utilization", "0.15", "--seed", "0",
                "--chat-template", str(self.chat_template),
                "--disable-log-stats", "--disable-uvicorn-access-log", *self.args]
        return argv, {**env, "PYTHONUNBUFFERED": "1"}


async def measured(srv: Server, measure: Callable[[], Awaitable[T]]
                   ) -> tuple[T, dict[str, float]]:
    """Start ``srv``, ``measure`` it and stop it, whatever happens (printing its log's
    tail when something failed): what ``measure`` returned, and the server's
    ``start_s`` (to ready) and ``measure_s``."""
    try:
        await srv.start()
        t0 = time.perf_counter()
        result = await measure()
        return result, {"start_s": round(srv.started_s, 1),
                        "measure_s": round(time.perf_counter() - t0, 1)}
    except Exception:
        print(f"--- {srv.name} log tail ---\n{srv.log_tail()}", file=sys.stderr)
        raise
    finally:
        await asyncio.to_thread(srv.stop)


def run_in_tmp(prefix: str, measure: Callable[[Path], Coroutine[Any, Any, dict[str, Any]]]
               ) -> dict[str, Any]:
    """Run a server benchmark's ``measure`` in a temporary directory it may fill (removed
    after); its result, with the machine's description. The servers it starts get a
    temp folder inside it (``TMPDIR``): vLLM leaves its IPC sockets and rank rendezvous
    files there, and they go with it."""
    with tempfile.TemporaryDirectory(prefix=prefix) as tmp:
        children = Path(tmp) / "tmp"
        children.mkdir()
        before = os.environ.get("TMPDIR")
        os.environ["TMPDIR"] = str(children)
        try:
            result = asyncio.run(measure(Path(tmp)))
        finally:
            if before is None:
                os.environ.pop("TMPDIR", None)
            else:
                os.environ["TMPDIR"] = before
    result["machine"] = machine_info()
    return result
