"""A running :class:`~tools.cluster.spec.ClusterSpec`: embedded NATS and every node as a
process in its own session, started in stages and stopped by process group.

Start: NATS, then kvindex, the workers, the router and the gateway, each stage serving
(:mod:`tools.cluster.ready`) before the next; a process that exits fails the start at
once with its log (one NATS refused, as such). Stop: the supervisor, the client, the
nodes in reverse stages (SIGTERM, then SIGKILL of the group), NATS, the temporary
folder; safe to call twice, and whatever a cancelled stop did not reach is killed anyway.
:mod:`tools.cluster.state` holds the parts and their reads.
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import signal
import tempfile
import time
from collections.abc import Callable, Collection
from dataclasses import replace
from pathlib import Path
from types import TracebackType

from cpd.bus import Bus
from cpd.client import Client
from cpd.engines.profile import engine_profile
from cpd.ops.config import Settings, load_settings
from cpd.ops.natsserver import NatsServer
from cpd.protocol import wire
from cpd.protocol.errors import CpdError
from cpd.protocol.hashing import Namespace
from cpd.protocol.roles import WORKER_ROLES
from tools.cluster.procs import (
    Proc,
    engine_placements,
    kill_tree,
    log,
    restart_proc,
    settings_env,
    start_failure,
)
from tools.cluster.ready import (
    heartbeat_since,
    kvindex_serving,
    report_starting,
    router_sees,
    until_ready,
    wait_ready,
)
from tools.cluster.spec import TMP_DIR, ClusterSpec, NodeSpec, hosts_kvindex
from tools.cluster.state import ClusterState

# How often the supervisor looks for dead processes.
SUPERVISE_INTERVAL_S = 0.2
# Before NATS runs its URL is unknown; settings are validated with this one meanwhile.
_PLACEHOLDER_URL = "nats://127.0.0.1:4222"


def _quiet(line: str) -> None:
    """No progress lines (a harness's default)."""


class Cluster(ClusterState):
    """The processes of ``spec``; an async context manager (start, then stop)."""

    def __init__(self, spec: ClusterSpec,
                 progress: Callable[[str], None] | None = None) -> None:
        """``progress`` gets a line as each node starts and serves, and every few seconds
        while some are still starting (``cpd up``'s terminal)."""
        super().__init__(spec)
        self._report = progress or _quiet
        self._reporting = progress is not None
        # (monotonic time, node or "nats") of every restart the supervisor made.
        self.restarts: list[tuple[float, str]] = []
        # Each worker's heartbeat its latest readiness wait saw.
        self.heartbeats: dict[str, wire.Heartbeat] = {}
        self._own_workdir = spec.workdir is None
        self._env: dict[str, str] = {}
        self._settings: dict[str | None, Settings] = {}
        self._client: Client | None = None
        self._connecting = asyncio.Lock()
        self._supervisor: asyncio.Task[None] | None = None
        self._paused: set[str] = set()
        self._down: set[str] = set()  # stopped on purpose: not restarted
        # A deliberate NATS restart in progress: the supervisor must not start a second
        # server on the same port between its stop and its start.
        self._nats_restarting = False
        self._stopped = False

    async def __aenter__(self) -> Cluster:
        return await self.start()

    async def __aexit__(self, exc_type: type[BaseException] | None,
                        exc: BaseException | None, tb: TracebackType | None) -> None:
        await self.stop()

    # ---------------------------------------------------------------- start, stop

    async def start(self) -> Cluster:
        """Validate every node's settings, start NATS, build the model (vLLM), then the
        nodes stage by stage, each stage serving before the next. A start that fails
        stops whatever it started."""
        if self.nats is not None or self._stopped:
            raise CpdError(f"{self.spec.label}: a cluster starts once")
        if self._workdir is None:
            self._workdir = Path(tempfile.mkdtemp(prefix=f"cpd-{self.spec.label}-"))
        try:
            base = self.spec.base_env(self.workdir, _PLACEHOLDER_URL)
            for node in self.spec.nodes:  # a typo fails here, not as a child crashing
                self._load_settings(node.child_env(base))
            await self._start()
        except BaseException:
            await self.stop()
            raise
        return self

    async def _start(self) -> None:
        (self.workdir / TMP_DIR).mkdir(parents=True, exist_ok=True)
        nats = self.spec.nats
        self.nats = NatsServer(port=nats.port, store_dir=nats.store_dir or self.workdir / "nats",
                               log_file=str(self.workdir / "nats.log"),
                               extra_args=nats.extra_args, config_file=nats.config_file)
        await asyncio.to_thread(self.nats.start)
        self._env = self.spec.base_env(self.workdir, self.nats.url)
        if self.spec.build_model and any(n.service != "kvindex" for n in self.spec.nodes):
            # Once, before the services that load it (each would build it, all at once).
            await asyncio.to_thread(lambda: engine_profile(self.settings()).served_model())
        for stage in sorted({n.stage for n in self.spec.nodes}):
            nodes = [n for n in self.spec.nodes if n.stage == stage]
            groups = [[n] for n in nodes] if self.spec.serial_start and stage == 1 else [nodes]
            for group in groups:
                await self._launch([n.node_id for n in group])
        if any(n.service in ("router", "frontend") for n in self.spec.nodes):
            # A router checked at its own stage saw only the workers started by then (a
            # front end starts first: it holds the index the workers publish to).
            await self._router_sees_workers(self.spec.ready_timeout_s)

    async def stop(self) -> None:
        """Stop everything (supervisor, client, nodes in reverse stages, NATS) and remove
        a temporary workdir; a second call does nothing."""
        if self._stopped:
            return
        self._stopped = True
        try:
            await self.stop_supervising()
            for node in list(self._paused):
                self.resume(node)
            if self._client is not None:
                await _close_client(self._client)
            for stage in sorted({n.stage for n in self.spec.nodes}, reverse=True):
                await asyncio.gather(*(
                    asyncio.to_thread(p.terminate, self.spec.stop_timeout_s)
                    for p in self.procs.values() if self.spec.node(p.node_id).stage == stage))
            if self.nats is not None:
                await asyncio.to_thread(self.nats.stop)
        finally:
            self.kill_all()  # what a cancelled or failed stop did not reach

    def kill_all(self) -> None:
        """SIGKILL every node's process group and NATS, remove a temporary workdir
        (synchronous: for use after Ctrl-C, when no event loop runs)."""
        self._stopped = True
        for p in self.procs.values():
            if p.popen is not None:
                p.signal_group(signal.SIGCONT)  # a paused group dies only once resumed
                kill_tree(p.popen)
        if self.nats is not None:
            self.nats.kill()
        if self._workdir is not None:
            shutil.rmtree(self._workdir if self._own_workdir else self._workdir / TMP_DIR,
                          ignore_errors=True)

    # ---------------------------------------------------------------- settings

    @staticmethod
    def _load_settings(env: dict[str, str]) -> Settings:
        return load_settings(environ=settings_env(env))

    def settings(self, node: str | None = None) -> Settings:
        """The settings ``node`` runs with (``None``: a client of this cluster's)."""
        self._need(self._env or None)
        if node not in self._settings:
            env = ({**self._env, **self.spec.client_env} if node is None
                   else self.spec.node(node).child_env(self._env))
            self._settings[node] = self._load_settings(env)
        return self._settings[node]

    # ---------------------------------------------------------------- nodes

    async def _launch(self, nodes: list[str], wait: bool = True) -> None:
        """Start ``nodes`` (again) and, with ``wait``, wait until each serves."""
        since_ms, t0 = int(time.time() * 1000), time.monotonic()
        started = [self._spawn(node) for node in nodes]
        if not wait:
            return
        pending = {p.node_id for p in started}
        reporter = (asyncio.create_task(report_starting(started, pending, t0, self._report))
                    if self._reporting else None)
        try:
            await until_ready(asyncio.gather(*(self._serving(p, since_ms, t0, pending)
                                               for p in started)), started, self._exited)
        finally:
            if reporter is not None:
                reporter.cancel()

    def _spawn(self, node: str) -> Proc:
        """Start ``node``'s process, its engine on the cores ``cpd up`` would give it."""
        env = self.spec.node(node).child_env(self._env)
        placed = (engine_placements(self.settings(), self.spec.services()).get(node)
                  if self.spec.placement else None)
        where = ""
        if placed is not None:
            cpus = env.setdefault("CPD_WORKER__ENGINE_CPUS", placed.cpu_list)
            threads = env.setdefault("CPD_WORKER__ENGINE_THREADS", str(placed.threads))
            where = f" (engine on CPUs {cpus}, {threads} threads)"
        proc = self.procs.get(node)
        if proc is None:
            spec = self.spec.node(node)
            proc = self.procs[node] = Proc(spec.service, node, self.log_path(node), env)
        proc.env = env
        self._down.discard(node)
        proc.start()
        self._report(f"starting {node}{where}")
        return proc

    def _exited(self, p: Proc) -> str | None:
        return start_failure(p, self.spec.label)

    async def _serving(self, p: Proc, since_ms: int, t0: float, pending: set[str]) -> None:
        """PING, then the role's own probe (:mod:`tools.cluster.ready`)."""
        deadline = t0 + self.spec.ready_timeout_s
        await wait_ready(self.url, p.service, p.node_id, deadline - time.monotonic(),
                         self.settings().nats)
        left = max(deadline - time.monotonic(), 1.0)
        if hosts_kvindex(p.service, self.settings(p.node_id)):
            await kvindex_serving((await self.connect()).bus, left)
        if p.service in WORKER_ROLES:
            await self._heartbeat(p.node_id, since_ms, left)
        elif p.service in ("router", "frontend"):
            await self._router_sees_workers(left)
        pending.discard(p.node_id)
        log.info("service.ready", service=p.service, node=p.node_id)
        self._report(f"{p.node_id} ready ({time.monotonic() - t0:.0f} s)")

    async def _router_sees_workers(self, timeout: float) -> None:
        """Until the router's status lists every started worker not stopped on purpose."""
        await router_sees(await self.connect(), [n for n in self.workers if n in self.procs
                                                 and n not in self._down], timeout)

    async def _heartbeat(self, node: str, since_ms: int, timeout: float) -> None:
        bus = (await self.connect()).bus
        self.heartbeats[node] = await heartbeat_since(bus, node, since_ms, timeout)

    async def wait_heartbeats(self, nodes: Collection[str], since_ms: int = 0,
                              timeout_s: float | None = None) -> dict[str, wire.Heartbeat]:
        """A heartbeat of each of ``nodes`` from an incarnation started at or after
        ``since_ms`` (unix ms); one of their processes exiting fails the wait at once."""
        timeout = self.spec.ready_timeout_s if timeout_s is None else timeout_s
        await until_ready(asyncio.gather(*(self._heartbeat(n, since_ms, timeout)
                                           for n in nodes)),
                          [self.procs[n] for n in nodes], self._exited)
        return {n: self.heartbeats[n] for n in nodes}

    def namespace(self, node: str) -> Namespace:
        """The block namespace ``node`` announced in the heartbeat its readiness saw."""
        hb = self._need(self.heartbeats.get(node), f"no heartbeat of {node} seen")
        return Namespace.from_spec(hb.namespace_spec)

    async def add(self, node: NodeSpec, *, wait: bool = True) -> None:
        """Start ``node``, which the spec did not have, and wait until it serves; without
        ``wait``, return once its process runs (a caller timing the start-up itself)."""
        self._load_settings(node.child_env(self._need(self._env or None)))
        self.spec = replace(self.spec, nodes=(*self.spec.nodes, node))  # refuses a repeat
        await self._launch([node.node_id], wait=wait)

    async def remove(self, node: str) -> None:
        """Stop ``node`` gracefully and forget it (:meth:`add` may start it anew)."""
        await self.stop_node(node)
        del self.procs[node]
        self._down.discard(node)
        self._settings.pop(node, None)
        self.heartbeats.pop(node, None)
        self.spec = replace(self.spec,
                            nodes=tuple(n for n in self.spec.nodes if n.node_id != node))

    async def restart(self, node: str) -> None:
        """Stop ``node`` if it runs, start it again (also after :meth:`stop_node` or a
        kill) and wait until the new incarnation serves."""
        p = self.procs[node]
        self._down.add(node)  # the supervisor must not start it meanwhile
        self.resume(node)
        if p.popen is not None:
            await asyncio.to_thread(p.terminate, self.spec.stop_timeout_s)
        await self._launch([node])

    async def stop_node(self, node: str) -> None:
        """Stop ``node`` gracefully; the supervisor leaves it down."""
        self._down.add(node)
        self.resume(node)
        await asyncio.to_thread(self.procs[node].terminate, self.spec.stop_timeout_s)

    def crashed(self) -> list[str]:
        """Nodes whose process exited without :meth:`stop_node` (a crash or a kill not
        yet followed by :meth:`restart`)."""
        return [n for n in self.dead() if n not in self._down]

    def kill(self, node: str) -> None:
        """``kill -9`` the node's process group (the supervisor, if on, restarts it)."""
        p = self.procs[node]
        if p.popen is not None:
            kill_tree(p.popen)
        self._paused.discard(node)

    def pause(self, node: str) -> None:
        """SIGSTOP the node's process group (a hung host: sockets open, nothing moves)."""
        self.procs[node].signal_group(signal.SIGSTOP)
        self._paused.add(node)

    def resume(self, node: str) -> None:
        """SIGCONT the node's process group."""
        self.procs[node].signal_group(signal.SIGCONT)
        self._paused.discard(node)

    def restart_nats(self) -> None:
        """Stop NATS gracefully and start it again on the same port and store."""
        nats = self._need(self.nats)
        self._nats_restarting = True
        try:
            nats.restart()
        finally:
            self._nats_restarting = False

    def kill_nats(self) -> None:
        """``kill -9`` NATS (the supervisor, if on, restarts it)."""
        self._need(self.nats).kill()

    # ---------------------------------------------------------------- supervision

    def supervise(self, on_event: Callable[[str], None] | None = None) -> None:
        """Restart any node that exits, and NATS, as ``cpd up`` does
        (:func:`tools.cluster.procs.restart_proc`), in the background until
        :meth:`stop_supervising`; ``on_event`` gets a line per decision."""
        if self._supervisor is None or self._supervisor.done():
            self._supervisor = asyncio.create_task(
                self._supervise(on_event or (lambda _: None)), name="supervisor")

    async def stop_supervising(self) -> None:
        """End :meth:`supervise`."""
        task, self._supervisor = self._supervisor, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _supervise(self, report: Callable[[str], None]) -> None:
        while True:
            await asyncio.sleep(SUPERVISE_INTERVAL_S)
            nats = self.nats
            if nats is not None and not self._nats_restarting and (
                    nats.proc is None or nats.proc.poll() is not None):
                log.warning("nats.restarting")
                report("NATS exited; restarting it")
                await asyncio.to_thread(nats.start)
                self.restarts.append((time.monotonic(), "nats"))
            for node, p in self.procs.items():
                if node not in self._down and not p.alive() and restart_proc(p, report):
                    self.restarts.append((time.monotonic(), node))

    # ---------------------------------------------------------------- access

    async def connect(self) -> Client:
        """The cluster's client (one connection, opened on first use)."""
        async with self._connecting:
            if self._client is None:
                self._client = await Client.connect(settings=self.settings(),
                                                    name=f"cpd-{self.spec.label}")
        return self._client

    @property
    def client(self) -> Client | None:
        """The client once :meth:`connect` (or a start that needed it) opened it."""
        return self._client

    @property
    def bus(self) -> Bus:
        """The client's NATS connection (after :meth:`connect`)."""
        return self._need(self._client, "no client yet (await connect())").bus

    async def until_router_sees(self, nodes: Collection[str], timeout_s: float = 30.0) -> None:
        """Wait until the router's status lists every one of ``nodes`` as alive."""
        await router_sees(await self.connect(), nodes, timeout_s)


async def _close_client(client: Client) -> None:
    """Close ``client``; what its closing raises (a connection already torn down, its own
    cancelled waits) must not keep a stopping cluster's nodes and NATS running."""
    try:
        await client.close()
    except asyncio.CancelledError:
        task = asyncio.current_task()
        if task is not None and task.cancelling():  # the stop itself was cancelled
            raise
    except Exception:  # closing: the stop goes on regardless
        pass


__all__ = ["Cluster"]
