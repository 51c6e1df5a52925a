"""The data plane's wire layout over UCX: tags, length-prefixed msgpack headers, the
coalesced-run layout of a get, packing runs into staging buffers, listener addresses."""

from __future__ import annotations

import itertools
import struct
from collections.abc import Sequence
from typing import Any

import numpy as np

from cpd.kvstore import checksum
from cpd.ops.config import DataPlaneSettings
from cpd.protocol import wire
from cpd.protocol.errors import (
    CpdError,
    InvalidRequest,
    MalformedMessage,
    error_from_wire,
)

CTRL_TAG = 1
"""Tag of client → server headers on every connection."""

_TAG_STRIDE = 1 << 24  # per-exchange tag space: reply 0, final status 1, block i at 2 + i
LENGTH = struct.Struct("<I")
_HEADER_FIXED = 4096  # msgpack envelope, namespace, error text
_HEADER_PER_BLOCK = 128  # a BlockRef + BlockSeal + flags is < 100 bytes in msgpack


def coalesce_runs(capacities: Sequence[int], settings: DataPlaneSettings
                  ) -> list[tuple[int, int]]:
    """How one get's blocks travel: ``(first block, block count)`` per message, in order.

    ``capacities`` are the receiver's landing sizes (slot or destination view), the only
    sizes known before the request goes out. Consecutive blocks of capacity under
    ``coalesce_below_bytes`` share a message while their capacities add up to at most
    ``coalesce_message_bytes``; every other block has one of its own. Either setting at
    0 gives one message per block. The client sends the counts (``BlockGet.runs``), so
    the server follows this layout without recomputing it under its own settings.
    """
    below, limit = settings.coalesce_below_bytes, settings.coalesce_message_bytes
    if not below or not limit:
        return [(i, 1) for i in range(len(capacities))]
    runs: list[tuple[int, int]] = []
    growing = False  # the last run is of small blocks and may take more
    run_bytes = 0  # its capacity so far
    for i, cap in enumerate(capacities):
        small = cap < below and cap <= limit
        if small and growing and run_bytes + cap <= limit:
            start, count = runs[-1]
            runs[-1] = (start, count + 1)
            run_bytes += cap
        else:
            runs.append((i, 1))
            growing, run_bytes = small, cap
    return runs


def runs_field(runs: Sequence[tuple[int, int]]) -> list[int]:
    """``BlockGet.runs`` for a layout: empty when every block has its own message, so
    such a get is exactly what builds without coalescing send and serve."""
    return [count for _, count in runs] if any(count > 1 for _, count in runs) else []


def runs_from_field(counts: Sequence[int], n_blocks: int) -> list[tuple[int, int]]:
    """The layout a ``BlockGet.runs`` describes; :class:`~cpd.protocol.errors.InvalidRequest`
    unless it covers the ``n_blocks`` blocks exactly."""
    if any(c < 1 for c in counts) or sum(counts) != n_blocks:
        raise InvalidRequest(f"runs must be positive counts adding up to the {n_blocks} "
                             "blocks requested")
    starts = itertools.accumulate(counts, initial=0)
    return list(zip(starts, counts, strict=False))


def header_capacity(max_blocks: int) -> int:
    """Bytes of the preallocated buffer one header of up to ``max_blocks`` blocks fits in."""
    return LENGTH.size + _HEADER_FIXED + _HEADER_PER_BLOCK * max_blocks


def xfer_tag(xfer_id: int, index: int) -> int:
    """The integer tag of message ``index`` of exchange ``xfer_id`` (0 reply, 1 final,
    2 + i block i)."""
    return xfer_id * _TAG_STRIDE + index


def encode_address(host: str, port: int) -> bytes:
    """The listener address as published in ``Heartbeat.ucx_address``."""
    return f"{host}:{port}".encode()


def decode_address(address: bytes | str) -> tuple[str, int]:
    """``b"host:port"`` → ``(host, port)``; :class:`~cpd.protocol.errors.MalformedMessage` if
    bad."""
    try:
        text = address.decode() if isinstance(address, bytes | bytearray) else address
    except UnicodeDecodeError:  # a peer's heartbeat carried garbage
        raise MalformedMessage(f"bad UCX address {address[:80]!r}; not text") from None
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise MalformedMessage(f"bad UCX address {text!r}; expected host:port")
    return host.strip("[]"), int(port)


def frame(msg: wire.Message) -> bytes:
    payload = wire.encode(msg)
    return LENGTH.pack(len(payload)) + payload


def unframe(buf: bytearray, expect: type[wire.T]) -> wire.T:
    (n,) = LENGTH.unpack_from(buf)
    if n > len(buf) - LENGTH.size:
        raise MalformedMessage(f"header of {n} bytes overruns its {len(buf)}-byte buffer")
    return wire.decode(memoryview(buf)[LENGTH.size:LENGTH.size + n], expect)



def pack_run(staging: np.ndarray, arena: np.ndarray, entries: Sequence[Any]) -> int:
    """Copy the blocks of ``entries`` back to back into ``staging``; returns the bytes."""
    offset = 0
    for e in entries:
        staging[offset:offset + e.nbytes] = arena[e.slot, :e.nbytes]
        offset += e.nbytes
    return offset


def unpack_run(staging: np.ndarray, seals: Sequence[wire.BlockSeal],
            views: Sequence[np.ndarray]) -> list[int]:
    """Copy a coalesced run out of ``staging`` into its blocks' landing ``views``;
    returns the xxh3-64 of each block as it landed (computed while still in cache)."""
    digests = []
    offset = 0
    for seal, view in zip(seals, views, strict=True):
        landed = view[:seal.nbytes]
        landed[:] = staging[offset:offset + seal.nbytes]
        digests.append(checksum(landed))
        offset += seal.nbytes
    return digests


class CleanFailure(Exception):
    """A typed error the peer reported in a header: nothing else is in flight, so the
    connection stays usable."""

    def __init__(self, error: CpdError) -> None:
        super().__init__(str(error))
        self.error = error


def reply_failure(reply: wire.BlockReply) -> CleanFailure:
    msg = reply.message
    if reply.missing:
        msg += f" (missing {', '.join(h.hex() for h in wire.split_hashes(reply.missing)[:4])})"
    return CleanFailure(error_from_wire(reply.code, msg, False))


def check_reply(reply: wire.BlockReply, xfer_id: int) -> wire.BlockReply:
    if reply.xfer_id != xfer_id:
        raise MalformedMessage(f"reply for transfer {reply.xfer_id} on the tag of {xfer_id}")
    return reply


