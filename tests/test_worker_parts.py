"""The worker's parts that hold no I/O of their own: peer addresses (and the wait for a
peer a plan names first), its load, its arena's shared-memory files and eviction order."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import pytest

from cpd.kvstore import BlockStore, DiskTier, KvStore, evicts_copies_first
from cpd.ops.config import load_settings
from cpd.protocol import wire
from services.worker.arena import Arena, remove_stale_files
from services.worker.load import WorkerLoad
from services.worker.peers import Peers


def _hb(node: str, role: str, address: bytes) -> wire.Heartbeat:
    return wire.Heartbeat(node=node, role=role, started_unix_ms=1, lease_ttl_ms=1000,
                          ucx_address=address)


@pytest.mark.parametrize("me, peer, dialled", [
    ("prefill", "preprefill", True),   # prefill pulls prefixes from any worker
    ("prefill", "decode", True),
    ("decode", "prefill", True),       # decode pulls hand-offs from prefill roles
    ("decode", "decode", False),       # never from another decode node
    ("prefill", "router", False),      # not a worker
])
def test_peers_dial_ahead_only_whom_they_may_pull_from(me: str, peer: str,
                                                       dialled: bool) -> None:
    peers = Peers("n0", me, heartbeat_interval_s=1.0, connect_ahead_delay_s=0.0)
    peers.heard(_hb("n1", peer, b"10.0.0.1:7400"))
    peers.heard(_hb("n1", peer, b"10.0.0.1:7400"))  # the same address again: once
    assert peers.addresses["n1"] == b"10.0.0.1:7400"
    assert peers.dials_queued == (1 if dialled else 0)
    peers.heard(_hb("n1", peer, b"10.0.0.1:7401"))  # a restart elsewhere: dial again
    assert peers.dials_queued == (2 if dialled else 0)


async def test_a_planned_peer_heard_late_is_waited_for_briefly() -> None:
    peers = Peers("n0", "prefill", heartbeat_interval_s=0.05, connect_ahead_delay_s=0.0)
    waiting = asyncio.ensure_future(peers.address("pp0"))
    await asyncio.sleep(0.01)
    peers.heard(_hb("pp0", "preprefill", b"10.0.0.2:7400"))
    assert await waiting == b"10.0.0.2:7400"
    assert await peers.address("ghost") is None  # after two heartbeat intervals


def test_load_counts_held_prefills_and_running_requests() -> None:
    changes: list[int] = []
    load = WorkerLoad(on_change=lambda: changes.append(1))
    kv = KvStore(BlockStore(1024, 4, node="n0"), None)
    with load.holding(1000, 3000) as held:
        with load.holding(200, 0):
            report = load.report("n0", "prefill", kv, kv_bandwidth_gbps=1.5,
                                 prefill_token_cap=0)
            assert (report.queue_depth, report.queued_new_tokens) == (2, 1200)
            assert (report.dram_total_bytes, report.disk_total_bytes) == (4096, 0)
            assert [p.new_tokens for p in report.prefills] == [1000, 200]
        held.engine_start = 1.0
        with load.running():
            assert load.in_flight == 1
        with load.running(report=True):
            pass
    assert (load.waiting, load.queued_tokens, load.in_flight) == (0, 0, 0)
    assert len(changes) == 4 + 2  # held and released twice each; one reported run


def test_the_load_report_carries_the_disk_tier_and_its_read_rate(tmp_path: Path) -> None:
    disk = DiskTier(tmp_path, 8 << 20, 1 << 20, node="n0")
    disk.measured(3_000_000_000, 1.0)
    kv = KvStore(BlockStore(1 << 20, 2, node="n0"), None, disk=disk)
    report = WorkerLoad(on_change=lambda: None).report(
        "n0", "prefill", kv, kv_bandwidth_gbps=1.0, prefill_token_cap=0)
    assert (report.disk_used_bytes, report.disk_total_bytes, report.disk_read_gbps) == (
        0, 8 << 20, 3.0)


def test_arena_files_are_removed_and_a_dead_predecessors_are_swept(tmp_path: Path) -> None:
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True).stdout.strip()
    stale = tmp_path / f"cpd-arena-w0-1-{dead}"
    stale.write_bytes(b"x")
    live = tmp_path / f"cpd-arena-w0-1-{os.getppid()}"  # a live process's: kept
    live.write_bytes(b"x")
    arena = Arena.create(tmp_path, "w0", 2, arena_bytes=4096, slot_bytes=1024)
    assert not stale.exists() and live.exists()
    assert arena.slots.shape == (4, 1024) and arena.spec.num_slots == 4
    arena.prefault()
    arena.remove()
    assert not arena.path.exists()
    remove_stale_files(tmp_path, "w0")
    assert live.exists()


@pytest.mark.parametrize(("role", "setting", "first"), [
    ("preprefill", "never", True),   # the prefill side always evicts copies first
    ("prefill", "never", True),
    ("prefill", "adaptive", True),
    ("decode", "always", True),      # decode as dataplane.decode_copies_first says
    ("decode", "never", False),
    ("decode", "adaptive", True),    # starts on; its gate switches it
])
def test_which_arenas_evict_copies_first(role: str, setting: str, first: bool) -> None:
    s = load_settings(environ={}, overrides=[f"dataplane.decode_copies_first={setting}"])
    assert evicts_copies_first(role, s.dataplane.decode_copies_first) is first
