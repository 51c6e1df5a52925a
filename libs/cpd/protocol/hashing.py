"""Block identity (docs/architecture.md, "Block identity"): namespaces and chained, keyed block
hashes.

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
per block from Python. The pure-Python loop below gives the same bytes; it runs only
where the extension was not built (:data:`NATIVE` says which one is in use).
"""

from __future__ import annotations

import functools
from typing import Annotated

import blake3
import msgspec
import numpy as np

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


class Namespace(msgspec.Struct, frozen=True, kw_only=True):
    """Everything that must match for two KV blocks to be interchangeable."""

    model_id: str
    model_revision: str
    tokenizer_hash: str
    kv_dtype: str
    block_size: Annotated[int, msgspec.Meta(gt=0)]
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


def block_hashes(ns: Namespace, tokens: np.ndarray | list[int] | bytes,
                 parent: bytes = ROOT_PARENT) -> bytes:
    """Chained hashes of every *full* block of ``tokens``, concatenated (n * 16 bytes).

    ``tokens`` may be an int sequence, a numpy array, or packed little-endian uint32
    bytes (the wire form). ``parent`` continues an existing chain. A trailing partial
    block is not hashed: it is never shared.
    """
    if len(parent) != HASH_BYTES:
        raise ValueError(f"parent must be {HASH_BYTES} bytes")
    data = as_u32_bytes(tokens)
    step = ns.block_size * TOKEN_DTYPE.itemsize
    if len(data) < step:
        return b""
    if _hashchain is not None:
        return _hashchain.chain(ns.key, data, step, parent)
    return python_chain(ns.key, data, step, parent)


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


def as_u32_bytes(tokens: np.ndarray | list[int] | bytes) -> bytes | memoryview:
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
