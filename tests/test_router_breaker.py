"""The router's circuit breaker per KV source (services/router/breaker.py), table-driven:
which load errors open it, for how long, the half-open trial, and what the policy then
sees of kvindex's answer."""

from __future__ import annotations

import pytest

from cpd.protocol import wire
from cpd.protocol.errors import ErrorCode
from services.router.breaker import SourceBreaker
from services.router.cost import LoadCost, PrefillCost
from services.router.hits import Hits
from services.router.policy import NodeLoad, PolicyConfig, Router


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def failed(peer: str, code: ErrorCode) -> wire.Route:
    return wire.Route(prefill_node="p0", remote_node=peer,
                      load_error=wire.LoadError(peer=peer, code=code.value))


def served(peer: str) -> wire.Route:
    return wire.Route(prefill_node="p0", remote_node=peer)


@pytest.mark.parametrize(("code", "opens"), [
    (ErrorCode.PEER_GONE, True), (ErrorCode.TIMEOUT, True), (ErrorCode.UNAVAILABLE, True),
    (ErrorCode.CHECKSUM_MISMATCH, True), (ErrorCode.CAPABILITY_DENIED, True),
    (ErrorCode.BLOCK_EVICTED, False),  # the index was behind: the peer is fine
    (ErrorCode.CANCELLED, False),
])
def test_which_load_errors_open_the_breaker(code: ErrorCode, opens: bool) -> None:
    b = SourceBreaker(clock=Clock())
    b.observe(failed("pp0", code))
    assert (b.open_peers() == {"pp0"}) is opens
    assert b.opened == int(opens)


# (seconds after the failures, failures in a row, open?)
@pytest.mark.parametrize(("after", "failures", "shut"), [
    (0.0, 1, True), (1.9, 1, True), (2.1, 1, False),
    (3.9, 2, True), (4.1, 2, False),             # doubled
    (59.0, 9, True), (60.1, 9, False),           # capped at max_open_s
])
def test_it_stays_open_longer_after_each_failure_in_a_row(after: float, failures: int,
                                                         shut: bool) -> None:
    clock = Clock()
    b = SourceBreaker(open_s=2.0, max_open_s=60.0, clock=clock)
    for _ in range(failures):
        b.observe(failed("pp0", ErrorCode.PEER_GONE))
    clock.now += after
    assert ("pp0" in b.open_peers()) is shut


def test_half_open_lets_one_decision_try_and_a_served_load_closes_it() -> None:
    clock = Clock()
    b = SourceBreaker(open_s=2.0, clock=clock)
    b.observe(failed("pp0", ErrorCode.TIMEOUT))
    clock.now += 2.5
    assert b.open_peers() == frozenset()          # the trial
    assert b.open_peers() == {"pp0"}              # the others wait for its outcome
    clock.now += 2.5
    assert b.open_peers() == frozenset()          # no word from the trial: another one
    b.observe(served("pp0"))
    assert b.open_peers() == frozenset() and b.open_peers() == frozenset()
    b.observe(failed("pp0", ErrorCode.TIMEOUT))   # closed, so a first failure again
    clock.now += 2.1
    assert b.open_peers() == frozenset()


def test_only_a_decision_that_could_load_from_the_peer_spends_its_trial() -> None:
    clock = Clock()
    b = SourceBreaker(open_s=2.0, clock=clock)
    b.observe(failed("pp0", ErrorCode.TIMEOUT))
    clock.now += 2.5
    other = Hits(dram={"d0": 30})                 # prompts pp0 does not hold
    assert b.filter(other) is other and b.filter(other) is other
    holds = Hits(dram={"pp0": 36, "d0": 30})
    assert b.filter(holds) is holds               # the first that could load: the trial
    assert set(b.filter(holds).dram) == {"d0"}    # the next wait for its outcome
    assert set(b.filter(Hits(disk={"pp0": 8})).disk) == set()  # a disk copy is a holder


def test_an_open_peer_is_not_planned_as_a_source() -> None:
    b = SourceBreaker(clock=Clock())
    hits = Hits(dram={"pp0": 36, "d0": 30}, disk={"pp0": 38}, caps={"pp0": b"c"})
    assert b.filter(hits) is hits  # nothing open: untouched
    b.observe(failed("pp0", ErrorCode.PEER_GONE))
    left = b.filter(hits)
    assert (left.dram, left.disk, left.caps) == ({"d0": 30}, {}, {})
    nodes = [NodeLoad("p0", "prefill", bandwidth_gbps=2.0),
             NodeLoad("pp0", "preprefill"), NodeLoad("d0", "decode")]
    router = Router(PolicyConfig(), PrefillCost(fixed_ms=5, per_token_ms=0.08),
                    LoadCost(kv_bytes_per_token=4096))
    d = router.decide(40 * 256 + 7, 256, left, nodes)
    assert d.plan.remote_node == "d0" and d.plan.remote_tokens == 30 * 256
