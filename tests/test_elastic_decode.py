"""The elastic prefill/decode boundary on the real services: a router, kvindex, a prefill
worker that also decodes (``worker.serve_decode``) and a decode worker, on real NATS and
UCX with the sim engine. While the decode node holds ``router.decode_lend_at`` requests,
a new request keeps its decode on its prefill node (no hand-off transfer) with the same
tokens as on the decode node; once the decode node drains, decode goes back there."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from cpd.bus import Bus
from cpd.client import Client
from cpd.ops.config import Settings, load_settings
from cpd.ops.natsserver import NatsServer
from cpd.protocol.roles import Role
from services.kvindex import KvIndexService
from services.router import RouterService
from services.worker import WorkerService

pytestmark = pytest.mark.timeout(120)


def _settings(nats: NatsServer, tmp: Path, node: str, *extra: str) -> Settings:
    return load_settings(environ={}, overrides=[
        f"nats.servers={nats.url}", "nats.drain_timeout_s=2", "worker.engine=sim",
        f"node.node_id={node}", f"worker.arena_dir={tmp}", "dataplane.arena_bytes=67108864",
        f"kvindex.snapshot_dir={tmp / 'snap'}", "router.decode_lend_at=1", *extra])


@pytest.fixture
async def cluster(fresh_nats: NatsServer, tmp_path: Path
                  ) -> AsyncIterator[tuple[RouterService, Client]]:
    kvi = KvIndexService(_settings(fresh_nats, tmp_path, "kvi-el"))
    p0 = WorkerService(_settings(fresh_nats, tmp_path, "p0-el", "worker.serve_decode=true"),
                       Role.PREFILL)
    d0 = WorkerService(_settings(fresh_nats, tmp_path, "d0-el"), Role.DECODE)
    router = RouterService(_settings(fresh_nats, tmp_path, "router-el"))
    started: list[object] = []
    bus: Bus | None = None
    try:
        for svc in (kvi, p0, d0, router):
            await svc.start()
            started.append(svc)
        bus = await Bus.open(router.settings, "test-elastic")
        for _ in range(100):
            if {x.node for x in router.nodes.live(time.monotonic())} >= {"p0-el", "d0-el"}:
                break
            await asyncio.sleep(0.1)
        yield router, Client(bus, default_timeout_s=60)
    finally:
        if bus is not None:
            await bus.close()
        for svc in reversed(started):
            await svc.stop()  # type: ignore[attr-defined]


async def _until(pred: object, timeout: float = 15.0) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():  # type: ignore[operator]
            return
        await asyncio.sleep(0.05)
    raise AssertionError("condition not reached in time")


async def test_decode_stays_on_the_prefill_node_while_the_decode_pool_is_full(
        cluster: tuple[RouterService, Client]) -> None:
    router, client = cluster
    p0 = next(x for x in router.nodes.live(time.monotonic()) if x.node == "p0-el")
    assert p0.role == Role.PREFILL and p0.decodes  # its heartbeat says it decodes
    prompt = list(range(100, 100 + 600))
    # One long request fills the decode pool (decode_lend_at=1) ...
    long = asyncio.create_task(client.generate(list(range(2000, 2700)), max_tokens=3000,
                                               ignore_eos=True))

    def decode_busy() -> bool:
        return any(x.node == "d0-el" and x.in_flight >= 1
                   for x in router.nodes.live(time.monotonic()))
    await _until(decode_busy)
    # ... so the next one keeps its decode on its prefill node.
    lent = await client.generate(prompt, max_tokens=16, ignore_eos=True)
    assert lent.route.decode_lent and lent.route.decode_node == "p0-el"
    assert lent.route.prefill_node == "p0-el" and len(lent.token_ids) == 16
    assert router.stats.decode_lent == 1  # cpd status and cpd_router_decode_lent_total
    shown = {n.node: n.decodes for n in router.nodes.status(time.monotonic(),
                                                            router.policy.prefill)}
    assert shown == {"p0-el": True, "d0-el": False}
    first = await long
    assert first.route.decode_node == "d0-el" and not first.route.decode_lent
    assert len(first.token_ids) == 3000

    def decode_idle() -> bool:
        return any(x.node == "d0-el" and x.in_flight == 0
                   for x in router.nodes.live(time.monotonic()))
    await _until(decode_idle)
    back = await client.generate(prompt, max_tokens=16, ignore_eos=True)
    assert back.route.decode_node == "d0-el" and not back.route.decode_lent
    assert back.token_ids == lent.token_ids
