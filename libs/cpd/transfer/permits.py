"""Transfer permits: how a client bounds its concurrent exchanges. Each permit lends the
preallocated buffers one exchange needs, so nothing is allocated per transfer."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass

import numpy as np

from cpd.ops.config import DataPlaneSettings

from .framing import header_capacity

# Coalesced runs a client receives at once per transfer (each into a staging buffer of
# its own): while one run is copied out into its landing views, the next one lands.
_CLIENT_STAGING_LANES = 2


@dataclass(frozen=True, slots=True)
class PermitBuffers:
    """What one of a client's transfer permits lends for the length of an exchange: the
    header buffer, and the staging buffers coalesced runs land in (none when off)."""

    header: bytearray
    staging: tuple[np.ndarray, ...]


class Permits:
    """``max_concurrent_transfers`` permits, each holding one :class:`PermitBuffers`."""

    def __init__(self, settings: DataPlaneSettings) -> None:
        cap = header_capacity(settings.max_blocks_per_transfer)
        coalescing = bool(settings.coalesce_below_bytes and settings.coalesce_message_bytes)
        lanes = _CLIENT_STAGING_LANES if coalescing else 0
        # Last in, first out: the buffers used last are the ones whose pages are mapped
        # and cached (a FIFO would walk every permit's staging pages, first-touch faults
        # included, before reusing any).
        self._buffers: asyncio.LifoQueue[PermitBuffers] = asyncio.LifoQueue()
        for _ in range(settings.max_concurrent_transfers):
            # numpy maps the staging pages lazily: buffers never used cost no memory.
            self._buffers.put_nowait(PermitBuffers(bytearray(cap), tuple(
                np.empty(settings.coalesce_message_bytes, np.uint8) for _ in range(lanes))))
        self.in_flight = 0

    @contextlib.asynccontextmanager
    async def take(self) -> AsyncIterator[PermitBuffers]:
        """Wait for a free permit and hold it (its buffers) for the ``async with`` body."""
        buf = await self._buffers.get()
        self.in_flight += 1
        try:
            yield buf
        finally:
            self.in_flight -= 1
            self._buffers.put_nowait(buf)
