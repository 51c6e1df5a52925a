"""Engine block ids of a workload's prompts, for the planner.

A workload prompt is a list of content block ids of ``block_tokens`` tokens each, and a
content id names its whole prefix (the generators and the Mooncake trace are built that
way: the same id never follows two different prefixes). The engine caches blocks of
``block_size`` tokens. Engine block ``i`` ends at token ``t = (i + 1) · block_size - 1``,
inside content block ``t // block_tokens`` at offset ``t % block_tokens``; that pair
names the engine block's whole prefix too, so it serves as the block's id (the
planner's stand-in for the chain hash, :func:`cpd.protocol.hashing.block_hashes`). With
equal sizes the content ids are the engine ids.
"""

from __future__ import annotations

import functools

from cpd.sim.workloads import WorkloadRequest

# Offsets inside a content block take this many low bits of an engine block id.
_OFFSET_BITS = 24


def engine_blocks(req: WorkloadRequest, block_size: int) -> tuple[int, ...]:
    """Ids of the prompt's full engine blocks, in chain order."""
    return _engine_blocks(req.block_ids, req.block_tokens, req.prompt_len // block_size,
                          block_size)


@functools.lru_cache(maxsize=1 << 14)
def _engine_blocks(ids: tuple[int, ...], bt: int, n: int, block_size: int
                   ) -> tuple[int, ...]:
    # Cached: a re-timed trace repeats its prompts (the same tuple of ids each time).
    if bt == block_size:
        return ids[:n]
    if bt >= 1 << _OFFSET_BITS:
        raise ValueError(f"content blocks of {bt} tokens are longer than the planner keys")
    if bt % block_size == 0:
        # Whole engine blocks per content block: the same offsets in each.
        offsets = range(block_size - 1, bt, block_size)
        return tuple(i << _OFFSET_BITS | o for i in ids for o in offsets)[:n]
    out = []
    for i in range(n):
        t = (i + 1) * block_size - 1
        out.append(ids[t // bt] << _OFFSET_BITS | t % bt)
    return tuple(out)
