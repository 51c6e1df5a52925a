"""Block identity (docs/architecture.md, "Block identity"): namespaces and chained, keyed block
hashes, computed once per prompt with :func:`block_hashes` or, reusing the hashes of a prefix
hashed before (a chat's previous turn), with :meth:`BlockHasher.hashes`.

``h_i = BLAKE3_keyed(key = K(namespace), tokens of block i || h_{i-1})`` over *full*
blocks only, truncated to 128 bits (``h_{-1}`` is :data:`ROOT_PARENT`). The key is derived
from every field of the namespace, so blocks of different models, tokenizers, KV layouts,
adapters or tenants can never collide or match, and nothing depends on
``PYTHONHASHSEED`` or engine internals: the router computes the same hashes from token
ids alone.

The tokens come first so that, with 256-token blocks, a block's tokens are exactly one
BLAKE3 chunk whose value does not depend on the parent: the native extension
``cpd._hashchain`` (``native/hashchain.c``) computes those for many blocks at once with
BLAKE3's SIMD and chains only two compressions per block, ~7x faster than a keyed call
per block from Python. The pure-Python loop (:func:`python_chain`) gives the same bytes;
it runs only where the extension was not built (:data:`NATIVE` says which one is in use).

Hash ``i`` depends only on the tokens of blocks ``0..i``, so a prompt that starts with
the full blocks of one hashed before shares their hashes, and the chain continues from
the last of them. :class:`BlockHasher` keeps recent prompts for that, exactly: a
fingerprint only picks which stored prompts to compare with; equal token bytes decide
what is reused. Stored prompts are found through *checkpoints*: a prompt of ``n`` full
blocks is filed under the fingerprint of its block ``d - 1`` for every depth ``d`` in 1,
2, 4, ... <= n. A lookup walks its own checkpoints deepest first, so sessions that share
only a long system prompt (one first block, many sessions) still find their own previous
turn at a deep checkpoint among a few candidates.
"""

from __future__ import annotations

import functools
import itertools
from collections import OrderedDict
from dataclasses import dataclass
from typing import Annotated

import blake3
import msgspec
import numpy as np
import xxhash

from cpd.protocol.wire import HASH_BYTES, TOKEN_DTYPE

try:
    from cpd import _hashchain
except ImportError:  # a source tree used without `pip install -e .`: same hashes, slower
    _hashchain = None

NATIVE: bool = _hashchain is not None
"""Whether block hashes come from the native extension (the pure-Python loop otherwise)."""

_KEY_CONTEXT = "cpd.v1 2026-11 block-hash namespace key"
_ID_CONTEXT = "cpd.v1 2026-11 namespace id"
ROOT_PARENT = bytes(HASH_BYTES)
"""The parent hash fed to the first block of every chain."""

Tokens = np.ndarray | list[int] | bytes | bytearray | memoryview
"""Token ids as any int sequence or numpy array, or packed little-endian uint32 bytes."""

# Stored prompts compared per checkpoint, most recently used first: bounds the work of a
# lookup when many stored prompts share a checkpoint block.
_CANDIDATES_PER_CHECKPOINT = 8
# Blocks compared in the first step of a common-prefix search; each later step doubles,
# so a prompt that diverges early costs little and a long match costs a few numpy calls.
_FIRST_SEARCH_BLOCKS = 8


class Namespace(msgspec.Struct, frozen=True, kw_only=True):
    """Everything that must match for two KV blocks to be interchangeable."""

    model_id: str
    model_revision: str
    tokenizer_hash: str
    kv_dtype: str
    block_size: Annotated[int, msgspec.Meta(gt=0)]
    # The layout of a block's bytes: always a single-rank engine's, whatever the ranks of
    # the engine that computed it (each rank copies its share: cpd.engines.vllm.kv_layout).
    parallel_layout: str = "tp1-pp1"
    adapter_id: str = ""
    tenant_salt: str = ""

    def with_salt(self, tenant: str, cache_salt: str = "") -> Namespace:
        """The namespace of one tenant (and optional per-request cache salt).

        The salt is length-prefixed, so it is never empty (no tenant, not even ``""``,
        shares the unsalted base namespace) and no two (tenant, cache_salt) pairs share
        one (a separator character inside a tenant name cannot forge another pair). A
        deployment salt on the base (``cache.tenant_salt``) stays in front, length-
        prefixed too, so tenants of differently salted deployments never meet."""
        salt = f"{len(tenant)}:{tenant}{cache_salt}"
        if self.tenant_salt:
            salt = f"{len(self.tenant_salt)}:{self.tenant_salt}|{salt}"
        return msgspec.structs.replace(self, tenant_salt=salt)

    def to_spec(self) -> bytes:
        """Wire form (msgpack) of this namespace, e.g. for ``Heartbeat.namespace_spec``."""
        return msgspec.msgpack.encode(self)

    @classmethod
    def from_spec(cls, data: bytes) -> Namespace:
        """Parse :meth:`to_spec` output; raises ``msgspec.ValidationError``/``DecodeError``."""
        return msgspec.msgpack.decode(data, type=cls)

    @property
    def id(self) -> str:
        """Stable 32-hex-digit id, used on the wire and in kvindex."""
        return _namespace_id(self)

    @property
    def key(self) -> bytes:
        """32-byte BLAKE3 key of this namespace's block hashes."""
        return _namespace_key(self)


def _canonical(ns: Namespace) -> bytes:
    # msgpack of a fixed field order: stable across processes and versions of this code.
    return msgspec.msgpack.encode(msgspec.structs.astuple(ns))


@functools.lru_cache(maxsize=4096)
def _namespace_key(ns: Namespace) -> bytes:
    return blake3.blake3(_canonical(ns), derive_key_context=_KEY_CONTEXT).digest()


@functools.lru_cache(maxsize=4096)
def _namespace_id(ns: Namespace) -> str:
    return blake3.blake3(_canonical(ns), derive_key_context=_ID_CONTEXT).hexdigest(HASH_BYTES)


def block_hashes(ns: Namespace, tokens: Tokens, parent: bytes = ROOT_PARENT) -> bytes:
    """Chained hashes of every *full* block of ``tokens``, concatenated (n * 16 bytes),
    for callers that hash a prompt once (:class:`BlockHasher` reuses earlier prompts').

    ``tokens`` may be an int sequence, a numpy array, or packed little-endian uint32
    bytes (the wire form). ``parent`` continues an existing chain. A trailing partial
    block is not hashed: it is never shared.
    """
    if len(parent) != HASH_BYTES:
        raise ValueError(f"parent must be {HASH_BYTES} bytes")
    return _chain(ns.key, as_u32_bytes(tokens), ns.block_size * TOKEN_DTYPE.itemsize, parent)


class BlockHasher:
    """:func:`block_hashes` of any namespace's prompts, re-hashing only blocks not seen
    before: a bounded LRU of recent prompts per namespace (not thread-safe; one router
    event loop calls it).

    ``max_bytes`` bounds the stored token and hash bytes; 0 stores nothing (every call
    hashes everything). Counters (plain ints) say how much it saved: ``hits`` and
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

    def hashes(self, ns: Namespace, tokens: Tokens) -> bytes:
        """``block_hashes(ns, tokens)``: the stored hashes of the longest run of leading
        full blocks seen before with identical tokens in ``ns``, then the chain over the
        rest from the last of them; the prompt is stored for later calls."""
        if not self.max_bytes:  # nothing stored, so nothing to look up or copy
            out = block_hashes(ns, tokens)
            self._count(len(out) // HASH_BYTES, 0)
            return out
        data = _token_bytes(tokens)
        step = ns.block_size * TOKEN_DTYPE.itemsize
        n = len(data) // step
        if n == 0:
            return b""
        keys = _checkpoints(data, step, n)
        best, k = self._longest(ns, keys, data, step, n)
        prefix = best.hashes[:k * HASH_BYTES] if best is not None else b""
        out = prefix + _chain(ns.key, memoryview(data)[k * step:], step,
                              prefix[-HASH_BYTES:] or ROOT_PARENT)
        self._count(n, k)
        self._remember(ns, data, out, keys, best, k, n)
        return out

    # ------------------------------------------------------------------ internals

    def _count(self, n: int, reused: int) -> None:
        """Count a call of ``n`` full blocks whose first ``reused`` were stored."""
        if reused:
            self.hits += 1
        elif n:
            self.misses += 1
        self.blocks_reused += reused
        self.blocks_computed += n - reused

    def _longest(self, ns: Namespace, keys: list[tuple[int, int]], data: bytes, step: int,
                 n: int) -> tuple[_Entry | None, int]:
        """The stored prompt sharing the most leading full blocks with ``data``, and
        how many it shares."""
        table = self._tables.get(ns)
        if not table:  # nothing stored in this namespace yet
            return None, 0
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
        if best is not None and k == len(best.hashes) // HASH_BYTES:
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


def _chain(key: bytes, data: bytes | memoryview, step: int, parent: bytes) -> bytes:
    """The chain over every full ``step``-byte block of ``data`` from ``parent``: the
    native extension's, else :func:`python_chain`'s."""
    if len(data) < step:
        return b""
    if _hashchain is not None:
        return _hashchain.chain(key, data, step, parent)
    return python_chain(key, data, step, parent)


def python_chain(key: bytes, data: bytes | memoryview, step: int, parent: bytes) -> bytes:
    """The chain of :func:`block_hashes` over packed ``data`` in blocks of ``step``
    bytes, one keyed BLAKE3 call per block: the fallback where the extension is not
    built, and the reference it must match byte for byte (tests, ``cpd bench hashing``)."""
    base = blake3.blake3(key=key)
    view = memoryview(data)
    n = len(data) // step
    out = bytearray(n * HASH_BYTES)
    prev = parent
    for i in range(n):
        h = base.copy()
        h.update(view[i * step:(i + 1) * step])
        h.update(prev)
        prev = h.digest(HASH_BYTES)
        out[i * HASH_BYTES:(i + 1) * HASH_BYTES] = prev
    return bytes(out)


def num_full_blocks(num_tokens: int, block_size: int) -> int:
    """How many full blocks ``num_tokens`` tokens make."""
    return num_tokens // block_size


def as_u32_bytes(tokens: Tokens) -> bytes | bytearray | memoryview:
    """``tokens`` as packed little-endian uint32 bytes (bytes-like input as it is), with
    the checks every hashing entry point applies (a multiple of 4 bytes; ids in uint32)."""
    if isinstance(tokens, (bytes, bytearray, memoryview)):
        if len(tokens) % TOKEN_DTYPE.itemsize:
            raise ValueError("packed tokens must be a multiple of 4 bytes")
        return tokens
    arr = np.asarray(tokens)
    if arr.dtype != TOKEN_DTYPE:
        if arr.size and (arr.min() < 0 or arr.max() > 0xFFFFFFFF):
            raise ValueError("token ids must fit in uint32")
        arr = arr.astype(TOKEN_DTYPE)
    return np.ascontiguousarray(arr).data.cast("B")


def _token_bytes(tokens: Tokens) -> bytes:
    """The tokens as immutable packed bytes, checked by :func:`as_u32_bytes`: a copy
    unless already ``bytes`` (the caller may change a buffer it passed after the call),
    or a read-only array over a whole ``bytes`` object (what ``wire.unpack_tokens``
    gives the router), whose bytes can never change."""
    if not isinstance(tokens, (bytes, bytearray, memoryview)):
        arr = np.asarray(tokens)
        base = arr.base
        if (arr.dtype == TOKEN_DTYPE and isinstance(base, bytes) and arr.ndim == 1
                and arr.flags.c_contiguous and arr.nbytes == len(base)):
            return base
    data = as_u32_bytes(tokens)
    return data if isinstance(data, bytes) else bytes(data)


def _fingerprint(block: bytes) -> int:
    """Cheap 64-bit fingerprint of one block's token bytes (only picks candidates)."""
    return xxhash.xxh3_64_intdigest(block)


def _checkpoints(data: bytes, step: int, n: int) -> list[tuple[int, int]]:
    """``(depth, fingerprint of block depth - 1)`` of a prompt of ``n`` full blocks, for
    every depth in 1, 2, 4, ... <= n."""
    return [(d, _fingerprint(data[(d - 1) * step:d * step]))
            for d in (1 << i for i in range(n.bit_length()))]


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
