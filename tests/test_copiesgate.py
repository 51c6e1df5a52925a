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
# 5 % of each hand-off's misses; on above 1 block per hand-off, off again below 0.5.
GATE_CASES = [
    ("nothing missed", "adaptive", _growing(0, 50), [False] * 50),
    # A replica's first count is where it starts; 50 missed before the second hand-off.
    ("a short pool", "adaptive", _growing(50, 3), [False, True, True]),
    # One block per hand-off approaches the threshold without passing it.
    ("one per hand-off", "adaptive", _growing(1, 300), [False] * 300),
    # Two per hand-off: 2·(1 − 0.95^i) > 1 from the 15th hand-off.
    ("two per hand-off", "adaptive", _growing(2, 30), [False] * 14 + [True] * 16),
    # After a burst the mean (2.5) decays by 0.95 per hand-off: below 0.5 after 32.
    ("a burst, then none", "adaptive", [(("k0", 0),), (("k0", 50),)] + [(("k0", 50),)] * 40,
     [False, True] + [True] * 31 + [False] * 9),
    # Two replicas answer a share of the lookups each: their growths add up.
    ("two replicas", "adaptive",
     [(("k0", 100), ("k1", 7))] + [(("k0", 100 + i), ("k1", 7 + i)) for i in range(1, 30)],
     [False] * 14 + [True] * 16),
    # A restarted replica counts from 0 again: what it counts since adds.
    ("a replica restarted", "adaptive", [(("k0", 500),), (("k0", 30),), (("k0", 60),)],
     [False, True, True]),
    ("always", "always", _growing(0, 5), [True] * 5),
    ("never", "never", _growing(100, 5), [False] * 5),
]


@pytest.mark.parametrize(("mode", "seen", "expected"), [c[1:] for c in GATE_CASES],
                         ids=[c[0] for c in GATE_CASES])
def test_the_gate_follows_missed_blocks_per_handoff(
        mode: str, seen: list[tuple[tuple[str, int], ...]], expected: list[bool]) -> None:
    assert _answers(mode, seen) == expected


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
