"""UCX's connection handshake, safe to time out.

A new ucxx endpoint exchanges 16 bytes of peer information with the other side (each
posts a stream send and a stream receive) and gives up after ``connect_timeout``. ucxx's
own exchange then drops its buffers while the receive is still posted in UCX: a peer that
answers late (a process just started, busy or paused) writes into freed memory, and the
process crashes later somewhere else (a segfault in the allocator, some time after a
"UCX connect attempt timed out" line). This exchange keeps the buffers, the requests and
the endpoint of a handshake that failed until its requests are done; :func:`install`
puts it in place of ucxx's, for dialling and listening alike.
"""

from __future__ import annotations

import asyncio
import struct
from dataclasses import dataclass
from typing import Any

from cpd.ops import telemetry

log = telemetry.get_logger("cpd.transfer")

_FORMAT = "QQ"  # the peer's message tag and its checksum, as ucxx packs them


@dataclass(eq=False)
class _Abandoned:
    """A failed handshake's endpoint, with every buffer UCX may still write into."""

    endpoint: Any
    buffers: tuple[Any, ...]
    requests: list[Any]

    def done(self) -> bool:
        return all(r.completed for r in self.requests)


_abandoned: list[_Abandoned] = []


def abandoned() -> int:
    """Failed handshakes whose requests UCX still holds (their buffers are kept)."""
    _abandoned[:] = [a for a in _abandoned if not a.done()]
    return len(_abandoned)


async def exchange_peer_info(endpoint: Any, msg_tag: int, listener: bool,
                             connect_timeout: float = 5.0) -> dict[str, int]:
    """ucxx's exchange of peer information (same bytes, same order: the listener sends
    first), whose buffers outlive a timeout or a cancel."""
    from .runtime import _request_api  # runtime installs this module: imported late

    Array, _, _, hash64bits = _request_api()
    mine = struct.pack(_FORMAT, msg_tag, hash64bits(msg_tag))
    theirs = bytearray(len(mine))
    mine_arr, theirs_arr = Array(mine), Array(theirs)
    steps = [(endpoint.stream_send, mine_arr), (endpoint.stream_recv, theirs_arr)]
    if not listener:
        steps.reverse()
    posted: list[Any] = []
    try:
        # An await between the two stream calls, as ucxx does (ucx-py pull 509).
        for post, buf in steps:
            posted.append(post(buf))
            await asyncio.wait_for(posted[-1].wait(), timeout=connect_timeout)
    except (TimeoutError, asyncio.CancelledError):
        _abandon(endpoint, (mine, theirs, mine_arr, theirs_arr), posted)
        raise
    tag, checksum = struct.unpack(_FORMAT, theirs)
    if hash64bits(tag) != checksum:
        raise RuntimeError(f"Checksum invalid! {hex(hash64bits(tag))} != {hex(checksum)}")
    return {"msg_tag": tag, "checksum": checksum}


def _abandon(endpoint: Any, buffers: tuple[Any, ...], requests: list[Any]) -> None:
    """Keep a failed handshake's endpoint and buffers until UCX is done with its
    requests: the late answer lands in them, or the other side, which gives up too,
    resets the endpoint and UCX cancels them. (Closing the endpoint here instead crashed
    ucxx when the other side had reset it already.)"""
    abandoned()  # forget the ones that are done
    _abandoned.append(_Abandoned(endpoint, buffers, requests))


def install() -> None:
    """Use :func:`exchange_peer_info` for every ucxx endpoint this process creates."""
    try:
        from ucxx._lib_async import application_context, listener
    except ImportError:
        log.warning("cannot make UCX handshakes safe on this ucxx version")
        return
    for module in (application_context, listener):
        if not hasattr(module, "exchange_peer_info"):
            log.warning("cannot make UCX handshakes safe on this ucxx version",
                        module=module.__name__)
            continue
        module.exchange_peer_info = exchange_peer_info
