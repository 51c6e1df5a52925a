"""A decode arena's copies-first gate (cpd.kvstore.copiesgate), table-driven, and the
arena switching under it (BlockStore.set_copies_first)."""

from __future__ import annotations

import pytest

from cpd.kvstore import BlockStore, CopiesFirstGate
from cpd.protocol import wire


def _answers(mode: str, seen: list[tuple[tuple[str, int], ...]]) -> list[bool]:
    """The gate's answer at each hand-off; before each, the (replica, running count of
    missed blocks) that kvindex's notices carried."""
    gate, out = CopiesFirstGate(mode), []  # type: ignore[arg-type]
    for counts in seen:
        for replica, count in counts:
            gate.observe(replica, count)
        out.append(gate.handoff())
    return out


def _growing(per_handoff: int, handoffs: int) -> list[tuple[tuple[str, int], ...]]:
    return [(("k0", per_handoff * i),) for i in range(handoffs)]


# (case, mode, counts seen before each hand-off, the gate's answers). The mean moves by
# 5 % of each hand-off's misses. Copies first starts on and is tried off after 256 quiet
# hand-offs (mean below 0.5 block); a try ends when the mean passes 1 block.
GATE_CASES = [
    ("nothing missed: tried off", "adaptive", _growing(0, 300), [True] * 255 + [False] * 45),
    # A replica's first count is where it starts; then 50 missed per hand-off.
    ("a short pool: never quiet", "adaptive", _growing(50, 300), [True] * 300),
    # One block per hand-off keeps the mean above 0.5 from the 15th hand-off on.
    ("one per hand-off", "adaptive", _growing(1, 300), [True] * 300),
    # Two replicas with an eighth of a block each per hand-off: quiet (mean below 0.5).
    ("two quiet replicas", "adaptive",
     [(("k0", 100 + i // 8), ("k1", 7 + i // 8)) for i in range(300)],
     [True] * 255 + [False] * 45),
    # Two replicas answering a share of the lookups each: their growths add up.
    ("two replicas", "adaptive",
     [(("k0", 100 + i), ("k1", 7 + i)) for i in range(300)], [True] * 300),
    # A restarted replica counts from 0 again: what it counts since adds.
    ("a replica restarted", "adaptive",
     [(("k0", 500),), (("k0", 30),)] + [(("k0", 30 + i),) for i in range(300)],
     [True] * 302),
    ("always", "always", _growing(0, 300), [True] * 300),
    ("never", "never", _growing(100, 5), [False] * 5),
]


@pytest.mark.parametrize(("mode", "seen", "expected"), [c[1:] for c in GATE_CASES],
                         ids=[c[0] for c in GATE_CASES])
def test_the_gate_follows_missed_blocks_per_handoff(
        mode: str, seen: list[tuple[tuple[str, int], ...]], expected: list[bool]) -> None:
    assert _answers(mode, seen) == expected


def test_a_try_that_costs_ends_at_once_and_the_next_waits_twice_as_long() -> None:
    """Quiet for 256 hand-offs, the gate tries copies first off; 50 blocks missed at the
    next hand-off end the try. Once the misses stop and the mean has decayed below 0.5,
    the next try comes after 512 quiet hand-offs."""
    seen = _growing(0, 256) + [(("k0", 50 * k),) for k in range(1, 5)] + [(("k0", 200),)] * 800
    answers = _answers("adaptive", seen)
    assert answers[254] and not answers[255] and all(answers[256:256 + 512])
    off_again = answers.index(False, 256)
    assert 256 + 512 < off_again < 256 + 512 + 100
    assert not any(answers[off_again:])


def _h(i: int) -> bytes:
    return i.to_bytes(16, "big")


def test_an_arena_switched_to_copies_first_evicts_its_shared_blocks_first() -> None:
    """Roots 1-4 used in order, 3 and 4 with a copy elsewhere (kvindex said so while the
    arena kept to its policy): switched on, 3 and 4 leave first; switched off again,
    the policy's least recently used do."""
    ns = "0" * 31 + "1"
    s = BlockStore(64, 6, node="n1", eviction="lru", copies_first=False)
    for i in range(1, 7):
        r = wire.BlockRef(_h(i), b"", 16)
        s.allocate(ns, [r])
        s.seal([r.hash])
    s.mark_copies([_h(3), _h(4), _h(6)], [])

    def evicted(count: int) -> list[bytes]:
        s.drain_events()
        assert s.evict(count) == count
        return [h for ev in s.drain_events() if isinstance(ev, wire.BlocksEvicted)
                for h in ev.hashes]

    s.set_copies_first(True)
    assert s.copies_first and evicted(2) == [_h(3), _h(4)]
    s.set_copies_first(False)
    assert evicted(2) == [_h(1), _h(2)]   # block 6 is shared, but the policy decides
    s.set_copies_first(True)
    assert evicted(1) == [_h(6)]
