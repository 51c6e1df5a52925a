"""Block identity: prefix property, namespace and tenant isolation, process independence."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import blake3
import msgspec
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cpd.protocol import hashing
from cpd.protocol.hashing import ROOT_PARENT, Namespace, block_hashes, num_full_blocks
from cpd.protocol.wire import HASH_BYTES

BS = 16
NS = Namespace(model_id="cpd-tiny", model_revision="r1", tokenizer_hash="abc",
               kv_dtype="float32", block_size=BS)

tokens_st = st.lists(st.integers(0, 2**32 - 1), min_size=0, max_size=8 * BS)


def _chunks(h: bytes) -> list[bytes]:
    return [h[i:i + HASH_BYTES] for i in range(0, len(h), HASH_BYTES)]


@settings(max_examples=300, deadline=None)
@given(tokens_st, st.integers(0, 8 * BS))
def test_prefix_property(tokens: list[int], cut: int) -> None:
    full = block_hashes(NS, tokens)
    prefix = block_hashes(NS, tokens[:cut])
    assert full.startswith(prefix)
    assert len(prefix) == num_full_blocks(min(cut, len(tokens)), BS) * HASH_BYTES


@settings(max_examples=200, deadline=None)
@given(tokens_st, tokens_st)
def test_different_block_contents_diverge_from_first_difference(a: list[int], b: list[int]) -> None:
    ha, hb = _chunks(block_hashes(NS, a)), _chunks(block_hashes(NS, b))
    for i, (x, y) in enumerate(zip(ha, hb, strict=False)):
        same_tokens = a[: (i + 1) * BS] == b[: (i + 1) * BS]
        assert (x == y) == same_tokens


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 50_000), min_size=BS, max_size=4 * BS),
       st.sampled_from(["model_id", "model_revision", "tokenizer_hash", "kv_dtype",
                        "parallel_layout", "adapter_id", "tenant_salt"]))
def test_any_namespace_field_changes_every_hash(tokens: list[int], field: str) -> None:
    other = msgspec.structs.replace(NS, **{field: getattr(NS, field) + "-x"})
    a, b = _chunks(block_hashes(NS, tokens)), _chunks(block_hashes(other, tokens))
    assert not set(a) & set(b)
    assert NS.id != other.id


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(0, 50_000), min_size=BS, max_size=4 * BS),
       st.text(min_size=1, max_size=8), st.text(min_size=1, max_size=8))
def test_tenants_never_share_blocks(tokens: list[int], t1: str, t2: str) -> None:
    a = block_hashes(NS.with_salt(t1), tokens)
    b = block_hashes(NS.with_salt(t2), tokens)
    assert (a == b) == (t1 == t2)
    assert block_hashes(NS.with_salt(t1, "s"), tokens) != a


def test_block_size_is_part_of_identity() -> None:
    tokens = list(range(64))
    assert block_hashes(NS, tokens)[:16] != block_hashes(
        msgspec.structs.replace(NS, block_size=32), tokens)[:16]


def test_input_forms_agree_and_partial_block_is_ignored() -> None:
    tokens = list(range(3 * BS + 5))
    h = block_hashes(NS, tokens)
    assert len(h) == 3 * HASH_BYTES
    assert h == block_hashes(NS, np.array(tokens, dtype=np.int64))
    assert h == block_hashes(NS, np.array(tokens, dtype="<u4").tobytes())
    assert block_hashes(NS, tokens[: BS - 1]) == b""


def test_chain_can_be_continued() -> None:
    tokens = list(range(4 * BS))
    whole = block_hashes(NS, tokens)
    first = block_hashes(NS, tokens[: 2 * BS])
    rest = block_hashes(NS, tokens[2 * BS:], parent=first[-HASH_BYTES:])
    assert first + rest == whole
    assert block_hashes(NS, tokens[:BS], parent=ROOT_PARENT) == whole[:HASH_BYTES]


def test_bad_tokens_are_rejected() -> None:
    with pytest.raises(ValueError):
        block_hashes(NS, [-1] * BS)
    with pytest.raises(ValueError):
        block_hashes(NS, b"\x00" * 5)


_SCRIPT = """
import json, sys
from cpd.protocol.hashing import Namespace, block_hashes
ns = Namespace(model_id="cpd-tiny", model_revision="r1", tokenizer_hash="abc",
               kv_dtype="float32", block_size=16)
print(json.dumps({"id": ns.id, "h": block_hashes(ns, list(range(100))).hex()}))
"""


def test_same_hashes_across_processes_with_different_hash_seeds() -> None:
    results = set()
    for seed in ("0", "1", "12345", "random"):
        out = subprocess.run([sys.executable, "-c", _SCRIPT], capture_output=True, text=True,
                             env={**os.environ, "PYTHONHASHSEED": seed}, check=True)
        results.add(out.stdout.strip())
    assert len(results) == 1
    here = {"id": NS.id, "h": block_hashes(NS, list(range(100))).hex()}
    assert json.loads(results.pop()) == here


def test_golden_vector() -> None:
    """Hashes are a wire contract: a change here invalidates every deployed cache."""
    assert NS.id == _GOLDEN_ID
    assert block_hashes(NS, list(range(2 * BS))).hex() == _GOLDEN_HASHES


_GOLDEN_ID = "15a3c1898a46125ece0ef847c2ea82cb"
_GOLDEN_HASHES = (
    "045a0895a5b8d92248ddc548cf368ce2"
    "ebdc9ad1fa514c700ccc2aa1fb2bc1c0"
)


def _definition(ns: Namespace, tokens: np.ndarray, parent: bytes = ROOT_PARENT) -> bytes:
    # docs/architecture.md, "Block identity" spelled out with the blake3 package: one keyed hash
    # per full block.
    data, step = tokens.astype("<u4").tobytes(), ns.block_size * 4
    out, prev = [], parent
    for i in range(len(data) // step):
        prev = blake3.blake3(data[i * step:(i + 1) * step] + prev, key=ns.key).digest(16)
        out.append(prev)
    return b"".join(out)


def test_the_native_extension_is_what_runs() -> None:
    """`pip install -e .` builds it; without it every router decision hashes ~7x slower."""
    assert hashing.NATIVE


# 256 tokens is the one-chunk SIMD path of the native code; the others its generic loop.
@settings(max_examples=60, deadline=None)
@given(st.sampled_from([1, 16, 100, 255, 256, 257, 512, 768, 1024]),
       st.integers(0, 70), st.integers(0, 300), st.binary(min_size=16, max_size=16),
       st.integers(0, 2**32 - 1))
def test_native_and_python_chains_match_the_definition(bs: int, nblocks: int, extra: int,
                                                       parent: bytes, seed: int) -> None:
    ns = msgspec.structs.replace(NS, block_size=bs)
    tokens = np.random.default_rng(seed).integers(0, 2**32, nblocks * bs + extra % bs,
                                                  dtype=np.uint64)
    want = _definition(ns, tokens, parent)
    assert block_hashes(ns, tokens, parent=parent) == want
    data = tokens.astype("<u4").tobytes()
    assert hashing.python_chain(ns.key, data, bs * 4, parent) == want


def test_long_prompts_hash_the_same_from_many_threads() -> None:
    """Inputs from 64 KiB up are hashed with the GIL released."""
    ns = msgspec.structs.replace(NS, block_size=256)
    prompts = [np.random.default_rng(i).integers(0, 50_000, 100_000, dtype=np.uint32)
               for i in range(4)]
    want = [_definition(ns, p) for p in prompts]
    with ThreadPoolExecutor(4) as pool:
        got = list(pool.map(lambda i: block_hashes(ns, prompts[i % 4]), range(64)))
    assert got == [want[i % 4] for i in range(64)]


def test_a_parent_of_the_wrong_size_is_rejected() -> None:
    with pytest.raises(ValueError, match="parent"):
        block_hashes(NS, list(range(BS)), parent=b"short")


@settings(max_examples=100, deadline=None)
@given(st.text(max_size=8), st.text(max_size=8), st.text(max_size=8))
def test_a_deployment_salt_keeps_its_tenants_apart(base: str, other: str, tenant: str) -> None:
    a = msgspec.structs.replace(NS, tenant_salt=base)
    b = msgspec.structs.replace(NS, tenant_salt=other)
    # Same tenant in two deployments: the same namespace only if the deployments match.
    assert (a.with_salt(tenant).id == b.with_salt(tenant).id) == (base == other)
    assert a.with_salt(tenant).id != a.id
