"""KV block transfers between workers over UCX (docs/architecture.md, "KV tiers and the data
plane"), with ``ucxx``.

Each worker runs one :class:`TransferServer` (a UCX listener; its address,
``b"host:port"``, goes into the heartbeat) in front of its :class:`~cpd.kvstore.KvStore`,
and one :class:`TransferClient` that keeps a connection per peer and bounds how many
transfers run at once.

One exchange moves a batch of blocks. Everything travels as tagged UCX messages on the
connection's endpoint (ucxx mixes each integer tag with a per-connection secret, so tags
of different connections never meet):

* the client sends a length-prefixed msgpack header (:class:`~cpd.protocol.wire.BlockGet` or
  :class:`~cpd.protocol.wire.BlockPut`) on :data:`CTRL_TAG`;
* the server answers with a :class:`~cpd.protocol.wire.BlockReply` on tag ``(xfer, 0)``: the refs
  and seals (length, xxh3-64) of the blocks that follow, or a typed error;
* block ``i`` travels on tag ``(xfer, 2 + i)``, straight from the sender's arena slot into
  the receiver's (zero-copy views; nothing is allocated per transfer) and its checksum is
  verified as soon as it lands;
* except in a get that asked for coalescing (``BlockGet.runs``, laid out by
  :func:`coalesce_runs`): there a run of consecutive small blocks travels as one message
  on the tag of its first block, packed back to back (block ``j`` at the sum of the
  ``nbytes`` before it in the run), copied through preallocated staging buffers on both
  sides; per-message Python costs more than copying a small block. The reply says
  ``coalesced``, so a peer that ignored the layout (an older build) is told apart;
* a put adds the final status on tag ``(xfer, 1)`` once the server verified and sealed.

A worker's server enforces capabilities (:mod:`cpd.protocol.capability`): a get must carry the
read capability of its namespace at this node (a put, the write capability), checked in
constant time before any block is looked at, so a client that only knows or guesses
block hashes gets :class:`~cpd.protocol.errors.CapabilityDenied` and not a byte. A server built
without a keyring (tools, benchmarks, the transfer tests' peers) serves any get.

Every exchange has a deadline. UCX never notices a paused peer by itself, so on a missed
deadline (or any endpoint error) the endpoint is aborted, which also cancels the receives
still aimed at our buffers before those buffers are reused. Errors are typed:
:class:`~cpd.protocol.errors.PeerGone`, :class:`~cpd.protocol.errors.BlockEvicted`,
:class:`~cpd.protocol.errors.ChecksumMismatch`, :class:`~cpd.protocol.errors.TransferTimeout`,
:class:`~cpd.protocol.errors.CapabilityDenied`.
"""

from .client import Expected, Fetched, TransferClient
from .framing import (
                      CTRL_TAG,
                      coalesce_runs,
                      decode_address,
                      encode_address,
                      header_capacity,
                      xfer_tag,
)
from .meter import BandwidthMeter
from .runtime import active_transports, init_ucx, shutdown_ucx, ucx_options
from .server import TransferServer

__all__ = ["CTRL_TAG", "BandwidthMeter", "Expected", "Fetched", "TransferClient",
           "TransferServer", "active_transports", "coalesce_runs", "decode_address",
           "encode_address", "header_capacity", "init_ucx", "shutdown_ucx", "ucx_options",
           "xfer_tag"]
