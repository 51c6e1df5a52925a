"""A transfer client's connections: one UCX endpoint per peer, dialled on first need and
reused by every later exchange with that peer, aborted when an exchange fails on it."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from dataclasses import dataclass, field
from typing import Any

from cpd.ops import telemetry
from cpd.ops.config import DataPlaneSettings
from cpd.protocol.errors import PeerGone, TransferTimeout

from .framing import decode_address
from .runtime import NS_PER_S, abort_endpoint, init_ucx, ucx_error

log = telemetry.get_logger("cpd.transfer")


@dataclass(eq=False)
class Connection:
    """One open endpoint to the peer at ``address``; ``ids`` numbers its exchanges."""

    address: bytes
    ep: Any
    ids: itertools.count = field(default_factory=lambda: itertools.count(1))


class ConnectionPool:
    """The open connections of one client, keyed by peer address; concurrent dials of
    the same peer share one handshake."""

    def __init__(self, settings: DataPlaneSettings) -> None:
        self.settings = settings
        self.conns: dict[bytes, Connection] = {}
        self._connecting: dict[bytes, asyncio.Lock] = {}

    def is_open(self, address: bytes) -> bool:
        """Whether a connection to the peer at ``address`` is open."""
        conn = self.conns.get(address)
        return conn is not None and not conn.ep.closed

    async def get(self, address: bytes, attempts: int | None = None) -> Connection:
        """The open connection to ``address``, dialled if there is none. Handshakes repeat
        on a timeout, ``attempts`` times at most (``None``: until the caller's deadline)."""
        if self.is_open(address):
            return self.conns[address]
        lock = self._connecting.setdefault(address, asyncio.Lock())
        async with lock:
            if self.is_open(address):
                return self.conns[address]
            host, port = decode_address(address)
            init_ucx(self.settings)
            import ucxx

            attempt = 0
            while True:
                # A connection attempt sometimes never completes its handshake (seen after
                # a peer died mid-transfer); a fresh attempt does. The transfer's deadline
                # bounds the retries.
                attempt += 1
                try:
                    ep = await ucxx.create_endpoint(
                        host, port, connect_timeout=self.settings.connect_timeout_s)
                    break
                except TimeoutError:
                    log.info("UCX connect attempt timed out; retrying", peer=address.decode(),
                             attempt=attempt)
                    if attempts is not None and attempt >= attempts:
                        raise TransferTimeout(f"no handshake with {address.decode()} in "
                                              f"{attempt} attempts") from None
                except ucx_error() as e:
                    raise PeerGone(f"cannot connect to {address.decode()}: {e}") from e
            conn = Connection(address, ep)
            self.conns[address] = conn
            return conn

    def drop(self, conn: Connection | None) -> None:
        """Forget ``conn`` (if it is still the peer's) and abort its endpoint, which also
        cancels the requests UCX still holds on our buffers."""
        if conn is None:
            return
        if self.conns.get(conn.address) is conn:
            del self.conns[conn.address]
        abort_endpoint(conn.ep, self.settings)

    async def close(self) -> None:
        """Close every connection."""
        conns, self.conns = list(self.conns.values()), {}
        for conn in conns:
            with contextlib.suppress(Exception):
                await conn.ep.close(period=int(self.settings.abort_wait_s * NS_PER_S))
