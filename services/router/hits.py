"""kvindex's answer to a lookup in the router's terms: blocks per node and tier."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from cpd.protocol import wire


@dataclass(frozen=True)
class Hits:
    """kvindex's answer in the router's terms (blocks per node)."""

    ok: bool = True
    gpu: Mapping[str, int] = field(default_factory=dict)
    dram: Mapping[str, int] = field(default_factory=dict)
    pending: Mapping[str, int] = field(default_factory=dict)
    # node → its read capability of the request's namespace (DRAM locations): copied
    # into the LoadSource, without it the node's data plane refuses the pull.
    caps: Mapping[str, bytes] = field(default_factory=dict)
    # node → its DRAM blocks' sealed checksums as kvindex recorded them (packed): copied
    # into the LoadSource, the puller verifies against them, not the serving peer.
    checksums: Mapping[str, bytes] = field(default_factory=dict)

    @classmethod
    def from_reply(cls, reply: wire.LookupReply | None) -> Hits:
        """A lookup reply; ``None`` (timeout, error) and ``recovering`` are misses."""
        if reply is None or reply.status == "recovering":
            return cls(ok=False)
        gpu = {m.node: m.num_blocks for m in reply.matches if m.tier is wire.Tier.GPU}
        dram = {m.node: m.num_blocks for m in reply.matches if m.tier is wire.Tier.DRAM}
        caps = {m.node: m.capability for m in reply.matches
                if m.tier is wire.Tier.DRAM and m.capability}
        sums = {m.node: m.checksums for m in reply.matches
                if m.tier is wire.Tier.DRAM and m.checksums}
        return cls(gpu=gpu, dram=dram, pending={p.node: p.num_blocks for p in reply.pending},
                   caps=caps, checksums=sums)

    def source(self, node: str, first_block: int, num_blocks: int) -> wire.LoadSource:
        """Load ``num_blocks`` of ``node``'s DRAM blocks from ``first_block``, with its
        capability and those blocks' recorded checksums."""
        sums = self.checksums.get(node, b"")
        at, end = (first_block * wire.CHECKSUM_BYTES,
                   (first_block + num_blocks) * wire.CHECKSUM_BYTES)
        return wire.LoadSource(node=node, tier=wire.Tier.DRAM, first_block=first_block,
                               num_blocks=num_blocks, capability=self.caps.get(node, b""),
                               checksums=sums[at:end] if len(sums) >= end else b"")
