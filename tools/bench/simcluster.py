"""A whole CPD cluster of real service processes on simulated engines (``worker.engine =
"sim"``): embedded NATS, kvindex, sim workers, router. Shared by ``cpd bench sweep``
(:mod:`bench.sweep`) and the fault harness (:mod:`bench.faults`).

The harness also needs what an operator's supervisor does (``cpd up``,
:func:`tools.supervisor.run_cluster`): :meth:`SimCluster.supervise` restarts a service that
died, NATS included, and the fault verbs (:meth:`kill`, :meth:`pause`, :meth:`resume`,
:meth:`restart_nats`) act on the real processes.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from collections.abc import Mapping
from pathlib import Path

from cpd.bus import Bus
from cpd.client import Client
from cpd.ops.config import load_settings
from cpd.ops.natsserver import NatsServer
from cpd.protocol import subjects, wire
from cpd.protocol.errors import CpdError
from tools.supervisor import Proc, kill_tree, until_ready, wait_ready

READY_TIMEOUT_S = 120.0
NODES_SEEN_TIMEOUT_S = 30.0
STOP_TIMEOUT_S = 10.0
# How often the supervisor looks for dead processes (cpd up polls every 0.5 s).
SUPERVISE_INTERVAL_S = 0.2


class SimCluster:
    """NATS, kvindex, sim workers (``nodes``: node id → role) and a router, as processes.

    ``env``: settings for every process (``CPD_<SECTION>__<FIELD>``); ``node_env``: extra
    settings of single nodes (a NATS URL through a fault proxy, an advertised port);
    ``nats_port``: a fixed NATS port (a proxy in front of it is set up before NATS runs).
    """

    def __init__(self, nodes: Mapping[str, str], tmp: Path, *, label: str = "cluster",
                 env: Mapping[str, str] | None = None,
                 node_env: Mapping[str, Mapping[str, str]] | None = None,
                 router_node: str = "router", kvindex_node: str = "kvi",
                 nats_port: int = 0) -> None:
        self.nodes = dict(nodes)
        self.nats_port = nats_port  # 0: any free port
        self.tmp = tmp
        self.label = label
        self.extra_env = dict(env or {})
        self.node_env = {k: dict(v) for k, v in (node_env or {}).items()}
        self.router_node = router_node
        self.kvindex_node = kvindex_node
        self.server: NatsServer | None = None
        self.procs: list[Proc] = []
        self.client: Client | None = None
        self.restarts: list[tuple[float, str]] = []   # (monotonic time, node) per restart
        self._supervisor: asyncio.Task[None] | None = None
        self._paused: set[str] = set()
        # A deliberate NATS restart in progress: the supervisor must not start a second
        # server on the same port between its stop and its start.
        self._nats_restarting = False

    # ------------------------------------------------------------------ start, stop

    @property
    def url(self) -> str:
        assert self.server is not None
        return self.server.url

    def base_env(self) -> dict[str, str]:
        env = {**os.environ, "CPD_NATS__SERVERS": self.url, "CPD_WORKER__ENGINE": "sim",
               "CPD_KVINDEX__SNAPSHOT_DIR": str(self.tmp / "snap"),
               "CPD_TELEMETRY__LOG_LEVEL": "warning", "CPD_TELEMETRY__LOG_JSON": "false",
               "PYTHONUNBUFFERED": "1", **self.extra_env}
        env.pop("CPD_CONFIG", None)
        return env

    async def start(self) -> None:
        """Start NATS, then kvindex, the workers and the router, each stage ready (PING)
        before the next; connect :attr:`client`; wait until the router sees every node."""
        self.tmp.mkdir(parents=True, exist_ok=True)
        self.server = NatsServer(port=self.nats_port, store_dir=self.tmp / "nats",
                                 log_file=str(self.tmp / "nats.log")).start()
        env = self.base_env()
        # kvindex before the workers (their events go to it), the router last.
        stages = [{self.kvindex_node: "kvindex"}, self.nodes, {self.router_node: "router"}]
        for stage in stages:
            started = []
            for node, service in stage.items():
                proc = Proc(service, node, self.tmp / f"{node}.log",
                            {**env, **self.node_env.get(node, {}), "CPD_NODE__NODE_ID": node})
                proc.start()
                self.procs.append(proc)
                started.append(proc)
            await self._wait_started(self.url, started)
        settings = load_settings(environ={}, overrides=[f"nats.servers={self.url}"])
        self.client = await Client.connect(settings=settings, name=f"cpd-{self.label}")
        await self.until_router_sees(set(self.nodes))

    async def _wait_started(self, url: str, procs: list[Proc]) -> None:
        """Until every one of ``procs`` answers a PING; a process that exits fails fast
        with its log."""
        ready = asyncio.gather(*(wait_ready(url, p.service, p.node_id, READY_TIMEOUT_S)
                                 for p in procs))
        await until_ready(ready, procs, lambda p: None if p.alive() else (
            f"{self.label}: {p.node_id} exited during start-up:\n{self.log_tail(p.node_id)}"))

    async def until_router_sees(self, nodes: set[str],
                                timeout_s: float = NODES_SEEN_TIMEOUT_S) -> None:
        """Wait until the router's status lists every one of ``nodes`` as alive."""
        assert self.client is not None
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with contextlib.suppress(CpdError):
                status = await self.client.status(timeout_s=1.0)
                if nodes <= {n.node for n in status.nodes if n.alive}:
                    return
            await asyncio.sleep(0.2)
        raise CpdError(f"the router did not see {sorted(nodes)} within {timeout_s:.0f}s")

    async def stop(self) -> None:
        await self.stop_supervising()
        for node in list(self._paused):
            self.resume(node)
        if self.client is not None:
            with contextlib.suppress(Exception):
                await self.client.close()
        for proc in reversed(self.procs):
            await asyncio.to_thread(proc.terminate, STOP_TIMEOUT_S)
        if self.server is not None:
            self.server.cleanup()

    # ------------------------------------------------------------------ supervision

    def supervise(self) -> None:
        """Restart any service that dies, and NATS, as ``cpd up`` does (in the
        background until :meth:`stop_supervising`)."""
        if self._supervisor is None or self._supervisor.done():
            self._supervisor = asyncio.create_task(self._supervise(), name="supervisor")

    async def stop_supervising(self) -> None:
        task, self._supervisor = self._supervisor, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _supervise(self) -> None:
        while True:
            await asyncio.sleep(SUPERVISE_INTERVAL_S)
            if self.server is not None and not self._nats_restarting and (
                    self.server.proc is None or self.server.proc.poll() is not None):
                await asyncio.to_thread(self.server.start)
                self.restarts.append((time.monotonic(), "nats"))
            for proc in self.procs:
                if not proc.alive():
                    if proc.popen is not None:
                        kill_tree(proc.popen)  # whatever the dead process started
                    proc.start()
                    self.restarts.append((time.monotonic(), proc.node_id))

    # ------------------------------------------------------------------ fault verbs

    def proc(self, node: str) -> Proc:
        for p in self.procs:
            if p.node_id == node:
                return p
        raise KeyError(node)

    def kill(self, node: str) -> None:
        """``kill -9`` the node's process tree (the supervisor restarts it)."""
        p = self.proc(node)
        assert p.popen is not None
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(p.popen.pid, signal.SIGKILL)

    def pause(self, node: str) -> None:
        """SIGSTOP the node's process group (a hung host: sockets open, nothing moves)."""
        p = self.proc(node)
        assert p.popen is not None
        os.killpg(p.popen.pid, signal.SIGSTOP)
        self._paused.add(node)

    def resume(self, node: str) -> None:
        p = self.proc(node)
        if p.popen is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.popen.pid, signal.SIGCONT)
        self._paused.discard(node)

    def restart_nats(self) -> None:
        """Stop NATS gracefully and start it again on the same port and store."""
        assert self.server is not None
        self._nats_restarting = True
        try:
            self.server.restart()
        finally:
            self._nats_restarting = False

    # ------------------------------------------------------------------ helpers

    async def reset_caches(self) -> None:
        """Drop every engine's own prefix cache (the GPU tier)."""
        assert self.client is not None
        bus: Bus = self.client.bus
        for node, role in self.nodes.items():
            await bus.request(subjects.admin(role, node), wire.ResetCache(reason="bench"),
                              expect=wire.Accepted, timeout=5.0)

    def cpu_seconds(self) -> dict[str, float]:
        """CPU time (user + system) each process has used so far: the evidence that this
        host, not the simulated cluster, was or was not the bottleneck."""
        out = {}
        tick = os.sysconf("SC_CLK_TCK")
        for p in self.procs:
            if p.popen is None:
                continue
            with contextlib.suppress(OSError, ValueError, IndexError):
                stat = Path(f"/proc/{p.popen.pid}/stat").read_text()
                fields = stat[stat.rindex(")") + 2:].split()
                out[p.node_id] = round((int(fields[11]) + int(fields[12])) / tick, 2)
        return out

    def log_tail(self, node: str, chars: int = 3000) -> str:
        with contextlib.suppress(OSError):
            return (self.tmp / f"{node}.log").read_text(errors="replace")[-chars:]
        return ""


__all__ = ["SimCluster"]
