"""The receiving side of a get: the receives posted into the landing views (or staging
lanes, for coalesced runs), the vetting of the peer's reply, and the checksum of every
block as it lands."""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable, Sequence

import numpy as np

from cpd.kvstore import checksum
from cpd.protocol import wire
from cpd.protocol.errors import MalformedMessage

from .connections import Connection
from .framing import CTRL_TAG, check_reply, frame, reply_failure, unframe, unpack_run, xfer_tag
from .permits import PermitBuffers
from .runtime import Batch


def vet_get_reply(address: bytes, buf: bytearray, xfer_id: int, hashes: Sequence[bytes],
                  landing: Sequence[np.ndarray], counts: list[int],
                  namespace: str = "") -> wire.BlockReply:
    """The get reply in ``buf``, if it answers the request (for ``namespace``, when the
    request named one); else a typed error."""
    reply = check_reply(unframe(buf, wire.BlockReply), xfer_id)
    if not reply.ok:
        raise reply_failure(reply)
    if namespace and reply.namespace != namespace:
        raise MalformedMessage(f"{address.decode()} answered a get of namespace "
                               f"{namespace} with blocks of {reply.namespace[:64]!r}")
    if counts and not reply.coalesced:
        # Its per-block messages are not what our receives wait for.
        raise MalformedMessage(
            f"{address.decode()} ignored the coalesced layout of a get (a build "
            "before coalescing?); dataplane.coalesce_below_bytes = 0 turns it off")
    if reply.coalesced and not counts:
        raise MalformedMessage("get reply coalesced, which was not asked for")
    if ([r.hash for r in reply.blocks] != list(hashes) or len(reply.seals) != len(hashes)
            or any(s.nbytes > v.nbytes for s, v in zip(reply.seals, landing, strict=True))):
        raise MalformedMessage("get reply does not match the request")
    return reply


class GetExchange:
    """The receiving side of one get exchange, awaited by one :class:`Batch`.

    A receive is posted per block into its landing view, or per coalesced run into a
    staging lane (a lane's runs in turn: run k+1's receive is posted once run k was copied
    out, as the peer sends a lane's runs in order). A block is checksummed as it lands,
    while still in cache, once the reply's seals have been vetted; what landed before
    waits for them.
    """

    def __init__(self, conn: Connection, batch: Batch, landing: Sequence[np.ndarray]) -> None:
        self.xfer_id = next(conn.ids)
        self.batch = batch
        self.landing = landing
        self.digests = [0] * len(landing)
        self.seals: list[wire.BlockSeal] = []  # the reply's, once it was vetted
        self._waiting: list[Callable[[], None]] = []  # landed before the reply was vetted

    async def run(self, bufs: PermitBuffers, request: wire.BlockGet,
                  runs: Sequence[tuple[int, int]],
                  vet: Callable[[], wire.BlockReply],
                  accept: Callable[[wire.BlockReply], Awaitable[None]]
                  ) -> tuple[wire.BlockReply, list[int]]:
        """Send ``request``, post every receive, vet and ``accept`` the reply, and await
        every block; returns the reply and each block's xxh3-64 as it landed."""
        header = self.batch.recv(bufs.header, xfer_tag(self.xfer_id, 0))
        # The request leaves first, so the peer looks its blocks up while the receives
        # are posted here; UCX matches a message that comes before its receive once that
        # is posted (a large one waits at the sender).
        self.batch.send(frame(request), CTRL_TAG)
        for start, count in runs:
            if count == 1:
                self._post_block(start)
        packed = [r for r in runs if r[1] > 1]
        for j, staging in enumerate(bufs.staging):
            if lane := packed[j::len(bufs.staging)]:
                self._post_run(lane, 0, staging)
        await self.batch.wait(until=header)
        reply = vet()
        await accept(reply)
        self._vetted(reply.seals)
        await self.batch.wait()
        return reply, self.digests

    def _once_vetted(self, fn: Callable[[], None]) -> None:
        if self.seals:
            fn()
        else:
            self._waiting.append(fn)

    def _vetted(self, seals: Sequence[wire.BlockSeal]) -> None:
        self.seals[:] = seals
        waiting, self._waiting = self._waiting, []
        for fn in waiting:
            fn()

    def _post_block(self, i: int) -> None:
        self.batch.recv(self.landing[i], xfer_tag(self.xfer_id, 2 + i),
                        functools.partial(self._once_vetted, functools.partial(self._check, i)))

    def _check(self, i: int) -> None:  # a block of its own landed
        self.digests[i] = checksum(self.landing[i][:self.seals[i].nbytes])

    def _post_run(self, lane: Sequence[tuple[int, int]], k: int, staging: np.ndarray) -> None:
        start, count = lane[k]
        size = sum(v.nbytes for v in self.landing[start:start + count])
        self.batch.recv(staging[:size], xfer_tag(self.xfer_id, 2 + start), functools.partial(
            self._once_vetted, functools.partial(self._run_landed, lane, k, staging)))

    def _run_landed(self, lane: Sequence[tuple[int, int]], k: int, staging: np.ndarray) -> None:
        start, count = lane[k]
        end = start + count
        self.digests[start:end] = unpack_run(staging, self.seals[start:end],
                                             self.landing[start:end])
        if k + 1 < len(lane):
            self._post_run(lane, k + 1, staging)
