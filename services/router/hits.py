"""kvindex's answer to a lookup in the router's terms: blocks per node and tier."""

from __future__ import annotations

import functools
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
    # node → its read capability of the request's namespace (DRAM and disk locations):
    # copied into the LoadSource, without it the node's data plane refuses the pull.
    caps: Mapping[str, bytes] = field(default_factory=dict)
    # node → blocks visible on its disk tier (read into its arena before they are served).
    disk: Mapping[str, int] = field(default_factory=dict)

    @classmethod
    def from_reply(cls, reply: wire.LookupReply | None) -> Hits:
        """A lookup reply; ``None`` (timeout, error) and ``recovering`` are misses."""
        if reply is None or reply.status == "recovering":
            return cls(ok=False)
        gpu = {m.node: m.num_blocks for m in reply.matches if m.tier is wire.Tier.GPU}
        dram = {m.node: m.num_blocks for m in reply.matches if m.tier is wire.Tier.DRAM}
        disk = {m.node: m.num_blocks for m in reply.matches if m.tier is wire.Tier.DISK}
        caps = {m.node: m.capability for m in reply.matches
                if m.tier in wire.SERVED_TIERS and m.capability}
        return cls(gpu=gpu, dram=dram, pending={p.node: p.num_blocks for p in reply.pending},
                   caps=caps, disk=disk)

    @functools.cached_property
    def served(self) -> Mapping[str, int]:
        """node → blocks its data plane can serve: its DRAM or, when longer, disk prefix."""
        if not self.disk:
            return self.dram
        return {n: max(self.dram.get(n, 0), self.disk.get(n, 0))
                for n in {*self.dram, *self.disk}}

    def from_disk(self, node: str, first_block: int, end_block: int) -> int:
        """How many of blocks ``first_block``..``end_block`` ``node`` must read from its
        disk tier (those past its DRAM prefix)."""
        if not self.disk:
            return 0
        return max(0, end_block - max(first_block, self.dram.get(node, 0)))

    def source(self, node: str, first_block: int, num_blocks: int) -> wire.LoadSource:
        """Load ``num_blocks`` of ``node``'s served blocks from ``first_block``, with its
        capability (the puller asks kvindex for what the blocks must checksum to)."""
        tier = wire.Tier.DISK if self.from_disk(node, first_block, first_block + num_blocks) \
            else wire.Tier.DRAM
        return wire.LoadSource(node=node, tier=tier, first_block=first_block,
                               num_blocks=num_blocks, capability=self.caps.get(node, b""))
