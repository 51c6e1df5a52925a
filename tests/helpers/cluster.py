"""The real system on vLLM-CPU for end-to-end tests, and reference runs to compare with."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Collection
from pathlib import Path

from cpd.bus import Bus
from cpd.ops.config import Settings
from cpd.protocol import subjects, wire
from cpd.protocol.errors import CpdError
from cpd.protocol.hashing import Namespace, block_hashes
from tools.cluster import Cluster, ClusterSpec, NodeSpec, nodes_of

ROOT = Path(__file__).resolve().parent.parent.parent
PYTHON = sys.executable


def free_ports(n: int = 1) -> list[int]:
    """``n`` distinct ports free on the loopback right now."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


async def wait_visible(bus: Bus, ns: Namespace, prompt: list[int], node: str, blocks: int,
                       timeout: float = 30, tier: wire.Tier = wire.Tier.DRAM) -> None:
    """Until kvindex says ``blocks`` of ``prompt``'s blocks are visible in ``node``'s
    ``tier``."""
    hashes = block_hashes(ns, prompt)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            r = await bus.request(subjects.KVINDEX_LOOKUP, wire.LookupRequest(
                namespace=ns.id, block_hashes=hashes), expect=wire.LookupReply)
            if {(m.node, m.tier): m.num_blocks for m in r.matches}.get(
                    (node, tier), 0) >= blocks:
                return
        except CpdError:
            pass
        await asyncio.sleep(0.1)
    raise AssertionError(f"{blocks} blocks never became visible on {node}")


def run_engine_helper(script: str, model_cache: Path, name: str, *args: str) -> dict:
    """Run ``tests/helpers/<script>`` (vLLM needs a ``__main__`` of its own) with a fresh
    shared-memory arena path and ``args``, and return the JSON it prints after
    ``RESULT``."""
    shm = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(os.environ.get("TMPDIR", "/tmp"))
    arena = shm / f"cpd-test-{name}-{os.getpid()}"
    try:
        out = subprocess.run([PYTHON, str(ROOT / "tests" / "helpers" / script),
                              str(model_cache), str(arena), *args],
                             capture_output=True, text=True, timeout=540)
    finally:
        arena.unlink(missing_ok=True)
    line = next((x for x in out.stdout.splitlines() if x.startswith("RESULT ")), None)
    assert line, out.stdout[-3000:] + out.stderr[-5000:]
    return json.loads(line[len("RESULT "):])


# ----------------------------------------------------------------------------------------
# The real system on vLLM-CPU: NATS, kvindex and worker processes (tools.cluster). Engines
# take a minute to start on this machine, so every end-to-end module shares one cluster.

WORKERS = {"pp0": "preprefill", "p0": "prefill", "d0": "decode"}
KVINDEX = "kvi"
READY_TIMEOUT_S = 400.0
STOP_TIMEOUT_S = 60.0


class VllmCluster:
    """NATS + kvindex + worker processes (a :class:`tools.cluster.Cluster` in ``tmp``,
    with settings ``overrides`` of every process); tests may kill, restart, add and
    remove any of them."""

    def __init__(self, tmp: Path, model_cache: Path, *overrides: str) -> None:
        self.tmp = tmp
        self.model_cache = model_cache
        self.cluster = Cluster(ClusterSpec(
            nodes=nodes_of({KVINDEX: "kvindex", **WORKERS}), engine="vllm", workdir=tmp,
            label="vllm-test",
            overrides=(f"model.cache_dir={model_cache}", f"dataplane.arena_bytes={512 << 20}",
                       "nats.drain_timeout_s=2",
                       # Tests read the workers' info lines (peer dials) in their logs.
                       "telemetry.log_level=info", *overrides),
            # Engines on every core, as these tests' timeouts were set with; the cores
            # `cpd up` would give them are the benchmarks' business.
            placement=False, ready_timeout_s=READY_TIMEOUT_S, stop_timeout_s=STOP_TIMEOUT_S))
        # Every worker started, by role (one stopped by stop_worker too).
        self.roles: dict[str, str] = dict(WORKERS)
        self.ns: Namespace | None = None

    async def start(self) -> None:
        """Start everything (the model built once first); each worker heart-beating."""
        await self.cluster.start()
        self.ns = self.cluster.namespace("pp0")

    async def stop(self) -> None:
        """Stop every process (by group) and NATS; safe to call twice."""
        await self.cluster.stop()

    @property
    def url(self) -> str:
        """NATS's URL."""
        return self.cluster.url

    @property
    def bus(self) -> Bus:
        """The cluster client's NATS connection."""
        return self.cluster.bus

    @property
    def settings(self) -> Settings:
        """A client's settings (the model and arena size the workers run with)."""
        return self.cluster.settings()

    @property
    def procs(self) -> dict[str, subprocess.Popen[bytes]]:
        """The current process of every worker not stopped by :meth:`stop_worker`."""
        return {n: p.popen for n, p in self.cluster.procs.items()
                if n in self.roles and p.popen is not None}

    @property
    def kvindex_up(self) -> bool:
        """Whether the kvindex process runs."""
        return self.cluster.alive(KVINDEX)

    async def start_kvindex(self) -> None:
        """Start kvindex again; returns once it has replayed the stream and serves."""
        await self.cluster.restart(KVINDEX)

    async def stop_kvindex(self) -> None:
        """A graceful stop of kvindex; the test goes on without it."""
        await self.cluster.stop_node(KVINDEX)

    async def start_worker(self, node: str, role: str, *overrides: str) -> None:
        """Add a worker (with settings ``overrides`` of its own); returns once it
        heart-beats."""
        self.roles[node] = role
        await self.cluster.add(NodeSpec(node, role, overrides=overrides))  # type: ignore[arg-type]

    async def stop_worker(self, node: str) -> None:
        """A graceful stop of one worker; the test goes on without it."""
        await self.cluster.remove(node)

    def log_tail(self, node: str, n: int = 4000) -> str:
        """The last ``n`` characters of ``node``'s log."""
        return self.cluster.log_tail(node, n)

    async def wait_heartbeats(self, nodes: Collection[str], timeout: float = READY_TIMEOUT_S,
                              since_ms: int = 0) -> dict[str, wire.Heartbeat]:
        """Wait until every one of ``nodes`` heart-beats from an incarnation started at
        ``since_ms`` or later (a restarted node, not its predecessor's last beats)."""
        return await self.cluster.wait_heartbeats(nodes, since_ms, timeout)

    def kill(self, node: str) -> None:
        """``kill -9`` of a node (and of its engine processes, as a machine failure)."""
        self.cluster.kill(node)

    async def restart(self, node: str) -> None:
        """Start ``node`` again (after a kill) and wait for the new incarnation."""
        await self.cluster.restart(node)

    async def revive(self) -> dict[str, str]:
        """Start again, and wait for, every node that exited without being stopped on
        purpose; returns the end of each one's log from before (why it exited)."""
        found = {n: self.log_tail(n) for n in self.cluster.crashed()}
        for node in found:
            await self.cluster.restart(node)
        return found


async def reference_outputs(model_cache: Path, tmp: Path, prompts: list[list[int]],
                            max_tokens: int, preset: str = "tiny") -> list[list[int]]:
    """Greedy outputs of ``prompts`` in a monolithic vLLM run on the local model
    ``preset`` (``tests/helpers/reference.py``), computed without blocking the event loop
    (the tests' clients and routers run in it)."""
    f = tmp / "prompts.json"
    f.write_text(json.dumps(prompts))
    proc = await asyncio.create_subprocess_exec(
        PYTHON, str(ROOT / "tests" / "helpers" / "reference.py"), str(model_cache), str(f),
        str(max_tokens), preset, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    stdout, stderr = await asyncio.wait_for(proc.communicate(), 600)
    line = next((x for x in stdout.decode().splitlines() if x.startswith("RESULT ")), None)
    assert line, stderr.decode()[-4000:]
    return json.loads(line[len("RESULT "):])
