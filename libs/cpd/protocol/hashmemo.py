"""An exact memo of recent prompts' block hashes, so a router re-hashes only what is new.

Multi-turn chat and coding agents resend the previous prompt plus a little more each
turn. The chained hash of block ``i`` depends only on the tokens of blocks ``0..i``
(docs/architecture.md, "Block identity"), so the hashes of the blocks a prompt shares with
one hashed before are the stored ones, and the rest continue the chain from the last of them
(``block_hashes(..., parent=)``).

Exactness rests on comparing token bytes, never on a fingerprint: a fingerprint only
picks which stored prompts to compare with; equal bytes decide what is reused.

Stored prompts are found through *checkpoints*: a prompt of ``n`` full blocks is filed
under the fingerprint of its block ``d - 1`` for every depth ``d`` in 1, 2, 4, ... <= n
(depth 1 is its first block). A lookup walks its own checkpoints deepest first, so
sessions that share only a long system prompt (one first block, many sessions) still
find their own previous turn at a deep checkpoint among a few candidates, instead of
among every session filed under the same first block.

Pure logic, no I/O, not thread-safe (one router event loop calls it).
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import xxhash

from cpd.protocol.hashing import ROOT_PARENT, Namespace, as_u32_bytes, block_hashes
from cpd.protocol.wire import HASH_BYTES, TOKEN_DTYPE

# Stored prompts compared per checkpoint, most recently used first: bounds the work of a
# lookup when many stored prompts share a checkpoint block.
_CANDIDATES_PER_CHECKPOINT = 8
# Blocks compared in the first step of a common-prefix search; each later step doubles,
# so a prompt that diverges early costs little and a long match costs a few numpy calls.
_FIRST_SEARCH_BLOCKS = 8


def _fingerprint(block: bytes) -> int:
    """Cheap 64-bit fingerprint of one block's token bytes (only picks candidates)."""
    return xxhash.xxh3_64_intdigest(block)


@dataclass(eq=False)
class _Entry:
    """One stored prompt: its token bytes and its full blocks' hashes."""

    eid: int  # its id in the LRU and the checkpoint tables
    ns: Namespace
    data: bytes  # packed uint32 tokens (a trailing partial block is never compared)
    hashes: bytes  # block_hashes(ns, data)
    keys: list[tuple[int, int]]  # its checkpoints: (depth, fingerprint)

    @property
    def nbytes(self) -> int:
        return len(self.data) + len(self.hashes)


class PrefixHashMemo:
    """Bounded LRU of recent prompts per namespace, returning exactly
    :func:`cpd.protocol.hashing.block_hashes` while re-hashing only blocks not seen before.

    ``max_bytes`` bounds the stored token and hash bytes; 0 disables the memo (every
    call hashes everything). Counters (plain ints) say how much it saved: ``hits`` and
    ``misses`` are calls with at least one full block that did / did not reuse a block;
    ``blocks_reused`` and ``blocks_computed`` count blocks.
    """

    def __init__(self, max_bytes: int) -> None:
        if max_bytes < 0:
            raise ValueError("max_bytes must be >= 0")
        self.max_bytes = max_bytes
        self.hits = 0
        self.misses = 0
        self.blocks_reused = 0
        self.blocks_computed = 0
        self._bytes = 0
        self._ids = itertools.count()
        # Every stored prompt, least recently used first: eviction order.
        self._lru: OrderedDict[int, _Entry] = OrderedDict()
        # Per namespace, checkpoint -> ids filed there, least recently used first. A
        # namespace is its own table, so no two namespaces ever meet in a lookup.
        self._tables: dict[Namespace, dict[tuple[int, int], OrderedDict[int, None]]] = {}

    @property
    def stored_bytes(self) -> int:
        """Token and hash bytes held now (at most ``max_bytes``)."""
        return self._bytes

    def __len__(self) -> int:
        return len(self._lru)

    def hashes(self, ns: Namespace, tokens: np.ndarray | list[int] | bytes) -> bytes:
        """``block_hashes(ns, tokens)``, reusing the hashes of the longest run of leading
        full blocks this memo has seen with identical tokens in the same namespace."""
        if not self.max_bytes:
            out = block_hashes(ns, tokens)
            if out:
                self.misses += 1
                self.blocks_computed += len(out) // HASH_BYTES
            return out
        data = _token_bytes(tokens)
        step = ns.block_size * TOKEN_DTYPE.itemsize
        n = len(data) // step
        if n == 0:
            return b""
        keys = [(d, _fingerprint(data[(d - 1) * step:d * step])) for d in _depths(n)]
        table = self._tables.get(ns)
        best, k = self._longest(table, keys, data, step, n) if table else (None, 0)
        if best is not None and k:
            self.hits += 1
            prefix = best.hashes[:k * HASH_BYTES]
            out = prefix + block_hashes(ns, memoryview(data)[k * step:],
                                        parent=prefix[-HASH_BYTES:])
        else:
            self.misses += 1
            out = block_hashes(ns, data, parent=ROOT_PARENT)
        self.blocks_reused += k
        self.blocks_computed += n - k
        self._remember(ns, data, out, keys, best, k, n)
        return out

    # ------------------------------------------------------------------ internals

    def _longest(self, table: dict[tuple[int, int], OrderedDict[int, None]],
                 keys: list[tuple[int, int]], data: bytes, step: int,
                 n: int) -> tuple[_Entry | None, int]:
        """The stored prompt sharing the most leading full blocks with ``data``, and
        how many it shares."""
        best: _Entry | None = None
        best_k = 0
        seen: set[int] = set()
        for depth, fp in reversed(keys):
            ids = table.get((depth, fp))
            for eid in itertools.islice(reversed(ids or ()), _CANDIDATES_PER_CHECKPOINT):
                if eid in seen:
                    continue
                seen.add(eid)
                e = self._lru[eid]
                m = min(n, len(e.data) // step)
                if m <= best_k:
                    continue
                # It can only do better if it also matches the block after the best
                # run: one 1 KiB compare rules out most rivals of a long match.
                at = best_k * step
                if best_k and data[at:at + step] != e.data[at:at + step]:
                    continue
                k = _common_blocks(data, e.data, m, step)
                if k > best_k:
                    best, best_k = e, k
            # A prompt not yet compared shares fewer than `depth` blocks (it would be
            # filed at this checkpoint otherwise): nothing shallower can beat best_k.
            if best_k >= depth:
                break
        return best, best_k

    def _remember(self, ns: Namespace, data: bytes, hashes: bytes,
                  keys: list[tuple[int, int]], best: _Entry | None, k: int, n: int) -> None:
        """Store the prompt just hashed, most recently used."""
        if best is not None and k == n:
            # Nothing new: a stored prompt already holds all of it.
            self._touch(best)
            return
        if best is not None and k == len(best.data) // (ns.block_size * TOKEN_DTYPE.itemsize):
            # The new prompt extends a stored one (the next turn): it replaces it.
            self._drop(best)
        entry = _Entry(next(self._ids), ns, data, hashes, keys)
        if entry.nbytes > self.max_bytes:
            return
        eid = entry.eid
        self._lru[eid] = entry
        self._bytes += entry.nbytes
        table = self._tables.setdefault(ns, {})
        for key in keys:
            table.setdefault(key, OrderedDict())[eid] = None
        while self._bytes > self.max_bytes:
            self._drop(next(iter(self._lru.values())))

    def _touch(self, entry: _Entry) -> None:
        self._lru.move_to_end(entry.eid)
        table = self._tables[entry.ns]
        for key in entry.keys:
            table[key].move_to_end(entry.eid)

    def _drop(self, entry: _Entry) -> None:
        eid = entry.eid
        del self._lru[eid]
        self._bytes -= entry.nbytes
        table = self._tables[entry.ns]
        for key in entry.keys:
            ids = table[key]
            del ids[eid]
            if not ids:
                del table[key]
        if not table:
            del self._tables[entry.ns]


def _depths(n: int) -> list[int]:
    """Checkpoint depths of a prompt of ``n`` full blocks: 1, 2, 4, ... <= n."""
    return [1 << i for i in range(n.bit_length())]


def _common_blocks(a: bytes, b: bytes, m: int, step: int) -> int:
    """How many of the first ``m`` full blocks of ``a`` and ``b`` are equal, token bytes
    compared row by row in growing windows (an early divergence is found early)."""
    if a.startswith(memoryview(b)[:m * step]):  # one memcmp, no copy: the usual case
        return m
    width = step // TOKEN_DTYPE.itemsize
    ra = np.frombuffer(a, dtype=TOKEN_DTYPE, count=m * width).reshape(m, width)
    rb = np.frombuffer(b, dtype=TOKEN_DTYPE, count=m * width).reshape(m, width)
    lo, size = 0, _FIRST_SEARCH_BLOCKS
    while lo < m:
        hi = min(m, lo + size)
        differs = (ra[lo:hi] != rb[lo:hi]).any(axis=1)
        if differs.any():
            return lo + int(differs.argmax())
        lo, size = hi, size * 2
    return m


def _token_bytes(tokens: np.ndarray | list[int] | bytes) -> bytes:
    """The tokens as immutable little-endian uint32 bytes, validated by
    :func:`cpd.protocol.hashing.as_u32_bytes` (the same errors as :func:`block_hashes`).

    An array that is a read-only view of a whole ``bytes`` object (what
    ``wire.unpack_tokens`` gives the router) is used without a copy: those bytes can
    never change, so they can be stored as they are."""
    if not isinstance(tokens, (bytes, bytearray, memoryview)):
        arr = np.asarray(tokens)
        base = arr.base
        if (arr.dtype == TOKEN_DTYPE and isinstance(base, bytes) and arr.ndim == 1
                and arr.flags.c_contiguous and arr.nbytes == len(base)):
            return base
    data = as_u32_bytes(tokens)
    # A copy unless already bytes: the caller may still change a buffer it passed.
    return data if isinstance(data, bytes) else bytes(data)
