"""Where one engine rank's KV lives inside a CPD block: pure arithmetic, no torch.

A CPD block (one arena slot) always holds the *whole* model's KV of its tokens: every
layer in order, and in each layer every KV head, as one tensor-parallel-1 engine lays
out a block of that layer. A rank of a tensor-parallel engine holds a contiguous range
of the heads and a pipeline stage a range of the layers; each copies exactly its part.
So the bytes of a block do not depend on how the engine that computed it was split: a
TP=4 prefill node hands its blocks to a TP=1 decode node, and a TP=2 node loads blocks a
TP=1 node saved, with no conversion (docs/architecture.md, "Engines").

With fewer KV heads than ranks vLLM replicates each head on ``tp / heads`` ranks; the
first rank of each group writes it, all of them read it.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ShardLayout:
    """One rank's share of a block: ``num_layers`` and ``num_kv_heads`` are the whole
    model's; ``layer_bytes`` is one layer of one block, every head."""

    num_layers: int
    num_kv_heads: int
    tp_size: int = 1
    tp_rank: int = 0
    layer_bytes: int = 0

    def __post_init__(self) -> None:
        if not 0 <= self.tp_rank < self.tp_size:
            raise ValueError(f"tensor-parallel rank {self.tp_rank} of {self.tp_size}")
        h, tp = self.num_kv_heads, self.tp_size
        if h <= 0 or self.num_layers <= 0:
            raise ValueError("a model needs at least one layer and one KV head")
        if h % tp and tp % h:
            raise ValueError(f"{h} KV heads cannot be split over {tp} tensor-parallel ranks")
        if self.layer_bytes % h:
            raise ValueError(f"a layer's block of {self.layer_bytes} bytes does not split "
                             f"into {h} heads")

    @property
    def local_heads(self) -> int:
        """KV heads this rank holds."""
        return max(1, self.num_kv_heads // self.tp_size)

    @property
    def first_head(self) -> int:
        """The model's index of this rank's first KV head."""
        h, tp = self.num_kv_heads, self.tp_size
        return self.tp_rank * h // tp if h >= tp else self.tp_rank // (tp // h)

    @property
    def writes(self) -> bool:
        """Whether this rank saves its heads (with replicated heads, one rank of each
        group does; the others hold the same bytes)."""
        h, tp = self.num_kv_heads, self.tp_size
        return h >= tp or self.tp_rank % (tp // h) == 0

    @property
    def head_bytes(self) -> int:
        """One head of one layer of one block."""
        return self.layer_bytes // self.num_kv_heads

    @property
    def slot_bytes(self) -> int:
        """One whole block: every layer, every head."""
        return self.num_layers * self.layer_bytes

    def layer_offset(self, layer: int) -> int:
        """Byte offset of the model's ``layer`` in a block."""
        if not 0 <= layer < self.num_layers:
            raise ValueError(f"layer {layer} of a {self.num_layers}-layer model")
        return layer * self.layer_bytes


def runs(pairs: list[tuple[int, int]]) -> list[tuple[int, int, int]]:
    """``(engine block, slot)`` pairs as runs ``(first block, first slot, length)`` in
    which both advance by one: each run is copied with one call per layer."""
    out: list[tuple[int, int, int]] = []
    for block, slot in pairs:
        if out and block == out[-1][0] + out[-1][2] and slot == out[-1][1] + out[-1][2]:
            b, s, n = out[-1]
            out[-1] = (b, s, n + 1)
        else:
            out.append((block, slot, 1))
    return out
