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
import structlog

from cpd.bus import Bus, KeepAlives, ReplyStream
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


@contextlib.asynccontextmanager
async def _streaming_stand_ins(bus: Bus, namespace: str, loses_final: set[str],
                               runs: list[str]) -> AsyncIterator[None]:
    """Prefill nodes p0 and p1 that accept every run and stream one token, keeping their
    streams alive as workers do; a node in ``loses_final`` then keeps it alive for a
    while and falls silent (its final message lost, as in a NATS restart), the other
    ends it. A decode node d0 heartbeats (never used: the prefill node ends the stream)."""
    keepalives = KeepAlives(1.0, log=structlog.get_logger(), before_first=False)
    tasks: set[asyncio.Task] = set()

    async def serve(node: str, req: wire.PrefillRequest) -> None:
        out = ReplyStream(bus, req.reply_to, req.request_id)
        with keepalives.watching(out):
            await out.tokens([5], "")
            if node in loses_final:
                await asyncio.sleep(2.0)  # alive, kept alive, then nothing more
                return
            await out.final(finish_reason="length")

    def handler(node: str):
        async def on_run(msg: object) -> None:
            req = wire.decode(msg.data, wire.PrefillRequest)  # type: ignore[attr-defined]
            runs.append(node)
            await msg.respond(wire.encode(wire.Accepted(  # type: ignore[attr-defined]
                request_id=req.request_id, node=node)))
            t = asyncio.create_task(serve(node, req))
            tasks.add(t)
            t.add_done_callback(tasks.discard)
        return on_run

    async def heartbeats() -> None:
        started = int(time.time() * 1000)
        while True:
            for node, role in (("p0", "prefill"), ("p1", "prefill"), ("d0", "decode")):
                await bus.publish(subjects.heartbeat(node), wire.Heartbeat(
                    node=node, role=role, started_unix_ms=started, lease_ttl_ms=5000,
                    namespace=namespace))
            await asyncio.sleep(0.2)

    subs = [await bus.nc.subscribe(subjects.run("prefill", n), cb=handler(n))
            for n in ("p0", "p1")]
    background = [asyncio.create_task(heartbeats()),
                  asyncio.create_task(keepalives.run(lambda: False))]
    try:
        yield
    finally:
        for t in [*background, *tasks]:
            t.cancel()
        await asyncio.gather(*background, *tasks, return_exceptions=True)
        for sub in subs:
            await sub.unsubscribe()


async def test_a_stream_whose_final_was_lost_is_retried_within_seconds(
        router: RouterService, bus: Bus) -> None:
    """A worker's final message lost while the worker lives on (a NATS restart): its
    keep-alives stop with its stream, so the router notices the silence within
    ``router.keepalive_misses`` intervals and retries on another node, instead of
    holding the request until its deadline."""
    runs: list[str] = []
    async with _streaming_stand_ins(bus, router.model.namespace.id, {"p0"}, runs):
        for _ in range(50):
            if len(router.nodes.live(time.monotonic())) >= 3:
                break
            await asyncio.sleep(0.1)
        client = Client(bus, default_timeout_s=60)
        t0 = time.monotonic()
        done = None
        for _ in range(4):  # until a request lands on p0 first (the tie goes either way)
            done = await client.generate(list(range(10, 310)), max_tokens=1)
            if runs[0] == "p0":
                break
            runs.clear()
        assert done is not None and runs[:2] == ["p0", "p1"], runs
        assert done.token_ids == [5] and done.route.prefill_node == "p1"
        # 3 x 1 s of silence after p0's last keep-alive, not the 30 s stream idle limit.
        assert time.monotonic() - t0 < 15
