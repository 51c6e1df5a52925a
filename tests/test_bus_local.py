"""In-process delivery between the services of one process (``cpd.bus.local``), on a real
NATS server: a request, its reply and a whole reply stream between two services that
share a hub never reach the server (a spy subscribed to everything sees none of them),
carry the same bytes and headers, and are counted as NATS would count them; what the hub
cannot deliver (a stopped endpoint, a closed stream, a wildcard subject, an oversized
message) takes the NATS path or fails as it did."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import nats
import pytest
from nats.aio.msg import Msg

from cpd.bus import Bus, LocalHub, Request, Service
from cpd.bus.replymux import is_no_reader
from cpd.ops.config import Settings, load_settings
from cpd.protocol import wire
from cpd.protocol.errors import PayloadTooLarge

pytestmark = pytest.mark.timeout(60)

ASK = "cpd.v1.test.local.ask"
STREAM = "cpd.v1.test.local.stream"
WILD = "cpd.v1.test.local.wild"


class _Answers(Service):
    """Answers ``ASK`` with its node id, streams two tokens and a final on ``STREAM``,
    and serves the wildcard ``WILD.*``."""

    name = "answers"

    async def setup(self) -> None:
        await self.add_endpoint("ask", ASK, self._ask, expect=wire.CancelGenerate,
                                queue="answers")
        await self.add_endpoint("stream", STREAM, self._stream, expect=wire.CancelGenerate,
                                queue="answers")
        await self.add_endpoint("wild", f"{WILD}.*", self._ask, expect=wire.CancelGenerate,
                                queue="answers")

    async def _ask(self, req: wire.CancelGenerate, r: Request) -> wire.Accepted:
        return wire.Accepted(request_id=req.request_id,
                             node=f"{self.node_id}:{r.headers.get('x-test', '')}")

    async def _stream(self, req: wire.CancelGenerate, r: Request) -> None:
        out = r.stream(req.request_id)
        await out.tokens([1, 2], "ab")
        await out.tokens([3], "c")
        await out.final(finish_reason="length")


def _settings(base: Settings, node: str) -> Settings:
    return load_settings(environ={}, overrides=[f"nats.servers={base.nats.servers[0]}",
                                                "nats.drain_timeout_s=2",
                                                f"node.node_id={node}"])


class _Spy:
    """Every message the NATS server delivers on the test's subjects and on any inbox."""

    def __init__(self) -> None:
        self.seen: list[str] = []

    async def on(self, msg: Msg) -> None:
        if msg.subject.startswith(("cpd.v1.test.", "_INBOX")):
            self.seen.append(msg.subject)


@pytest.fixture
async def spy(settings: Settings) -> AsyncIterator[_Spy]:
    nc = await nats.connect(settings.nats.servers[0])
    watcher = _Spy()
    await nc.subscribe(">", cb=watcher.on)
    await nc.flush()
    yield watcher
    await nc.close()


@pytest.fixture
async def pair(settings: Settings) -> AsyncIterator[tuple[LocalHub, Bus, _Answers]]:
    """A caller's bus and a service on one hub."""
    hub = LocalHub()
    service = _Answers(_settings(settings, "local"), hub=hub)
    await service.start()
    caller = await Bus.open(settings, "caller", hub=hub)
    yield hub, caller, service
    await caller.close()
    await service.stop()


async def _settled(nc_bus: Bus) -> None:
    """Give the server time to deliver anything it was sent."""
    await nc_bus.nc.flush()
    await asyncio.sleep(0.2)


async def test_a_request_and_its_reply_stay_in_the_process(
        pair: tuple[LocalHub, Bus, _Answers], spy: _Spy) -> None:
    hub, caller, service = pair
    reply = await caller.request(ASK, wire.CancelGenerate(request_id="r1", reply_to=""),
                                 expect=wire.Accepted)
    assert reply.request_id == "r1" and reply.node == "local:"
    assert hub.delivered == 2  # the request and its reply
    # Headers (trace context among them) ride along as they do over NATS.
    box = await caller.stream_inbox()
    await caller.publish(ASK, wire.CancelGenerate(request_id="r2", reply_to=""),
                         reply=box.subject, headers={"x-test": "carried"})
    answer = await box.get(5)
    caller.close_stream_inbox(box)
    assert answer is not None
    assert wire.decode(answer.data, wire.Accepted).node == "local:carried"
    assert hub.delivered == 4
    await _settled(caller)
    assert spy.seen == []
    stats = {e["name"]: e for e in service._micro.stats()["endpoints"]}  # type: ignore[union-attr]
    assert stats["ask"]["num_requests"] == 2 and stats["ask"]["num_errors"] == 0


async def test_a_reply_stream_stays_in_the_process(
        pair: tuple[LocalHub, Bus, _Answers], spy: _Spy) -> None:
    hub, caller, _ = pair
    got = [m async for m in caller.stream(
        STREAM, wire.CancelGenerate(request_id="s1", reply_to=""), timeout=10)]
    assert [type(m) for m in got] == [wire.TokenChunk, wire.TokenChunk, wire.Final]
    assert [m.token_ids for m in got[:2]] == [[1, 2], [3]]  # type: ignore[union-attr]
    assert hub.delivered == 4
    await _settled(caller)
    assert spy.seen == []


async def test_without_a_hub_the_same_request_goes_through_nats(
        settings: Settings, pair: tuple[LocalHub, Bus, _Answers], spy: _Spy) -> None:
    hub, _, _ = pair
    remote = await Bus.open(settings, "remote")
    try:
        reply = await remote.request(ASK, wire.CancelGenerate(request_id="r2", reply_to=""),
                                     expect=wire.Accepted)
        assert reply.node == "local:"
        assert await _seen_later(remote, spy, ASK)
        assert await _seen_later(remote, spy, "_INBOX", prefix=True)  # the reply
    finally:
        await remote.close()
    assert hub.delivered == 0


async def test_a_stopped_local_endpoint_leaves_requests_to_the_other_replicas(
        settings: Settings, pair: tuple[LocalHub, Bus, _Answers], spy: _Spy) -> None:
    hub, caller, service = pair
    other = _Answers(_settings(settings, "elsewhere"))
    await other.start()
    try:
        await service.stop()
        reply = await caller.request(ASK, wire.CancelGenerate(request_id="r3", reply_to=""),
                                     expect=wire.Accepted)
    finally:
        await other.stop()
    assert reply.node == "elsewhere:"
    assert hub.delivered == 0
    assert await _seen_later(caller, spy, ASK)


async def test_wildcard_subjects_and_closed_streams_take_the_nats_path(
        pair: tuple[LocalHub, Bus, _Answers], spy: _Spy) -> None:
    hub, caller, _ = pair
    reply = await caller.request(f"{WILD}.x", wire.CancelGenerate(request_id="w", reply_to=""),
                                 expect=wire.Accepted)
    assert reply.node == "local:"
    assert await _seen_later(caller, spy, f"{WILD}.x")
    # A check on a stream inbox its reader closed: NATS carries it, and the reader's
    # connection answers that nobody reads it (what a router's reader check relies on).
    box = await caller.stream_inbox()
    caller.close_stream_inbox(box)
    before = hub.delivered
    answer = await caller.request_bytes(box.subject, b"ping", timeout=5)
    assert is_no_reader(answer)
    assert await _seen_later(caller, spy, box.subject)
    assert hub.delivered == before


async def _seen_later(bus: Bus, spy: _Spy, subject: str, *, prefix: bool = False) -> bool:
    """Whether the spy gets ``subject`` (or, with ``prefix``, a subject that starts with
    it) within a few seconds (a busy host is slow)."""
    await bus.nc.flush()
    for _ in range(100):
        if any(s.startswith(subject) if prefix else s == subject for s in spy.seen):
            return True
        await asyncio.sleep(0.05)
    return False


async def test_the_size_limit_holds_in_the_process(
        pair: tuple[LocalHub, Bus, _Answers]) -> None:
    hub, caller, _ = pair
    big = wire.CancelGenerate(request_id="x" * (caller.max_message_bytes + 1), reply_to="")
    with pytest.raises(PayloadTooLarge):
        await caller.request(ASK, big, expect=wire.Accepted)
    assert hub.delivered == 0
