"""``BlockHasher.hashes``, block hashes through a prefix memo: always exactly
``block_hashes``, whatever it reuses."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cpd.ops.config import load_settings
from cpd.protocol import hashing, wire
from cpd.protocol.hashing import BlockHasher, Namespace, block_hashes
from cpd.protocol.wire import HASH_BYTES
from services.router import RouterService

pytestmark = pytest.mark.timeout(60)

BS = 4
NS = Namespace(model_id="cpd-tiny", model_revision="r1", tokenizer_hash="abc",
               kv_dtype="float32", block_size=BS)
# Same tokens, other namespaces: a tenant's salt, and another block size.
NAMESPACES = [NS, NS.with_salt("t1"), msgspec.structs.replace(NS, block_size=3)]
BIG = 1 << 20
# A tiny alphabet makes equal blocks in different places (and so shared checkpoint
# fingerprints over different prefixes) common.
ALPHABET = 3


def _tokens(rng: np.random.Generator, n: int) -> np.ndarray:
    return rng.integers(0, ALPHABET, size=n, dtype=np.uint32)


def _check(memo: BlockHasher, ns: Namespace, tokens: np.ndarray) -> bytes:
    got = memo.hashes(ns, tokens)
    assert got == block_hashes(ns, tokens)
    return got


# ----------------------------------------------------------------------- table

T = np.arange(40 * BS, dtype=np.uint32)
T_AT_2, T_AT_6 = T.copy(), T.copy()
T_AT_2[2 * BS] += 1  # block 2 differs
T_AT_6[6 * BS + 2] += 1  # block 6 differs, mid-block
ONE = 10 * BS * 4 + 10 * HASH_BYTES  # the stored bytes of T[:10 * BS]


@pytest.mark.parametrize("max_bytes, earlier, ns, prompt, reused, computed", [
    pytest.param(BIG, [], NS, T[:10 * BS], 0, 10, id="cold"),
    pytest.param(BIG, [(NS, T[:10 * BS + 1])], NS, T[:16 * BS], 10, 6, id="next turn"),
    pytest.param(BIG, [(NS, T[:10 * BS])], NS, T[:10 * BS], 10, 0, id="same prompt"),
    pytest.param(BIG, [(NS, T[:10 * BS])], NS, T[:4 * BS + 3], 4, 0, id="prefix of stored"),
    pytest.param(BIG, [(NS, T[:10 * BS])], NS, T_AT_6[:10 * BS], 6, 4, id="diverges mid-block"),
    pytest.param(BIG, [(NS, T_AT_6[:12 * BS]), (NS, T_AT_2[:12 * BS])], NS, T[:12 * BS], 6, 6,
                 id="longest of two, not the newest"),
    pytest.param(BIG, [(NAMESPACES[1], T[:10 * BS])], NS, T[:10 * BS], 0, 10,
                 id="other namespace"),
    pytest.param(BIG, [(NS, T[:10 * BS])], NS, T[:12 * BS].tobytes(), 10, 2, id="wire bytes"),
    pytest.param(BIG, [(NS, T[:10 * BS])], NS, T[:BS - 1], 0, 0, id="under one block"),
    pytest.param(ONE - 1, [(NS, T[:10 * BS])], NS, T[:10 * BS], 0, 10, id="over budget"),
    pytest.param(0, [(NS, T[:10 * BS])], NS, T[:10 * BS], 0, 10, id="off"),
])
def test_hashes_reuses_the_longest_stored_prefix(
        max_bytes: int, earlier: list[tuple[Namespace, np.ndarray]], ns: Namespace,
        prompt: np.ndarray | bytes, reused: int, computed: int) -> None:
    hasher = BlockHasher(max_bytes)
    for ens, tokens in earlier:
        _check(hasher, ens, tokens)
    before = (hasher.blocks_reused, hasher.blocks_computed)
    assert hasher.hashes(ns, prompt) == block_hashes(ns, prompt)
    assert (hasher.blocks_reused - before[0], hasher.blocks_computed - before[1]) == (
        reused, computed)


# ------------------------------------------------------------------------ unit


def test_a_next_turn_reuses_the_previous_turn_and_replaces_it() -> None:
    rng = np.random.default_rng(1)
    t = rng.integers(0, 1000, size=40 * BS + 2, dtype=np.uint32)
    memo = BlockHasher(BIG)
    _check(memo, NS, t[:20 * BS + 1])
    assert (memo.hits, memo.misses, memo.blocks_reused, memo.blocks_computed) == (0, 1, 0, 20)
    _check(memo, NS, t[:30 * BS])
    assert (memo.hits, memo.blocks_reused, memo.blocks_computed) == (1, 20, 30)
    _check(memo, NS, t)
    assert (memo.hits, memo.blocks_reused, memo.blocks_computed) == (2, 50, 40)
    assert len(memo) == 1  # each turn replaced the one it extends


def test_a_prefix_of_a_stored_prompt_is_all_reused_and_not_stored_again() -> None:
    t = np.arange(10 * BS, dtype=np.uint32)
    memo = BlockHasher(BIG)
    _check(memo, NS, t)
    stored = memo.stored_bytes
    _check(memo, NS, t[:5 * BS + 3])
    _check(memo, NS, t)
    assert (memo.blocks_reused, memo.blocks_computed) == (15, 10)
    assert (len(memo), memo.stored_bytes) == (1, stored)


def test_a_divergence_inside_a_block_reuses_only_the_blocks_before_it() -> None:
    a = np.arange(10 * BS, dtype=np.uint32)
    b = a.copy()
    b[6 * BS + 2] += 1  # block 6 differs, mid-block
    memo = BlockHasher(BIG)
    _check(memo, NS, a)
    _check(memo, NS, b)
    assert (memo.blocks_reused, memo.blocks_computed) == (6, 14)
    assert len(memo) == 2  # a branch, not a continuation: both stay


def test_prompts_shorter_than_a_block_are_hashed_to_nothing_and_not_stored() -> None:
    memo = BlockHasher(BIG)
    for n in range(BS):
        assert memo.hashes(NS, np.arange(n, dtype=np.uint32)) == b""
    assert (len(memo), memo.hits, memo.misses, memo.blocks_computed) == (0, 0, 0, 0)


def test_zero_bytes_disables_it() -> None:
    t = np.arange(8 * BS, dtype=np.uint32)
    memo = BlockHasher(0)
    _check(memo, NS, t)
    _check(memo, NS, t)
    assert (len(memo), memo.stored_bytes, memo.hits, memo.misses) == (0, 0, 0, 2)
    assert (memo.blocks_reused, memo.blocks_computed) == (0, 16)
    with pytest.raises(ValueError):
        BlockHasher(-1)


def test_the_byte_budget_evicts_the_least_recently_used_prompt() -> None:
    rng = np.random.default_rng(2)
    a, b, c = (rng.integers(0, 1000, size=8 * BS, dtype=np.uint32) for _ in range(3))
    one = 8 * BS * 4 + 8 * HASH_BYTES  # a stored prompt's token and hash bytes
    memo = BlockHasher(2 * one)
    _check(memo, NS, a)
    _check(memo, NS, b)
    _check(memo, NS, a)  # a is now more recent than b
    _check(memo, NS, c)  # evicts b
    assert (len(memo), memo.stored_bytes) == (2, 2 * one)
    reused = memo.blocks_reused
    _check(memo, NS, a)
    assert memo.blocks_reused == reused + 8
    _check(memo, NS, b)
    assert memo.blocks_reused == reused + 8  # b was gone: recomputed
    too_big = BlockHasher(one - 1)
    _check(too_big, NS, a)
    assert len(too_big) == 0


def test_namespaces_never_share_entries() -> None:
    t = np.arange(12 * BS, dtype=np.uint32)
    memo = BlockHasher(BIG)
    got = [_check(memo, ns, t) for ns in NAMESPACES]
    assert len(set(got)) == len(NAMESPACES)
    assert (memo.hits, memo.misses, memo.blocks_reused) == (0, len(NAMESPACES), 0)
    assert [_check(memo, ns, t) for ns in NAMESPACES] == got
    assert memo.hits == len(NAMESPACES)


def test_a_fingerprint_collision_still_gives_exact_hashes(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(hashing, "_fingerprint", lambda block: 0)
    rng = np.random.default_rng(3)
    memo = BlockHasher(BIG)
    prompts = [rng.integers(0, 1000, size=int(rng.integers(BS, 30 * BS)), dtype=np.uint32)
               for _ in range(20)]
    for p in prompts:
        _check(memo, NS, p)
    # Every prompt shares every checkpoint key, yet none shares a first block.
    assert memo.blocks_reused == 0
    for p in prompts[::-1]:
        _check(memo, NS, p)
        _check(memo, NS, np.concatenate([p, _tokens(rng, 5 * BS)]))


def test_sessions_sharing_a_system_prompt_each_find_their_own_previous_turn() -> None:
    rng = np.random.default_rng(4)
    system = rng.integers(0, 1000, size=16 * BS, dtype=np.uint32)
    sessions = [np.concatenate([system, rng.integers(0, 1000, size=200 * BS,
                                                     dtype=np.uint32)])
                for _ in range(4 * hashing._CANDIDATES_PER_CHECKPOINT)]
    memo = BlockHasher(BIG)
    for s in sessions:
        _check(memo, NS, s[:100 * BS])
    reused = memo.blocks_reused
    for s in sessions:  # each next turn adds 10 blocks
        _check(memo, NS, s[:110 * BS])
    assert memo.blocks_reused - reused == 100 * len(sessions)


def test_a_callers_array_changed_afterwards_does_not_change_what_was_stored() -> None:
    t = np.arange(6 * BS, dtype=np.uint32)
    memo = BlockHasher(BIG)
    _check(memo, NS, t)
    t[0] += 1
    _check(memo, NS, t)
    buf = bytearray(t.tobytes())
    memo.hashes(NS, buf)
    buf[0] ^= 1
    assert memo.hashes(NS, buf) == block_hashes(NS, bytes(buf))


def test_every_input_form_and_error_matches_block_hashes() -> None:
    t = list(range(7 * BS + 1))
    memo = BlockHasher(BIG)
    want = block_hashes(NS, t)
    packed = np.asarray(t, dtype="<u4").tobytes()
    for form in (t, np.asarray(t, dtype=np.int64), np.asarray(t, dtype=">u4"), packed,
                 wire.unpack_tokens(packed), memoryview(packed)):
        assert memo.hashes(NS, form) == want
    for bad in ([-1] * BS, [2**32] * BS, b"\0" * 5):
        with pytest.raises(ValueError):
            block_hashes(NS, bad)
        with pytest.raises(ValueError):
            memo.hashes(NS, bad)


def test_the_router_hashes_through_its_memo() -> None:
    t = np.arange(300 * 256, dtype=np.uint32)
    router = RouterService(load_settings(environ={}))
    assert router.hash_memo.max_bytes == 64 * 2**20
    ns = msgspec.structs.replace(NS, block_size=256)
    assert router._hashes(ns, t[:200 * 256]) == block_hashes(ns, t[:200 * 256])
    assert router._hashes(ns, t) == block_hashes(ns, t)
    assert router.hash_memo.blocks_reused == 200
    off = RouterService(load_settings(environ={}, overrides=["router.hash_memo_bytes=0"]))
    assert off._hashes(ns, t) == block_hashes(ns, t)
    assert (off.hash_memo.blocks_reused, len(off.hash_memo)) == (0, 0)


# -------------------------------------------------------------------- property

# One step: which earlier prompt to start from (or none), where to cut it (any token,
# so mid-block too), how many new tokens to append, and in which namespace.
steps_st = st.lists(
    st.tuples(st.integers(0, 30), st.integers(0, 40 * BS), st.integers(0, 12 * BS),
              st.integers(0, len(NAMESPACES) - 1), st.sampled_from(["array", "bytes",
                                                                    "view", "list"])),
    min_size=1, max_size=40)


@settings(max_examples=300, deadline=None)
@given(steps_st, st.sampled_from([0, 1, 40, 200, 600, BIG]), st.booleans(),
       st.integers(0, 2**32 - 1))
def test_memo_always_equals_block_hashes(steps: list[tuple[int, int, int, int, str]],
                                         max_bytes: int, collide: bool, seed: int) -> None:
    rng = np.random.default_rng(seed)
    memo = BlockHasher(max_bytes)
    seen: list[np.ndarray] = []
    total = 0
    original = hashing._fingerprint
    if collide:
        hashing._fingerprint = lambda block: 0  # every checkpoint of a depth collides
    try:
        for pick, cut, grow, nsi, form in steps:
            base = seen[pick % len(seen)] if seen and pick else np.zeros(0, np.uint32)
            # Extension (cut past the end), divergence at any point, or a shorter prefix.
            t = np.concatenate([base[:cut], _tokens(rng, grow)])
            ns = NAMESPACES[nsi]
            arg: object = {"array": t, "bytes": t.tobytes(), "list": t.tolist(),
                           "view": wire.unpack_tokens(t.tobytes())}[form]
            got = memo.hashes(ns, arg)  # type: ignore[arg-type]
            assert got == block_hashes(ns, t)
            total += len(got) // HASH_BYTES
            seen.append(t)
            assert memo.stored_bytes <= max_bytes
            assert memo.blocks_reused + memo.blocks_computed == total
    finally:
        hashing._fingerprint = original
