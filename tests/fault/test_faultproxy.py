"""The fault proxy on a real TCP echo server: pass, delay, drop (blackhole) and cut."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import pytest

from tools.faultproxy import FaultProxy

pytestmark = pytest.mark.timeout(30)


async def _echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(4096):
            writer.write(data)
            await writer.drain()
    except ConnectionError:
        pass
    finally:
        writer.close()


@pytest.fixture
async def proxy() -> AsyncIterator[FaultProxy]:
    server = await asyncio.start_server(_echo, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    p = await FaultProxy("127.0.0.1", port).start()
    yield p
    await p.close()
    server.close()


async def _roundtrip(p: FaultProxy, payload: bytes, timeout: float = 2.0
                     ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter, bytes]:
    r, w = await asyncio.open_connection(*p.address)
    w.write(payload)
    await w.drain()
    got = await asyncio.wait_for(r.readexactly(len(payload)), timeout)
    return r, w, got


async def test_pass_forwards_both_ways(proxy: FaultProxy) -> None:
    _, w, got = await _roundtrip(proxy, b"hello")
    assert got == b"hello"
    assert proxy.connections == 1 and proxy.bytes_forwarded == 10
    w.close()


async def test_delay_holds_each_chunk(proxy: FaultProxy) -> None:
    r, w, _ = await _roundtrip(proxy, b"warm")
    proxy.set_mode("delay", delay_s=0.3)
    t0 = time.monotonic()
    w.write(b"slow")
    assert await asyncio.wait_for(r.readexactly(4), 3) == b"slow"
    # Both directions are delayed: request and echo.
    assert time.monotonic() - t0 >= 0.55
    proxy.set_mode("pass")
    t0 = time.monotonic()
    w.write(b"fast")
    assert await asyncio.wait_for(r.readexactly(4), 3) == b"fast"
    assert time.monotonic() - t0 < 0.25
    w.close()


async def test_drop_is_a_blackhole_that_keeps_sockets_open(proxy: FaultProxy) -> None:
    r, w, _ = await _roundtrip(proxy, b"one")
    proxy.set_mode("drop")
    w.write(b"lost")
    await w.drain()
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(r.readexactly(4), 0.5)
    assert not r.at_eof()  # not closed: only silence
    # A new connection is accepted but nothing comes back either.
    r2, w2 = await asyncio.open_connection(*proxy.address)
    w2.write(b"x")
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(r2.readexactly(1), 0.3)
    proxy.set_mode("pass")
    w.write(b"back")
    assert await asyncio.wait_for(r.readexactly(4), 2) == b"back"
    w.close()
    w2.close()


async def test_cut_closes_and_refuses_until_restored(proxy: FaultProxy) -> None:
    r, _w, _ = await _roundtrip(proxy, b"one")
    proxy.set_mode("cut")
    # The open connection is reset...
    with pytest.raises((ConnectionError, asyncio.IncompleteReadError)):
        data = await asyncio.wait_for(r.read(10), 2)
        if not data:
            raise asyncio.IncompleteReadError(b"", 1)
    # ...and a new one is refused (accepted then reset at once).
    r2, w2 = await asyncio.open_connection(*proxy.address)
    w2.write(b"x")
    with pytest.raises((ConnectionError, asyncio.IncompleteReadError)):
        data = await asyncio.wait_for(r2.read(1), 2)
        if not data:
            raise asyncio.IncompleteReadError(b"", 1)
    proxy.set_mode("pass")
    _, w3, got = await _roundtrip(proxy, b"again")
    assert got == b"again"
    w3.close()


def test_thread_mode_and_bad_modes() -> None:
    async def main() -> None:
        server = await asyncio.start_server(_echo, "127.0.0.1", 0)
        p = FaultProxy("127.0.0.1", server.sockets[0].getsockname()[1]).start_in_thread()
        try:
            _, w, got = await _roundtrip(p, b"threaded")
            assert got == b"threaded"
            with pytest.raises(ValueError):
                p.set_mode("delay")  # needs a delay
            with pytest.raises(ValueError):
                p.set_mode("bogus")  # type: ignore[arg-type]
            w.close()
        finally:
            p.stop_thread()
            server.close()

    asyncio.run(main())
