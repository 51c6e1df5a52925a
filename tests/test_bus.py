"""The NATS bus against a real nats-server: request/reply, streaming, typed errors,
size guard, tracing, graceful stop and reconnects."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import msgspec
import pytest
import structlog
from nats.aio.msg import Msg
from nats.micro.service import ServiceInfo, ServicePing, ServiceStats
from opentelemetry import trace
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from cpd.bus import Bus, KeepAlives, ReplyStream, Request, Service, StreamReader, encoded_size
from cpd.ops import telemetry
from cpd.ops.config import Settings, load_settings
from cpd.ops.natsserver import NatsServer
from cpd.protocol import subjects, wire
from cpd.protocol.errors import (
    ErrorCode,
    MalformedMessage,
    NoResponders,
    Overloaded,
    PayloadTooLarge,
    RemoteError,
    RequestTimeout,
    StreamGap,
)

pytestmark = pytest.mark.timeout(60)

_spans = InMemorySpanExporter()
telemetry.export_spans(SimpleSpanProcessor(_spans))


class EchoService(Service):
    """A test service: streams the prompt's characters back, with switches for faults."""

    name = "echo"

    def __init__(self, settings: Settings, prefix: str) -> None:
        super().__init__(settings)
        self.prefix = prefix
        self.seen_trace_ids: list[int] = []

    async def setup(self) -> None:
        await self.add_endpoint("generate", f"{self.prefix}.generate", self.generate,
                                expect=wire.GenerateRequest, queue="echo")
        await self.add_endpoint("lookup", f"{self.prefix}.lookup", self.lookup,
                                expect=wire.LookupRequest, queue="echo")

    async def lookup(self, msg: wire.LookupRequest, req: Request) -> wire.LookupReply:
        self.seen_trace_ids.append(trace.get_current_span().get_span_context().trace_id)
        if msg.namespace == "slow":
            await asyncio.sleep(1.0)
        if msg.namespace == "nap":
            await asyncio.sleep(0.3)
        if msg.namespace == "busy":
            raise Overloaded("too many requests")
        if msg.namespace == "crash":
            raise RuntimeError("boom")
        return wire.LookupReply(request_id=msg.request_id,
                                num_blocks=len(msg.block_hashes) // wire.HASH_BYTES)

    async def generate(self, msg: wire.GenerateRequest, req: Request) -> None:
        out = req.stream(msg.request_id)
        prompt = msg.prompt or ""
        if prompt == "reorder":
            # Two publishers in real life (prefill sends seq 0, decode the rest).
            await self.bus.publish(req.reply_to, wire.TokenChunk(request_id=msg.request_id,
                                                                 seq=1, token_ids=[2]))
            await self.bus.publish(req.reply_to, wire.TokenChunk(request_id=msg.request_id,
                                                                 seq=0, token_ids=[1]))
            await self.bus.publish(req.reply_to, wire.Final(request_id=msg.request_id, seq=2))
            return
        if prompt == "gap":
            await self.bus.publish(req.reply_to, wire.TokenChunk(request_id=msg.request_id,
                                                                 seq=0, token_ids=[1]))
            await self.bus.publish(req.reply_to, wire.Final(request_id=msg.request_id, seq=2))
            return
        if prompt == "fail-midway":
            await out.tokens([1])
            raise Overloaded("decode lost")
        if prompt == "stream-error":  # the handler ends the stream itself, then returns
            await out.tokens([1])
            await out.error(Overloaded("stream ended"))
            return
        for ch in prompt:
            await out.tokens([ord(ch)], ch)
        await out.final(finish_reason="stop",
                        usage=wire.Usage(prompt_tokens=len(prompt), completion_tokens=len(prompt)))


@pytest.fixture
async def echo(settings: Settings, bus: Bus) -> AsyncIterator[EchoService]:
    svc = EchoService(settings, f"test.{uuid.uuid4().hex[:8]}")
    await svc.start()
    # Seen from the test's own connection too (under heavy load the server once answered
    # "no responders" right after start); the probe is not counted by the tests.
    for _ in range(100):
        with contextlib.suppress(NoResponders):
            await bus.request(f"{svc.prefix}.lookup", _lookup(), expect=wire.LookupReply)
            break
        await asyncio.sleep(0.02)
    yield svc
    await svc.stop()


def _lookup(ns: str = "ns", n: int = 2) -> wire.LookupRequest:
    return wire.LookupRequest(request_id="r", namespace=ns, block_hashes=b"\x01" * 16 * n)


async def test_request_reply(bus: Bus, echo: EchoService) -> None:
    reply = await bus.request(f"{echo.prefix}.lookup", _lookup(n=3), expect=wire.LookupReply)
    assert reply.num_blocks == 3 and reply.request_id == "r"


async def test_concurrent_requests_each_get_their_own_reply(settings: Settings,
                                                           echo: EchoService) -> None:
    # A fresh connection: the first requests race to make the shared reply subscription.
    client = await Bus.open(settings, "concurrent-client")
    try:
        asks = [wire.LookupRequest(request_id=f"r{i}", namespace="ns",
                                   block_hashes=b"\x01" * 16 * (i % 7 + 1))
                for i in range(300)]
        replies = await asyncio.gather(*(
            client.request(f"{echo.prefix}.lookup", a, expect=wire.LookupReply)
            for a in asks))
        assert [(r.request_id, r.num_blocks) for r in replies] == \
            [(a.request_id, len(a.block_hashes) // 16) for a in asks]
        assert client._replies.pending == 0
        reply_subs = [s for s in client.nc._subs.values() if s.subject.startswith("_INBOX")]
        assert len(reply_subs) == 1
    finally:
        await client.close()


async def test_reply_subjects_cannot_be_guessed_from_another(bus: Bus) -> None:
    """A peer that sees one request's reply subject (every worker the router dispatches
    to does) cannot derive another's: reply tokens and stream inboxes carry 64 random
    bits each, not a counter."""
    seen: list[str] = []

    async def note(msg: Msg) -> None:
        seen.append(msg.reply)
        await msg.respond(wire.encode(wire.Accepted(request_id="x")))

    sub = await bus.nc.subscribe("test.reply-tokens", cb=note)
    for _ in range(3):
        await bus.request("test.reply-tokens", wire.StatusRequest(), expect=wire.Accepted)
    prefix = await bus.reply_prefix()
    tokens = [s.removeprefix(prefix) for s in seen]
    assert all(s.startswith(prefix) for s in seen) and len(set(tokens)) == 3
    assert all(len(t) == 16 and int(t, 16) >= 0 for t in tokens)
    inboxes = []
    for _ in range(3):
        reader = StreamReader(bus, idle_timeout=1)
        inboxes.append((await reader.open()).rsplit(".", 1)[-1])
        await reader.close()
    assert len(set(inboxes)) == 3 and all(len(t) == 16 for t in inboxes)
    await sub.unsubscribe()


async def test_timed_out_and_cancelled_requests_leave_nothing_behind(
        bus: Bus, echo: EchoService) -> None:
    with pytest.raises(RequestTimeout):
        await bus.request(f"{echo.prefix}.lookup", _lookup("slow"), expect=wire.LookupReply,
                          timeout=0.2)
    task = asyncio.create_task(bus.request(f"{echo.prefix}.lookup", _lookup("slow"),
                                           expect=wire.LookupReply))
    await asyncio.sleep(0.05)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert bus._replies.pending == 0
    # The late replies to both land on a token no one waits for, and are dropped.
    await asyncio.sleep(1.2)
    r = await bus.request(f"{echo.prefix}.lookup", _lookup(n=5), expect=wire.LookupReply)
    assert r.num_blocks == 5 and bus._replies.pending == 0


async def test_a_cancel_that_lands_with_a_message_still_cancels_the_reader(bus: Bus) -> None:
    """A message queued for the reader in the same loop turn as its task is cancelled:
    the reader raises the cancel (a client that left mid-stream must not have its
    request generated to the end), and the message stays queued, not lost."""
    reader = StreamReader(bus, idle_timeout=5)
    inbox = await reader.open()
    box = reader._box
    assert box is not None
    put = box.put
    task = asyncio.create_task(reader.next(5))

    def put_and_cancel(msg: Msg) -> None:  # the interleaving, made certain
        put(msg)
        task.cancel()
    box.put = put_and_cancel  # type: ignore[method-assign]
    await asyncio.sleep(0.05)
    await bus.nc.publish(inbox, wire.encode(wire.TokenChunk(request_id="c", seq=0,
                                                            token_ids=[1])))
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(task, 5)
    box.put = put  # type: ignore[method-assign]
    msg = await reader.next(1)
    assert isinstance(msg, wire.TokenChunk) and msg.token_ids == [1]
    await reader.close()
    assert bus._replies.streams == 0


async def test_a_closed_stream_inbox_drops_what_arrives_later(bus: Bus) -> None:
    """Streams share the connection's reply subscription: a message to a closed
    stream's inbox reaches no one, and other streams and requests go on."""
    first, second = StreamReader(bus, idle_timeout=5), StreamReader(bus, idle_timeout=5)
    gone, alive = await first.open(), await second.open()
    await first.close()
    for inbox, rid in ((gone, "gone"), (alive, "alive")):
        await bus.nc.publish(inbox, wire.encode(wire.TokenChunk(request_id=rid, seq=0,
                                                                token_ids=[2])))
    msg = await second.next(5)
    assert isinstance(msg, wire.TokenChunk) and msg.request_id == "alive"
    assert await second.next(0.2) is None
    await second.close()


async def test_stream_in_order_ends_with_final(bus: Bus, echo: EchoService) -> None:
    msgs = [m async for m in bus.stream(f"{echo.prefix}.generate",
                                        wire.GenerateRequest(request_id="g", prompt="abc"),
                                        timeout=10)]
    assert [m.seq for m in msgs] == [0, 1, 2, 3]
    assert [m.text for m in msgs[:3]] == ["a", "b", "c"]
    assert isinstance(msgs[-1], wire.Final) and msgs[-1].usage.completion_tokens == 3


async def test_stream_reorders_replies_from_two_publishers(bus: Bus, echo: EchoService) -> None:
    msgs = [m async for m in bus.stream(f"{echo.prefix}.generate",
                                        wire.GenerateRequest(request_id="g", prompt="reorder"),
                                        timeout=10)]
    assert [m.seq for m in msgs] == [0, 1, 2]
    assert [m.token_ids for m in msgs[:2]] == [[1], [2]]


async def test_stream_gap_is_a_typed_error(bus: Bus, echo: EchoService) -> None:
    with pytest.raises(StreamGap):
        async for _ in bus.stream(f"{echo.prefix}.generate",
                                  wire.GenerateRequest(request_id="g", prompt="gap"),
                                  timeout=10, idle_timeout=0.5):
            pass


async def test_stream_error_midway_is_raised_after_the_tokens(bus: Bus, echo: EchoService) -> None:
    got = []
    with pytest.raises(Overloaded) as e:
        async for m in bus.stream(f"{echo.prefix}.generate",
                                  wire.GenerateRequest(request_id="g", prompt="fail-midway"),
                                  timeout=10):
            got.append(m)
    assert [m.token_ids for m in got] == [[1]]
    assert e.value.retryable


async def test_a_stream_left_early_says_so_and_one_read_to_the_end_does_not(
        bus: Bus, echo: EchoService) -> None:
    """A caller that stops reading publishes the ``abandoned`` message, built from the
    stream's inbox; a stream that ended (final or error) publishes nothing."""
    notices: asyncio.Queue[wire.CancelGenerate] = asyncio.Queue()

    async def on_notice(msg: Msg) -> None:
        notices.put_nowait(wire.decode(msg.data, wire.CancelGenerate))

    sub = await bus.nc.subscribe(f"{echo.prefix}.left", cb=on_notice)
    left = (f"{echo.prefix}.left",
            lambda inbox: wire.CancelGenerate(request_id="g", reply_to=inbox))
    try:
        async with contextlib.aclosing(bus.stream(
                f"{echo.prefix}.generate", wire.GenerateRequest(request_id="g", prompt="abc"),
                timeout=10, abandoned=left)) as stream:
            async for _ in stream:
                break
        notice = await asyncio.wait_for(notices.get(), 5)
        assert notice.request_id == "g" and subjects.check_reply_subject(notice.reply_to)
        for prompt in ("abc", "fail-midway"):
            with contextlib.suppress(Overloaded):
                async for _ in bus.stream(f"{echo.prefix}.generate",
                                          wire.GenerateRequest(request_id="g", prompt=prompt),
                                          timeout=10, abandoned=left):
                    pass
        await bus.nc.flush()
        await asyncio.sleep(0.2)
        assert notices.empty()
    finally:
        await sub.unsubscribe()


async def test_no_responders(bus: Bus) -> None:
    with pytest.raises(NoResponders):
        await bus.request("test.nobody.home", _lookup(), expect=wire.LookupReply)
    with pytest.raises(NoResponders):
        async for _ in bus.stream("test.nobody.home",
                                  wire.GenerateRequest(request_id="g", prompt="x"), timeout=5):
            pass


async def test_timeout(bus: Bus, echo: EchoService) -> None:
    with pytest.raises(RequestTimeout):
        await bus.request(f"{echo.prefix}.lookup", _lookup("slow"), expect=wire.LookupReply,
                          timeout=0.2)


async def test_a_reply_that_came_while_the_loop_was_busy_is_not_a_timeout(bus: Bus) -> None:
    """A burst can hold the event loop past a request's deadline while its reply
    already waits in the socket (nats-server answers ``$JS.API.INFO`` itself): it is
    read, not counted missing. A request nothing answers still times out."""
    loop = asyncio.get_running_loop()
    loop.call_soon(time.sleep, 0.3)  # the loop busy from right after the publish
    reply = await bus.request_bytes("$JS.API.INFO", b"", timeout=0.1)
    assert json.loads(reply.data)["type"] == "io.nats.jetstream.api.v1.account_info_response"
    sub = await bus.nc.subscribe("test.silent")  # takes requests, answers none
    try:
        loop.call_soon(time.sleep, 0.3)
        with pytest.raises(RequestTimeout):
            await bus.request_bytes("test.silent", b"", timeout=0.1)
    finally:
        await sub.unsubscribe()


async def test_handler_errors_become_typed_replies(bus: Bus, echo: EchoService) -> None:
    with pytest.raises(Overloaded) as e:
        await bus.request(f"{echo.prefix}.lookup", _lookup("busy"), expect=wire.LookupReply)
    assert e.value.retryable
    with pytest.raises(RemoteError) as e2:
        await bus.request(f"{echo.prefix}.lookup", _lookup("crash"), expect=wire.LookupReply)
    assert e2.value.code == ErrorCode.INTERNAL and "boom" in str(e2.value)
    # The service is still serving.
    assert (await bus.request(f"{echo.prefix}.lookup", _lookup(),
                              expect=wire.LookupReply)).num_blocks == 2


@pytest.mark.parametrize("payload, code", [
    (b"\xc1garbage", ErrorCode.MALFORMED),
    (b"", ErrorCode.MALFORMED),
    (msgspec.msgpack.encode({"kind": "lookup", "v": 9, "namespace": "n", "block_hashes": b""}),
     ErrorCode.SCHEMA_VERSION),
    (msgspec.msgpack.encode({"kind": "from_the_future", "v": 1}), ErrorCode.UNKNOWN_KIND),
    (wire.encode(wire.PullAck(request_id="r", lease_id="l")), ErrorCode.INVALID_REQUEST),
])
async def test_bad_input_gets_typed_error_and_service_survives(
        bus: Bus, echo: EchoService, payload: bytes, code: ErrorCode) -> None:
    before = echo.rejected
    raw = await bus.nc.request(f"{echo.prefix}.lookup", payload, timeout=5)
    err = wire.decode(raw.data, wire.Error)
    assert err.code == code.value
    assert echo.rejected == before + 1
    assert (await bus.request(f"{echo.prefix}.lookup", _lookup(),
                              expect=wire.LookupReply)).num_blocks == 2


async def test_size_guard_counts_headers(bus: Bus) -> None:
    limit = bus.max_message_bytes
    msg = wire.GenerateRequest(request_id="r", prompt="x" * (limit - 400))
    payload = wire.encode(msg)
    assert len(payload) < limit
    # The payload alone fits, but with a large header it does not.
    with pytest.raises(PayloadTooLarge):
        await bus.publish("test.sink", msg, headers={"x-pad": "y" * 500})
    await bus.publish("test.sink", msg)  # fits without it
    assert encoded_size(b"abc", {"k": "v"}) == 3 + len(b"NATS/1.0\r\nk: v\r\n\r\n")


async def test_size_guard_matches_the_server_limit(tmp_path: Path) -> None:
    conf = tmp_path / "nats.conf"
    conf.write_text("max_payload: 4096\n")
    with NatsServer(store_dir=tmp_path / "js", config_file=str(conf)) as server:
        s = load_settings(environ={}, overrides=[f"nats.servers={server.url}"])
        b = await Bus.open(s, "size-test")
        try:
            assert b.max_message_bytes == 4096
            sub = await b.nc.subscribe("test.size")
            headers = {"x-pad": "p" * 100}
            base = wire.GenerateRequest(request_id="r", prompt="")
            hdrs_len = encoded_size(b"", {**headers, "traceparent": "0" * 55})
            room = 4096 - hdrs_len - len(wire.encode(base))
            while hdrs_len + len(wire.encode(wire.GenerateRequest(request_id="r",
                                                                  prompt="z" * room))) > 4096:
                room -= 1  # msgpack's string length prefix grows with the string
            exact = wire.GenerateRequest(request_id="r", prompt="z" * room)
            ctx = trace.get_tracer("t").start_as_current_span("size")
            with ctx:  # a traceparent header of known length (55 chars)
                await b.publish("test.size", exact, headers=headers)
                got = await sub.next_msg(timeout=5)  # the server accepted exactly the limit
                assert wire.decode(got.data, wire.GenerateRequest).prompt == "z" * room
                over = wire.GenerateRequest(request_id="r", prompt="z" * (room + 1))
                with pytest.raises(PayloadTooLarge):
                    await b.publish("test.size", over, headers=headers)
        finally:
            await b.close()


async def test_trace_context_crosses_the_bus(bus: Bus, echo: EchoService) -> None:
    with trace.get_tracer("test").start_as_current_span("client") as span:
        await bus.request(f"{echo.prefix}.lookup", _lookup(), expect=wire.LookupReply)
        tid = span.get_span_context().trace_id
    assert echo.seen_trace_ids[-1] == tid
    server_spans = [s for s in _spans.get_finished_spans() if s.name == "echo.lookup"]
    assert any(s.context.trace_id == tid and s.parent is not None for s in server_spans)


async def test_micro_health_and_info(bus: Bus, echo: EchoService) -> None:
    pings = []
    inbox = bus.nc.new_inbox()
    sub = await bus.nc.subscribe(inbox)
    await bus.nc.publish("$SRV.PING.cpd-echo", b"", reply=inbox)
    while True:
        try:
            pings.append(json.loads((await sub.next_msg(timeout=0.5)).data))
        except Exception:
            break
    assert any(p["metadata"]["node"] == echo.node_id for p in pings)
    info = json.loads((await bus.nc.request("$SRV.INFO.cpd-echo", b"", timeout=2)).data)
    assert {e["name"] for e in info["endpoints"]} == {"generate", "lookup"}


async def _answers(bus: Bus, subject: str, quiet: float = 0.3) -> list[dict]:
    """Every answer to a discovery request on ``subject`` (until ``quiet`` s pass without one)."""
    inbox = bus.nc.new_inbox()
    sub = await bus.nc.subscribe(inbox)
    try:
        await bus.nc.publish(subject, b"", reply=inbox)
        answers = []
        with contextlib.suppress(Exception):
            while True:
                answers.append(json.loads((await sub.next_msg(timeout=quiet)).data))
        return answers
    finally:
        await sub.unsubscribe()


async def _stats(bus: Bus, svc: Service) -> dict[str, dict]:
    """This very instance's ``$SRV.STATS`` endpoints by name."""
    assert svc._micro is not None
    raw = await bus.nc.request(f"$SRV.STATS.cpd-echo.{svc._micro.id}", b"", timeout=2)
    return {e["name"]: e for e in json.loads(raw.data)["endpoints"]}


@pytest.mark.parametrize("verb, parse", [("PING", ServicePing), ("INFO", ServiceInfo),
                                         ("STATS", ServiceStats)])
async def test_micro_answers_on_all_three_subjects(bus: Bus, echo: EchoService, verb: str,
                                                   parse: type) -> None:
    assert echo._micro is not None
    me = echo._micro.id
    for subject in (f"$SRV.{verb}", f"$SRV.{verb}.cpd-echo", f"$SRV.{verb}.cpd-echo.{me}"):
        mine = [a for a in await _answers(bus, subject) if a["id"] == me]
        assert len(mine) == 1, subject
        answer = mine[0]
        assert answer["type"] == f"io.nats.micro.v1.{verb.lower()}_response"
        assert (answer["name"], answer["version"]) == ("cpd-echo", echo.version)
        assert answer["metadata"] == {"node": echo.node_id}
        # nats.micro reads it back field for field (what other micro clients expect).
        assert parse.from_dict(answer).to_dict() == answer
    if verb == "INFO":
        assert sorted(answer["endpoints"], key=lambda e: e["name"]) == [
            {"name": n, "subject": f"{echo.prefix}.{n}", "queue_group": "echo", "metadata": {}}
            for n in ("generate", "lookup")]


async def test_micro_stats_count_typed_handler_errors(bus: Bus, echo: EchoService) -> None:
    before = (await _stats(bus, echo))["lookup"]
    assert (before["num_errors"], before["last_error"]) == (0, "")
    with pytest.raises(Overloaded):
        await bus.request(f"{echo.prefix}.lookup", _lookup("busy"), expect=wire.LookupReply)
    after = (await _stats(bus, echo))["lookup"]
    assert after["num_requests"] == before["num_requests"] + 1
    assert after["num_errors"] == 1
    assert after["last_error"] == "overloaded: too many requests"
    with pytest.raises(RemoteError):
        await bus.request(f"{echo.prefix}.lookup", _lookup("crash"), expect=wire.LookupReply)
    after = (await _stats(bus, echo))["lookup"]
    assert after["num_errors"] == 2 and after["last_error"].startswith("internal: ")
    assert "boom" in after["last_error"]
    # A success is no error.
    await bus.request(f"{echo.prefix}.lookup", _lookup(), expect=wire.LookupReply)
    assert (await _stats(bus, echo))["lookup"]["num_errors"] == 2


async def test_micro_stats_count_bad_input_as_errors(bus: Bus, echo: EchoService) -> None:
    before = (await _stats(bus, echo))["lookup"]
    raw = await bus.nc.request(f"{echo.prefix}.lookup", b"\xc1garbage", timeout=5)
    assert wire.decode(raw.data, wire.Error).code == ErrorCode.MALFORMED.value
    after = (await _stats(bus, echo))["lookup"]
    assert after["num_requests"] == before["num_requests"] + 1
    assert after["num_errors"] == before["num_errors"] + 1
    assert after["last_error"].startswith("malformed: ")


async def test_micro_stats_time_whole_concurrent_handlers(bus: Bus, echo: EchoService) -> None:
    before = (await _stats(bus, echo))["lookup"]
    started = time.monotonic()
    replies = await asyncio.gather(*(
        bus.request(f"{echo.prefix}.lookup", _lookup("nap"), expect=wire.LookupReply)
        for _ in range(2)))
    took = time.monotonic() - started
    assert [r.num_blocks for r in replies] == [2, 2]
    assert took < 0.5  # the two ran at once, not one after the other
    after = (await _stats(bus, echo))["lookup"]
    assert after["num_requests"] == before["num_requests"] + 2
    # Each is timed to its handler's end (0.3 s), not to the task's spawn.
    assert after["processing_time"] - before["processing_time"] >= 2 * 300_000_000
    assert after["average_processing_time"] >= 2 * 300_000_000 // 3  # with the probe
    assert after["num_errors"] == 0


async def _stream_fails(bus: Bus, echo: EchoService, prompt: str) -> None:
    """Stream ``prompt`` from the echo service, which ends it with ``Overloaded``."""
    with pytest.raises(Overloaded):
        async for _ in bus.stream(f"{echo.prefix}.generate",
                                  wire.GenerateRequest(request_id="g", prompt=prompt),
                                  timeout=10):
            pass


async def test_micro_stats_time_streamed_replies(bus: Bus, echo: EchoService) -> None:
    before = (await _stats(bus, echo))["generate"]
    msgs = [m async for m in bus.stream(f"{echo.prefix}.generate",
                                        wire.GenerateRequest(request_id="g", prompt="ab"),
                                        timeout=10)]
    assert isinstance(msgs[-1], wire.Final)
    after = (await _stats(bus, echo))["generate"]
    assert after["num_requests"] == before["num_requests"] + 1
    assert after["processing_time"] > before["processing_time"]
    await _stream_fails(bus, echo, "fail-midway")
    after = (await _stats(bus, echo))["generate"]
    assert after["num_errors"] == before["num_errors"] + 1
    assert after["last_error"] == "overloaded: decode lost"
    # A stream the handler ended with an error is a failed request too (as the router's
    # generate endpoint ends its client's stream).
    await _stream_fails(bus, echo, "stream-error")
    after = (await _stats(bus, echo))["generate"]
    assert after["num_errors"] == before["num_errors"] + 2
    assert after["last_error"] == "overloaded: stream ended"


async def test_graceful_stop_finishes_in_flight_work(settings: Settings, bus: Bus) -> None:
    svc = EchoService(settings, f"test.{uuid.uuid4().hex[:8]}")
    await svc.start()
    pending = asyncio.create_task(bus.request(f"{svc.prefix}.lookup", _lookup("slow"),
                                              expect=wire.LookupReply, timeout=10))
    for _ in range(200):  # until the slow request is in flight (the handler started)
        if svc.seen_trace_ids:
            break
        await asyncio.sleep(0.01)
    await svc.stop()
    assert (await pending).num_blocks == 2
    with pytest.raises(NoResponders):
        await bus.request(f"{svc.prefix}.lookup", _lookup(), expect=wire.LookupReply)


async def test_service_and_client_survive_a_nats_restart(fresh_nats: NatsServer) -> None:
    s = load_settings(environ={}, overrides=[f"nats.servers={fresh_nats.url}",
                                             "nats.reconnect_wait_s=0.1"])
    svc = EchoService(s, "test.restart")
    await svc.start()
    client = await Bus.open(s, "restart-client")
    try:
        await client.request("test.restart.lookup", _lookup(), expect=wire.LookupReply)
        fresh_nats.restart()
        for _ in range(100):
            try:
                r = await client.request("test.restart.lookup", _lookup(),
                                         expect=wire.LookupReply, timeout=0.5)
                break
            except (NoResponders, RequestTimeout, Exception):
                await asyncio.sleep(0.1)
        else:
            pytest.fail("no reply after the NATS restart")
        assert r.num_blocks == 2
    finally:
        await client.close()
        await svc.stop()


async def test_malformed_reply_is_typed(bus: Bus) -> None:
    sub = await bus.nc.subscribe("test.badreply")

    async def answer() -> None:
        msg = await sub.next_msg(timeout=5)
        await bus.nc.publish(msg.reply, b"\xc1")

    task = asyncio.create_task(answer())
    with pytest.raises(MalformedMessage):
        await bus.request("test.badreply", _lookup(), expect=wire.LookupReply)
    await task


async def test_a_stream_whose_reader_vanished_is_found_and_a_read_one_is_not(
        settings: Settings, bus: Bus) -> None:
    """Reader checks: a keep-alive sent as a request finds an inbox left without a
    subscriber (its client's connection closed, as a killed gateway's does) at two
    checks in a row; the stream still read is never reported."""
    gone: list[str] = []
    keepalives = KeepAlives(0.2, log=structlog.get_logger(), reader_check_s=0.2,
                            reader_misses=2, reader_gone=lambda out: gone.append(
                                out.request_id))
    client = await Bus.open(settings, "reader")
    read_inbox, lost_inbox = bus.nc.new_inbox(), client.nc.new_inbox()
    read: list[Msg] = []

    async def reader(msg: Msg) -> None:
        read.append(msg)

    await bus.nc.subscribe(read_inbox, cb=reader)
    await client.nc.subscribe(lost_inbox)
    streams = [ReplyStream(bus, read_inbox, "read"), ReplyStream(bus, lost_inbox, "lost")]
    stopping = False
    ticker = asyncio.create_task(keepalives.run(lambda: stopping))
    try:
        with keepalives.watching(streams[0]), keepalives.watching(streams[1]):
            for out in streams:
                await out.tokens([1, 2])
            await asyncio.sleep(1.0)
            assert gone == []
            await client.close()
            deadline = time.monotonic() + 5
            while not gone:
                assert time.monotonic() < deadline, "the vanished reader was not found"
                await asyncio.sleep(0.05)
            await asyncio.sleep(0.6)
            assert gone == ["lost"]  # once, and only it
    finally:
        stopping = True
        await ticker
    # The read stream's reader got its token and the checks as keep-alives of its seq.
    got = [wire.decode(m.data, wire.TokenChunk) for m in read]
    assert got[0].token_ids == [1, 2] and len(got) > 3
    assert {(c.seq, c.keepalive_ms) for c in got[1:]} == {(0, 200)}


async def test_a_reader_that_closed_its_stream_on_a_live_connection_is_found(
        bus: Bus) -> None:
    """Stream inboxes share their connection's subscription, so NATS cannot answer a
    reader check on a closed one; the connection answers it, and the check says gone.
    An open reader's stream is still read."""
    open_reader = StreamReader(bus, idle_timeout=5)
    closed_reader = StreamReader(bus, idle_timeout=5)
    streams = [ReplyStream(bus, await r.open(), rid)
               for r, rid in ((open_reader, "open"), (closed_reader, "closed"))]
    for out in streams:
        await out.tokens([1])
    await closed_reader.close()
    assert await streams[0].probe(1000, 0.3) is True
    assert await streams[1].probe(1000, 0.3) is False
    first = await open_reader.next(1)
    assert isinstance(first, wire.TokenChunk) and first.token_ids == [1]
    await open_reader.close()
