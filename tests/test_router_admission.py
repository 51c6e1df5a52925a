"""Admission control and the router's node table: pure logic, no server."""

from __future__ import annotations

import asyncio
import time

import pytest

from cpd.protocol import wire
from cpd.protocol.errors import CpdError, ErrorCode, Overloaded
from services.router import Admission, NodeTable
from services.router.cost import PrefillCost

pytestmark = pytest.mark.timeout(20)


async def test_admits_up_to_the_limit_then_queues_in_order_then_refuses() -> None:
    adm = Admission(max_inflight=2, max_queue=2)
    far = time.monotonic() + 10
    order: list[int] = []
    gate = asyncio.Event()

    async def job(i: int) -> None:
        async with adm.slot(far):
            order.append(i)
            await gate.wait()

    tasks = [asyncio.create_task(job(i)) for i in range(4)]
    await asyncio.sleep(0.05)
    assert (adm.in_flight, adm.queued, order) == (2, 2, [0, 1])
    with pytest.raises(Overloaded) as exc:
        async with adm.slot(far):
            pass
    assert exc.value.retryable
    gate.set()
    await asyncio.gather(*tasks)
    assert order == [0, 1, 2, 3]  # the queue is FIFO
    assert (adm.in_flight, adm.queued) == (0, 0)


async def test_higher_priority_waiters_go_first() -> None:
    adm = Admission(max_inflight=1, max_queue=8)
    far = time.monotonic() + 10
    order: list[str] = []
    gate = asyncio.Event()

    async def job(name: str, priority: int) -> None:
        async with adm.slot(far, priority):
            order.append(name)
            if name == "first":
                await gate.wait()

    tasks = [asyncio.create_task(job("first", 0))]
    await asyncio.sleep(0.01)
    for name, prio in [("low", 0), ("high", 5), ("low2", 0), ("mid", 1)]:
        tasks.append(asyncio.create_task(job(name, prio)))
        await asyncio.sleep(0.01)
    gate.set()
    await asyncio.gather(*tasks)
    assert order == ["first", "high", "mid", "low", "low2"]


async def test_a_queued_request_past_its_deadline_fails_typed_and_frees_nothing() -> None:
    adm = Admission(max_inflight=1, max_queue=4)
    hold = asyncio.Event()

    async def holder() -> None:
        async with adm.slot(time.monotonic() + 10):
            await hold.wait()

    t = asyncio.create_task(holder())
    await asyncio.sleep(0.01)
    with pytest.raises(CpdError) as exc:
        async with adm.slot(time.monotonic() + 0.05):
            pass
    assert exc.value.code is ErrorCode.DEADLINE_EXCEEDED
    assert (adm.in_flight, adm.queued) == (1, 0)
    hold.set()
    await t
    assert adm.in_flight == 0


async def test_a_cancelled_waiter_leaves_no_slot_behind() -> None:
    adm = Admission(max_inflight=1, max_queue=4)
    hold = asyncio.Event()

    async def holder() -> None:
        async with adm.slot(time.monotonic() + 10):
            await hold.wait()

    async def waiter() -> None:
        async with adm.slot(time.monotonic() + 10):
            pass

    h = asyncio.create_task(holder())
    await asyncio.sleep(0.01)
    w = asyncio.create_task(waiter())
    await asyncio.sleep(0.01)
    w.cancel()
    await asyncio.gather(w, return_exceptions=True)
    hold.set()
    await h
    assert (adm.in_flight, adm.queued) == (0, 0)


# 10 ms per 1,000 new tokens, nothing else: round figures for the priced queues.
COST_10_MS_PER_KTOK = PrefillCost(fixed_ms=0.0, per_token_ms=0.01, per_token_ctx_ms=0.0)


def _hb(node: str, role: str, ns: str = "ns", started: int = 1, ttl_ms: int = 1000
        ) -> wire.Heartbeat:
    return wire.Heartbeat(node=node, role=role, started_unix_ms=started, lease_ttl_ms=ttl_ms,
                          namespace=ns)


def test_node_table_liveness_load_and_foreign_models() -> None:
    t = NodeTable(namespace="ns")
    t.heartbeat(_hb("p0", "prefill"), now=0.0)
    t.heartbeat(_hb("d0", "decode"), now=0.0)
    t.heartbeat(_hb("other", "prefill", ns="another-model"), now=0.0)
    t.heartbeat(_hb("kvi", "kvindex"), now=0.0)
    assert {n.node for n in t.live(0.5)} == {"p0", "d0"}
    assert t.foreign == {"other"}
    held = [wire.PrefillWork(4_000, 0)]
    t.load_report(wire.LoadReport(node="p0", role="prefill", prefills=held,
                                  in_flight=2, kv_bandwidth_gbps=3.0), now=0.9)
    t.dispatched("p0", 25.0)  # sent since the report: counted until the next one
    p0 = next(n for n in t.live(1.5) if n.node == "p0")
    assert (p0.prefills, p0.dispatched_ms, p0.in_flight, p0.bandwidth_gbps) == (
        tuple(held), (25.0,), 2, 3.0)
    # d0's lease (1 s) lapsed at 1.5; p0's load report renewed its own.
    assert not t.alive("d0", 1.5) and t.alive("p0", 1.5)
    assert {n.node for n in t.live(1.5, exclude=frozenset({"p0"}))} == set()
    status = {s.node: s for s in t.status(1.5, COST_10_MS_PER_KTOK)}
    assert status["d0"].alive is False and status["p0"].est_queue_ms == 40.0 + 25.0
    t.load_report(wire.LoadReport(node="p0", role="prefill", prefills=[]), now=1.6)
    p0 = next(n for n in t.live(1.6) if n.node == "p0")
    assert (p0.prefills, p0.dispatched_ms) == ((), ())
    t.forget_dead(now=100.0, after_s=10.0)
    assert t.status(100.0, COST_10_MS_PER_KTOK) == []


def test_a_restarted_node_starts_with_a_fresh_load() -> None:
    t = NodeTable(namespace="ns")
    t.heartbeat(_hb("p0", "prefill", started=1), now=0.0)
    t.load_report(wire.LoadReport(node="p0", role="prefill",
                                  prefills=[wire.PrefillWork(50_000, 0)]), now=0.1)
    t.dispatched("p0", 30.0)
    t.heartbeat(_hb("p0", "prefill", started=2), now=0.2)
    p0 = t.live(0.3)[0]
    assert (p0.prefills, p0.dispatched_ms) == ((), ())


def test_node_table_passes_held_prefills_and_dispatches_to_the_policy() -> None:
    t = NodeTable(namespace="ns")
    t.heartbeat(_hb("p0", "prefill"), now=0.0)
    t.heartbeat(_hb("p1", "prefill"), now=0.0)
    t.load_report(wire.LoadReport(node="p1", role="prefill"), now=0.1)
    work = [wire.PrefillWork(100_000, 0, 250.0), wire.PrefillWork(2_000, 120_000)]
    t.load_report(wire.LoadReport(node="p0", role="prefill", prefills=work,
                                  prefill_token_cap=2048), now=0.1)
    t.dispatched("p0", 30.0)
    t.dispatched("p0", 20.0)
    live = {n.node: n for n in t.live(0.2)}
    assert live["p0"].prefills == tuple(work) and live["p0"].shares_steps
    assert live["p0"].dispatched_ms == (30.0, 20.0)
    assert live["p1"].prefills == () and not live["p1"].shares_steps
    # cpd status prices held prefills as the router does: the 100K-token prefill has
    # 250 ms of its 1,000 done, the 2K-token one has not started, 50 ms were dispatched.
    shown = {s.node: s.est_queue_ms for s in t.status(0.2, COST_10_MS_PER_KTOK)}
    assert shown["p0"] == pytest.approx((1000 - 250) + 20 + 50)
    assert shown["p1"] == 0.0  # it holds nothing
    t.load_report(wire.LoadReport(node="p0", role="prefill", prefills=[]), now=0.3)
    p0 = next(n for n in t.live(0.3) if n.node == "p0")
    assert p0.prefills == () and p0.dispatched_ms == () and not p0.shares_steps
    for _ in range(1000):  # a node that stops reporting keeps a bounded list
        t.dispatched("p0", 1.0)
    p0 = next(n for n in t.live(0.4) if n.node == "p0")
    assert len(p0.dispatched_ms) <= 256 and sum(p0.dispatched_ms) == 1000.0



@pytest.mark.parametrize("change, rebuilt", [
    (lambda t: None, False),
    (lambda t: t.dispatched("p0", 5.0), True),
    (lambda t: t.load_report(wire.LoadReport(node="p0", role="prefill", in_flight=3), 0.2), True),
    (lambda t: t.heartbeat(wire.Heartbeat(node="p0", role="prefill", started_unix_ms=1,
                                          lease_ttl_ms=1000, namespace="ns",
                                          decodes=True), 0.2), True),
    (lambda t: t.dispatched("p1", 5.0), False),  # another node's dispatch
])
def test_a_nodes_view_is_built_again_only_when_the_node_changed(change, rebuilt: bool) -> None:
    """The policy's view of a node is kept between decisions until a heartbeat, a load
    report or a dispatch changes the node, and then shows the change."""
    t = NodeTable(namespace="ns")
    t.heartbeat(_hb("p0", "prefill"), now=0.0)
    t.heartbeat(_hb("p1", "prefill"), now=0.0)
    before = next(n for n in t.live(0.1) if n.node == "p0")
    change(t)
    after = next(n for n in t.live(0.3) if n.node == "p0")
    assert (after is not before) is rebuilt
    if rebuilt:
        assert (after.dispatched_ms, after.in_flight, after.decodes) != (
            before.dispatched_ms, before.in_flight, before.decodes)


@pytest.mark.parametrize("beats, now, serves", [
    ([], 0.0, False),
    ([("p0", "prefill")], 0.0, False),
    ([("d0", "decode")], 0.0, False),
    ([("p0", "prefill"), ("d0", "decode")], 0.5, True),
    ([("pp0", "preprefill"), ("d0", "decode")], 0.5, True),
    ([("p0", "prefill"), ("d0", "decode")], 1.5, False),   # their leases lapsed
])
def test_live_nodes_serve_a_request_end_to_end(beats: list, now: float, serves: bool) -> None:
    t = NodeTable(namespace="ns")
    for node, role in beats:
        t.heartbeat(_hb(node, role), now=0.0)
    assert t.serves_every_role(now) is serves


async def test_a_starting_replica_waits_for_the_workers_at_most_a_heartbeat_round() -> None:
    from services.router.discovery import DISCOVERY_INTERVALS, await_workers

    empty = NodeTable(namespace="ns")
    t0 = time.monotonic()
    await await_workers(empty, heartbeat_interval_s=0.2)  # nobody there: a round, then on
    assert time.monotonic() - t0 >= DISCOVERY_INTERVALS * 0.2 - 0.01
    t = NodeTable(namespace="ns")

    async def beats() -> None:
        await asyncio.sleep(0.05)
        for node, role in (("p0", "prefill"), ("d0", "decode")):
            t.heartbeat(_hb(node, role), now=time.monotonic())

    t0 = time.monotonic()
    await asyncio.gather(await_workers(t, heartbeat_interval_s=10.0), beats())
    assert time.monotonic() - t0 < 2.0  # as soon as both roles were heard
