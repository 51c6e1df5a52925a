"""A small asyncio TCP fault proxy (toxiproxy cannot be installed here).

``FaultProxy(upstream_host, upstream_port)`` listens on a loopback port and forwards every
connection to the upstream. At run time it can be switched between:

* ``pass`` — forward bytes as they come;
* ``delay`` — hold every chunk ``delay_s`` before forwarding it (order kept per direction);
* ``drop`` — a blackhole: sockets stay open, accepted chunks are discarded, new
  connections are accepted but nothing reaches the other side (a partitioned network,
  not a closed one: peers only notice through their own timeouts);
* ``cut`` — close every connection and refuse new ones (a crashed link or host).

It runs in the caller's event loop (the fault harness, tests) or in a thread of its own
(:meth:`FaultProxy.start_in_thread`), so a busy harness loop does not slow the traffic.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from typing import Literal

Mode = Literal["pass", "delay", "drop", "cut"]
_CHUNK = 64 * 1024


class FaultProxy:
    """One listening port forwarding to ``upstream``, with a switchable fault mode."""

    def __init__(self, upstream_host: str, upstream_port: int, *, listen_host: str = "127.0.0.1",
                 listen_port: int = 0) -> None:
        self.upstream = (upstream_host, upstream_port)
        self.listen_host = listen_host
        self.port = listen_port
        self.mode: Mode = "pass"
        self.delay_s = 0.0
        self.connections = 0          # accepted so far
        self.bytes_forwarded = 0
        self._server: asyncio.base_events.Server | None = None
        self._pipes: set[asyncio.Task[None]] = set()
        self._writers: set[asyncio.StreamWriter] = set()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    # ---------------------------------------------------------------- lifecycle

    async def start(self) -> FaultProxy:
        """Listen (port 0 picks a free one, kept across :meth:`set_mode` calls)."""
        self._loop = asyncio.get_running_loop()
        self._server = await asyncio.start_server(self._accept, self.listen_host, self.port)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    def start_in_thread(self) -> FaultProxy:
        """Run the proxy on an event loop of its own in a daemon thread."""
        started = threading.Event()
        errors: list[BaseException] = []

        def main() -> None:
            loop = asyncio.new_event_loop()
            self._loop = loop
            try:
                loop.run_until_complete(self.start())
            except BaseException as e:  # reported to the caller below
                errors.append(e)
                started.set()
                return
            started.set()
            loop.run_forever()
            loop.run_until_complete(self._close())
            loop.close()

        self._thread = threading.Thread(target=main, name=f"faultproxy-{id(self):x}",
                                        daemon=True)
        self._thread.start()
        started.wait(10)
        if errors:
            raise errors[0]
        return self

    async def close(self) -> None:
        """Stop listening and close every connection."""
        if self._thread is not None:
            self.stop_thread()
            return
        await self._close()

    def stop_thread(self) -> None:
        """Stop a proxy started with :meth:`start_in_thread`."""
        if self._thread is None or self._loop is None:
            return
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._thread = None

    async def _close(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None
        self._close_all()
        pipes = list(self._pipes)
        for t in pipes:
            t.cancel()
        await asyncio.gather(*pipes, return_exceptions=True)

    # ---------------------------------------------------------------- control

    def set_mode(self, mode: Mode, delay_s: float = 0.0) -> None:
        """Switch the fault mode; thread-safe. ``cut`` closes open connections at once."""
        if mode not in ("pass", "delay", "drop", "cut"):
            raise ValueError(f"unknown proxy mode {mode!r}")
        if mode == "delay" and delay_s <= 0:
            raise ValueError("delay mode needs delay_s > 0")
        self.delay_s = delay_s if mode == "delay" else 0.0
        self.mode = mode
        if mode == "cut" and self._loop is not None:
            if self._thread is not None:
                self._loop.call_soon_threadsafe(self._close_all)
            else:
                self._close_all()

    @property
    def address(self) -> tuple[str, int]:
        return self.listen_host, self.port

    # ---------------------------------------------------------------- data path

    def _close_all(self) -> None:
        for w in list(self._writers):
            with contextlib.suppress(Exception):
                w.transport.abort()  # RST, like a dead link, not a polite FIN
        self._writers.clear()

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.mode == "cut":
            writer.transport.abort()
            return
        self.connections += 1
        try:
            up_r, up_w = await asyncio.open_connection(*self.upstream)
        except OSError:
            writer.transport.abort()
            return
        if self.mode == "cut":  # cut while connecting
            writer.transport.abort()
            up_w.transport.abort()
            return
        self._writers |= {writer, up_w}
        pipes = [asyncio.create_task(self._pipe(reader, up_w)),
                 asyncio.create_task(self._pipe(up_r, writer))]
        for t in pipes:
            self._pipes.add(t)
            t.add_done_callback(self._pipes.discard)
        await asyncio.gather(*pipes, return_exceptions=True)
        for w in (writer, up_w):
            self._writers.discard(w)
            with contextlib.suppress(Exception):
                w.transport.abort()

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Forward one direction. Delayed chunks go through a queue so each is held for
        ``delay_s`` from its arrival, not from the previous chunk's release."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[tuple[float, bytes] | None] = asyncio.Queue()

        async def sender() -> None:
            while (item := await queue.get()) is not None:
                due, data = item
                if (wait := due - loop.time()) > 0:
                    await asyncio.sleep(wait)
                if self.mode == "drop":
                    continue  # a chunk released into a blackhole is lost too
                writer.write(data)
                self.bytes_forwarded += len(data)
                await writer.drain()

        out = asyncio.create_task(sender())
        try:
            while True:
                data = await reader.read(_CHUNK)
                if not data or self.mode == "cut":
                    break
                if self.mode == "drop":
                    continue
                queue.put_nowait((loop.time() + self.delay_s, data))
                if out.done():
                    break
        except (ConnectionError, OSError):
            pass
        finally:
            queue.put_nowait(None)
            with contextlib.suppress(Exception):
                await asyncio.wait_for(out, timeout=max(1.0, self.delay_s + 1.0))
            out.cancel()
            with contextlib.suppress(BaseException):
                await out
            with contextlib.suppress(Exception):
                writer.transport.abort()


__all__ = ["FaultProxy", "Mode"]
