"""What the router says when every node that could take a request has failed it: the
reason the last one gave, not "no node is up". A real router on a real NATS server; the
workers are stand-ins that heartbeat and answer ``run`` with a refusal, because the
refusal is what is under test (the end-to-end failover paths run on vLLM workers in
tests/test_router_e2e.py)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from cpd.bus import Bus
from cpd.client import Client
from cpd.ops.config import load_settings
from cpd.ops.natsserver import NatsServer
from cpd.protocol import subjects, wire
from cpd.protocol.errors import ErrorCode, Overloaded, Unavailable
from services.router import RouterService

pytestmark = pytest.mark.timeout(90)


@pytest.fixture
async def router(nats_server: NatsServer, model_cache: Path) -> AsyncIterator[RouterService]:
    s = load_settings(environ={}, overrides=[
        f"nats.servers={nats_server.url}", "node.node_id=router-failover",
        f"model.cache_dir={model_cache}", "nats.drain_timeout_s=2"])
    r = RouterService(s)
    await r.start()
    yield r
    await r.stop()


@contextlib.asynccontextmanager
async def _stand_in_workers(bus: Bus, namespace: str, refusals: list[str]
                            ) -> AsyncIterator[None]:
    """A prefill node p0 that refuses every run as overloaded, and a decode node d0."""

    async def refuse(msg: object) -> None:
        refusals.append("p0")
        await msg.respond(wire.encode(wire.Error(  # type: ignore[attr-defined]
            code=ErrorCode.OVERLOADED.value, message="p0: queue full", retryable=True)))

    async def heartbeats() -> None:
        started = int(time.time() * 1000)
        while True:
            for node, role in (("p0", "prefill"), ("d0", "decode")):
                await bus.publish(subjects.heartbeat(node), wire.Heartbeat(
                    node=node, role=role, started_unix_ms=started, lease_ttl_ms=5000,
                    namespace=namespace))
            await asyncio.sleep(0.2)

    sub = await bus.nc.subscribe(subjects.run("prefill", "p0"), cb=refuse)
    beat = asyncio.create_task(heartbeats())
    try:
        yield
    finally:
        beat.cancel()
        await asyncio.gather(beat, return_exceptions=True)
        await sub.unsubscribe()


async def test_the_only_prefill_node_overloaded_is_reported_as_overloaded(
        router: RouterService, bus: Bus) -> None:
    refusals: list[str] = []
    async with _stand_in_workers(bus, router.model.namespace.id, refusals):
        for _ in range(50):  # the heartbeats introduce both nodes
            if len(router.nodes.live(time.monotonic())) >= 2:
                break
            await asyncio.sleep(0.1)
        client = Client(bus, default_timeout_s=30)
        with pytest.raises(Overloaded) as exc:
            await client.generate(list(range(10, 310)), max_tokens=4)
        assert exc.value.retryable and "queue full" in str(exc.value)
        assert refusals == ["p0"]  # tried once, then nothing else could take it
        # No kvindex runs here: the decision was made without its answer, and counted.
        assert router.stats.lookup_misses == 1
    # With no prefill node at all the router still says exactly that.
    for _ in range(100):
        if not any(n.role == "prefill" for n in router.nodes.live(time.monotonic())):
            break
        await asyncio.sleep(0.1)
    with pytest.raises(Unavailable):
        await Client(bus, default_timeout_s=30).generate(list(range(10, 310)), max_tokens=4)


async def test_heartbeats_and_load_reports_naming_another_node_are_refused(
        router: RouterService, bus: Bus) -> None:
    """A worker may only speak for itself: what it publishes on its own subjects (the only
    ones its credentials cover) naming another node, or another role, is refused and
    counted, and never enters the router's node table."""
    ns, started = router.model.namespace.id, int(time.time() * 1000)
    before = router.rejected

    def beat(node: str) -> wire.Heartbeat:
        return wire.Heartbeat(node=node, role="prefill", started_unix_ms=started,
                              lease_ttl_ms=5000, namespace=ns)

    await bus.publish(subjects.heartbeat("p7"), beat("p7"))  # genuine
    await bus.publish(subjects.heartbeat("p7"), beat("ghost"))  # p7 speaking for ghost
    for _ in range(50):
        if router.nodes.epoch("p7") and router.rejected > before:
            break
        await asyncio.sleep(0.1)
    # p7's load: as another node, or under another role than its subject names.
    await bus.publish(subjects.load("prefill", "p7"), wire.LoadReport(
        node="p8", role="prefill", in_flight=9))
    await bus.publish(subjects.load("prefill", "p7"), wire.LoadReport(
        node="p7", role="decode", in_flight=9))
    for _ in range(50):
        if router.rejected >= before + 3:
            break
        await asyncio.sleep(0.1)
    assert router.rejected == before + 3
    live = {n.node: n for n in router.nodes.live(time.monotonic())}
    assert "p7" in live and "ghost" not in live and "p8" not in live
    assert live["p7"].in_flight == 0
