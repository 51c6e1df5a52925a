"""The simulated engine's own GPU prefix cache (vLLM's automatic prefix caching): full
blocks keyed by a chained hash of their tokens, LRU with a fixed capacity in blocks.

Pure logic. Blocks of one prompt are touched last-block-first, so within a prompt the
tail is evicted before the head (vLLM frees a request's blocks in reverse order for the
same reason): a longest-prefix match then loses as little as possible.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

import numpy as np
import xxhash

TOKEN_DTYPE = np.uint32


def chain_hashes(tokens: np.ndarray | Sequence[int], block_size: int,
                 salt: str = "") -> list[int]:
    """``h_i = xxh3_64(tokens of block i, seed=h_{i-1})`` over the full blocks, the chain
    seeded by the request's cache salt (as vLLM's ``cache_salt`` keys the first block:
    tenants never share engine blocks). Engine-internal (CPD's block identity is
    :mod:`cpd.protocol.hashing`); deterministic across runs."""
    arr = np.ascontiguousarray(tokens, dtype=TOKEN_DTYPE)
    out: list[int] = []
    h = xxhash.xxh3_64_intdigest(salt.encode()) if salt else 0
    for i in range(len(arr) // block_size):
        h = xxhash.xxh3_64_intdigest(arr[i * block_size:(i + 1) * block_size].tobytes(),
                                     seed=h)
        out.append(h)
    return out


class PrefixCache:
    """Which full blocks the engine holds, LRU over ``capacity_blocks``."""

    def __init__(self, capacity_blocks: int) -> None:
        if capacity_blocks < 0:
            raise ValueError("capacity must be >= 0")
        self.capacity_blocks = capacity_blocks
        self._lru: OrderedDict[int, None] = OrderedDict()
        self.evictions = 0

    def __len__(self) -> int:
        return len(self._lru)

    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self._lru

    def match(self, hashes: Sequence[int]) -> int:
        """Number of leading blocks held (and refresh them)."""
        n = 0
        for h in hashes:
            if h not in self._lru:
                break
            n += 1
        self._touch(hashes[:n])
        return n

    def insert(self, hashes: Sequence[int]) -> list[int]:
        """Hold these blocks (a prompt's first blocks, in order), evicting LRU ones;
        returns the evicted hashes (what the engine reports as removed)."""
        if self.capacity_blocks == 0:
            return []
        self._touch(hashes[-self.capacity_blocks:])
        evicted = []
        while len(self._lru) > self.capacity_blocks:
            evicted.append(self._lru.popitem(last=False)[0])
        self.evictions += len(evicted)
        return evicted

    def clear(self) -> None:
        self._lru.clear()

    def _touch(self, hashes: Sequence[int]) -> None:
        for h in reversed(hashes):
            self._lru[h] = None
            self._lru.move_to_end(h)
