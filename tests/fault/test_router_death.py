"""A client whose router dies mid-stream notices within a few keep-alive intervals, not
at its deadline (docs/reliability.md): it resumes a deterministic request on another
router replica (the stream goes on, nothing repeated), else gets a typed, retryable
``RouterGone``.

The router sends a keep-alive (an empty ``TokenChunk`` with ``keepalive_ms``) on every
client stream silent for ``router.keepalive_interval_s``; the client skips them and fails
a stream after ``router.keepalive_misses`` intervals without any message. Checked with a
scripted router on a real NATS server (the timing rules), then with a real router process
killed with SIGKILL while its streams run."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator

import nats.errors
import pytest

from cpd.bus import Bus, ReplyStream
from cpd.client import Client
from cpd.ops.config import RouterSettings, load_settings
from cpd.ops.natsserver import NatsServer
from cpd.protocol import subjects, wire
from cpd.protocol.errors import CpdError, NoResponders, RouterGone, StreamGap
from tools.bench.simcluster import SimCluster

pytestmark = pytest.mark.timeout(60)

INTERVAL_MS = 200
MISSES = 3
SILENCE_S = INTERVAL_MS / 1000 * MISSES  # the client's limit


@pytest.fixture
async def scripted(fresh_nats: NatsServer) -> AsyncIterator[tuple[Client, dict]]:
    """A client and a scripted router on a NATS server of this test's own. ``script``
    says what the router does: ``keepalives`` (send them while silent), ``silent_s``
    (how long it says nothing after the first keep-alive), ``die`` (stop after it)."""
    settings = load_settings(environ={}, overrides=[f"nats.servers={fresh_nats.url}",
                                                    "nats.drain_timeout_s=2"])
    router_bus = await Bus.open(settings, "scripted-router")
    client_bus = await Bus.open(settings, "client")
    script: dict = {"keepalives": True, "first": True, "silent_s": 1.5, "die": False,
                    "tail_s": 0.0}
    tasks: set[asyncio.Task] = set()

    async def serve(msg) -> None:
        if msg.data == b"probe":
            return
        req = wire.decode(msg.data, wire.GenerateRequest)
        out = ReplyStream(router_bus, msg.reply, req.request_id)
        if script["first"]:
            await out.keepalive(INTERVAL_MS)
        async def quiet(seconds: float) -> None:
            end = time.monotonic() + seconds
            while time.monotonic() < end:
                await asyncio.sleep(INTERVAL_MS / 1000 / 2)
                if (script["keepalives"]
                        and time.monotonic() - out.last_sent >= INTERVAL_MS / 1000 / 2):
                    await out.keepalive(INTERVAL_MS)

        await quiet(script["silent_s"])
        if script["die"]:
            return  # a dead router sends nothing more
        await out.tokens([7, 8], "ab")
        await quiet(script["tail_s"])
        await out.final(finish_reason="length")

    async def on_msg(msg) -> None:
        t = asyncio.create_task(serve(msg))
        tasks.add(t)
        t.add_done_callback(tasks.discard)

    await router_bus.nc.subscribe(subjects.GENERATE, cb=on_msg)
    # Until the client's requests reach the scripted router (on a loaded host, a flush
    # alone was seen to leave the first request answered "no responders").
    for _ in range(100):
        try:
            await client_bus.nc.request(subjects.GENERATE, b"probe", timeout=0.05)
        except nats.errors.NoRespondersError:
            await asyncio.sleep(0.05)
        except nats.errors.TimeoutError:
            break  # it reached the router, which ignores probes
    # No resuming: what the client notices, and how fast, is under test here.
    client = Client(client_bus, keepalive_interval_s=INTERVAL_MS / 1000,
                    keepalive_misses=MISSES, owns_bus=True, resume_attempts=0)
    yield client, script
    for t in list(tasks):
        t.cancel()
    await client.close()
    await router_bus.close()


async def test_keepalives_keep_a_silent_stream_alive_and_are_not_yielded(scripted) -> None:
    client, _ = scripted
    # Silent for 1.5 s, far past the client's 0.6 s limit, but keep-alives keep coming.
    msgs = [m async for m in client.stream([1, 2, 3], max_tokens=2, timeout_s=20)]
    assert [type(m) for m in msgs] == [wire.TokenChunk, wire.Final]
    assert msgs[0].token_ids == [7, 8] and not msgs[0].keepalive_ms
    done = await client.generate([1, 2, 3], max_tokens=2, timeout_s=20)
    assert done.token_ids == [7, 8]


async def test_a_router_that_stops_sending_fails_the_stream_typed_and_fast(scripted) -> None:
    client, script = scripted
    script |= {"keepalives": False, "silent_s": 0.0, "die": True}
    t0 = time.monotonic()
    with pytest.raises(RouterGone) as e:
        await client.generate([1, 2, 3], max_tokens=2, timeout_s=30)
    took = time.monotonic() - t0
    assert e.value.retryable and e.value.code.value == "unavailable"
    assert SILENCE_S <= took < SILENCE_S + 1.0, took  # not the 30 s deadline


async def test_a_router_that_dies_before_its_first_keepalive_is_noticed(scripted) -> None:
    """A router killed with the request still queued in it never sends anything: the
    watchdog runs from the start, on the client's configured interval."""
    client, script = scripted
    script |= {"keepalives": False, "first": False, "silent_s": 0.0, "die": True}
    t0 = time.monotonic()
    with pytest.raises(RouterGone):
        await client.generate([1, 2, 3], max_tokens=2, timeout_s=30)
    assert SILENCE_S <= time.monotonic() - t0 < SILENCE_S + 1.0


async def test_a_lost_message_fails_the_stream_promptly_not_at_the_deadline(
        scripted, monkeypatch) -> None:
    """A message lost between router and client (a NATS restart): the keep-alives that
    follow it wait behind the gap, so the stream fails within the limit too."""
    client, script = scripted
    sent = []
    real_publish = Bus.publish

    async def lossy(self, subject, msg, *args, **kw):  # drop the first token chunk
        if isinstance(msg, wire.TokenChunk) and msg.token_ids and not sent:
            sent.append(msg)
            return
        return await real_publish(self, subject, msg, *args, **kw)

    monkeypatch.setattr(Bus, "publish", lossy)
    script |= {"silent_s": 0.0}

    t0 = time.monotonic()
    with pytest.raises(CpdError) as e:
        await client.generate([1, 2, 3], max_tokens=2, timeout_s=30)
    assert sent and e.value.retryable
    assert time.monotonic() - t0 < SILENCE_S + 1.0


@pytest.mark.slow
@pytest.mark.timeout(240)
async def test_clients_of_a_killed_router_process_get_router_gone_promptly(tmp_path) -> None:
    """A real router process with streams in flight, SIGKILLed: every client gets
    ``RouterGone`` within the keep-alive limit (+ slack for this loaded host), long
    before its 120 s deadline; a request sent while no router runs is refused at once."""
    # Slow decode (a tenth of real time) so the streams are long.
    cluster = SimCluster({"p0": "prefill", "d0": "decode"}, tmp_path, label="router-death",
                         env={"CPD_SIM__TIME_SCALE": "0.1"})
    await cluster.start()
    try:
        client = cluster.client
        assert client is not None
        client.resume_attempts = 0  # the typed error itself is under test here
        limit = RouterSettings().keepalive_interval_s * client.keepalive_misses
        streaming = [asyncio.Event() for _ in range(6)]

        async def one(i: int) -> tuple[BaseException | None, int, float]:
            got = 0
            try:
                async with contextlib.aclosing(client.stream(
                        [1000 + i, *range(1, 600)], max_tokens=400, ignore_eos=True,
                        timeout_s=120)) as stream:
                    async for msg in stream:
                        if isinstance(msg, wire.TokenChunk) and msg.token_ids:
                            got += len(msg.token_ids)
                            streaming[i].set()
            except CpdError as e:
                return e, got, time.monotonic()
            return None, got, time.monotonic()

        tasks = [asyncio.create_task(one(i)) for i in range(len(streaming))]
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in streaming)), 90)
        t_kill = time.monotonic()
        cluster.kill(cluster.router_node)
        results = await asyncio.wait_for(asyncio.gather(*tasks), 60)
        for err, got, t_end in results:
            assert isinstance(err, RouterGone) and err.retryable, err
            assert got > 0
            assert t_end - t_kill < limit + 3.0, t_end - t_kill
        with pytest.raises(NoResponders):
            await client.generate([1, 2, 3], max_tokens=1, timeout_s=30)
    finally:
        await cluster.stop()


@pytest.mark.slow
@pytest.mark.timeout(240)
async def test_streams_of_a_killed_router_resume_on_the_other_replica(tmp_path) -> None:
    """Two router replicas; the one serving every stream is SIGKILLed mid-stream. Every
    stream ends as if nothing happened: the client resumes it on the other router with
    the tokens and text it has, and gets exactly the tokens and text of an undisturbed
    run, none twice."""
    cluster = SimCluster({"p0": "prefill", "d0": "decode", "router-b": "router"}, tmp_path,
                         label="router-resume", env={"CPD_SIM__TIME_SCALE": "0.1"})
    await cluster.start()
    try:
        client = cluster.client
        assert client is not None
        prompts = [[3000 + i, *range(1, 600)] for i in range(6)]
        options = {"max_tokens": 300, "ignore_eos": True, "timeout_s": 180}
        streaming = [asyncio.Event() for _ in prompts]
        got = [0] * len(prompts)  # tokens each stream has (what a timeout reports)
        await cluster.stop_node("router-b")  # every stream starts on the other router

        async def one(i: int) -> tuple[list[int], str, wire.Final]:
            ids: list[int] = []
            text = ""
            async with contextlib.aclosing(client.stream(prompts[i], **options)) as stream:
                async for msg in stream:
                    if isinstance(msg, wire.Final):
                        return ids, text, msg
                    ids += msg.token_ids
                    text += msg.text
                    got[i] = len(ids)
                    if len(ids) >= 5:
                        streaming[i].set()
            raise AssertionError("no final message")

        runs = [asyncio.create_task(one(i)) for i in range(len(prompts))]
        try:
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in streaming)), 90)
        except TimeoutError:
            ended = ["running" if not r.done() else "cancelled" if r.cancelled()
                     else repr(r.exception()) for r in runs]
            try:
                status: object = await asyncio.wait_for(client.status(), 5)
            except Exception as e:
                status = repr(e)
            pytest.fail(f"not every stream started in 90 s: tokens {got}, {ended}, "
                        f"crashed nodes {cluster.crashed()}, status {status}, "
                        f"router log: {cluster.log_tail(cluster.router_node)}")
        await cluster.restart("router-b")
        assert not any(r.done() for r in runs)  # killed mid-stream, each of them
        cluster.kill(cluster.router_node)
        results = await asyncio.wait_for(asyncio.gather(*runs), 120)
        assert (await client.status()).router.resumed == len(prompts)
        undisturbed = await asyncio.gather(*(client.generate(p, **options) for p in prompts))
        for (ids, text, final), want in zip(results, undisturbed, strict=True):
            assert (ids, text) == (want.token_ids, want.text)
            assert final.usage.completion_tokens == options["max_tokens"]
    finally:
        await cluster.stop()


def _lossy_publish(monkeypatch, drop) -> list:
    """Make every Bus drop the published messages ``drop(msg)`` picks (a NATS restart
    losing them); returns what was dropped."""
    dropped: list = []
    real_publish = Bus.publish

    async def lossy(self, subject, msg, *args, **kw):
        if drop(msg, dropped):
            dropped.append(msg)
            return None
        return await real_publish(self, subject, msg, *args, **kw)

    monkeypatch.setattr(Bus, "publish", lossy)
    return dropped


async def test_a_lost_keepalive_opens_no_gap(scripted, monkeypatch) -> None:
    """Keep-alives after the first repeat the last seq (out of band): losing some of
    them loses nothing, and the stream completes."""
    client, _ = scripted
    dropped = _lossy_publish(monkeypatch, lambda m, d: (
        isinstance(m, wire.TokenChunk) and m.keepalive_ms > 0 and len(d) < 2))
    done = await client.generate([1, 2, 3], max_tokens=2, timeout_s=20)
    assert done.token_ids == [7, 8] and len(dropped) == 2


async def test_keepalives_after_a_lost_message_prove_it_lost(scripted, monkeypatch) -> None:
    """Tokens lost, then only keep-alives for a long while: the keep-alives carry the
    seq of the lost message, so the client reports the gap within its limit instead of
    waiting for the final message or the deadline."""
    client, script = scripted
    script |= {"silent_s": 0.0, "tail_s": 10.0}
    dropped = _lossy_publish(monkeypatch, lambda m, d: (
        isinstance(m, wire.TokenChunk) and bool(m.token_ids) and not d))
    t0 = time.monotonic()
    with pytest.raises(StreamGap) as e:
        await client.generate([1, 2, 3], max_tokens=2, timeout_s=30)
    assert dropped and e.value.retryable
    assert time.monotonic() - t0 < SILENCE_S + 1.0
