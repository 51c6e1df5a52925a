"""Pure logic of the fault harness: the sim reference, the visibility rule, the block
checks, the audit trail's format, and the router's incarnation-aware liveness."""

from __future__ import annotations

import asyncio
import math
from pathlib import Path

import pytest

from cpd.engines import EngineRequest
from cpd.engines.sim.engine import SimEngine
from cpd.ops.audit import AuditLog, read_audit
from cpd.protocol import wire
from services.kvindex.index import Changes
from services.router import NodeTable
from tools.bench.faults import (
    LOOKUP_RACE_S,
    QUICK,
    Heartbeats,
    Outcome,
    Prompts,
    Timeline,
    check_blocks,
    config_for,
    reference_tokens,
    ttft_ms,
)

pytestmark = pytest.mark.timeout(60)
NS = "0" * 32


def _hb(node: str, epoch: int) -> wire.Heartbeat:
    return wire.Heartbeat(node=node, role="prefill", started_unix_ms=epoch,
                          lease_ttl_ms=5000, ucx_address=b"127.0.0.1:1", namespace="ns")


def test_reference_matches_the_sim_engine_prefill_then_decode() -> None:
    """The reference is what a prefill engine then a decode engine produce."""
    async def run() -> list[int]:
        engine = SimEngine(time_scale=1000.0)
        await engine.start()
        prompt = list(range(1, 600))
        sampling = wire.SamplingParams(max_tokens=1, ignore_eos=True)
        first = [t for s in [s async for s in engine.generate(EngineRequest(
            request_id="a", tokens=prompt, sampling=sampling))] for t in s.token_ids]
        rest = [t for s in [s async for s in engine.generate(EngineRequest(
            request_id="b", tokens=[*prompt, first[0]],
            sampling=wire.SamplingParams(max_tokens=4, ignore_eos=True)))]
            for t in s.token_ids]
        await engine.stop()
        return first + rest

    got = asyncio.run(run())
    assert got == reference_tokens(list(range(1, 600)), 5)
    assert reference_tokens(list(range(1, 600)), 5) != reference_tokens(list(range(2, 601)), 5)


def test_prompts_share_documents_and_never_repeat_suffixes() -> None:
    p = Prompts(config_for(True), 0)
    a, b = p.make(warm=True), p.make(warm=True)
    c = p.make(warm=False)
    assert a != b and len(a) > 6 * 256
    docs = {tuple(p.doc(d)) for d in range(p.cfg.docs)}
    assert tuple(a[:6 * 256]) in docs and tuple(c[:6 * 256]) not in docs


def test_visibility_rule_allows_only_the_lookup_race() -> None:
    t = Timeline()
    h = b"\x01" * 16
    ch = Changes(visible=[(NS, "p0", wire.Tier.DRAM, h)])
    t._record(ch, 100.0)
    assert t.justified(NS, "p0", h, 100.5)
    assert not t.justified(NS, "p0", h, 99.0)           # read before it was visible
    assert not t.justified(NS, "p1", h, 100.5)          # visible elsewhere only
    t._record(Changes(invalidated=[(NS, "p0", wire.Tier.DRAM, h)]), 110.0)
    assert t.justified(NS, "p0", h, 110.0 + LOOKUP_RACE_S / 2)     # the race
    assert not t.justified(NS, "p0", h, 110.0 + LOOKUP_RACE_S * 2)  # long gone
    t._record(ch, 120.0)                                # visible again (re-announced)
    assert t.justified(NS, "p0", h, 125.0)


def test_block_checks_count_what_the_audit_shows(tmp_path: Path) -> None:
    log = AuditLog(tmp_path, "p1")
    h = b"\x02" * 16
    log.served(NS, [h], unsealed=0, corrupt=0)
    log.served(NS, [h, h], unsealed=1, corrupt=1)
    log.loaded(NS, [h], unsealed=0, corrupt=0)
    log.pulled("prefix", "p0", NS, [h], received_at=50.0)
    log.pulled("handoff", "p0", NS, [h], received_at=50.0, error="peer_gone")
    log.close()
    (tmp_path / "audit-p1.jsonl").open("ab").write(b'{"op": "serve", "torn')  # a SIGKILL
    records = list(read_audit(tmp_path))
    assert len(records) == 5 and all(r["node"] == "p1" for r in records)
    t = Timeline()
    out = check_blocks(records, t)
    assert out["unsealed_served"] == 2 and out["invisible_reads"] == 1
    assert out["prefix_reads"] == 1 and out["serves"] == 2 and out["loads"] == 1
    t._record(Changes(visible=[(NS, "p0", wire.Tier.DRAM, h)]), 49.0)
    assert check_blocks(records, t)["invisible_reads"] == 0


def test_a_restarted_node_is_not_alive_to_its_old_requests() -> None:
    """A worker killed and restarted within one lease is a new incarnation: requests it
    held are gone, and the router must not keep waiting on them."""
    t = NodeTable(namespace="ns")
    t.heartbeat(_hb("p0", 1000), now=0.0)
    old = t.epoch("p0")
    assert old == 1000 and t.alive("p0", 1.0, old)
    t.heartbeat(_hb("p0", 2000), now=1.5)
    assert t.alive("p0", 2.0) and not t.alive("p0", 2.0, old)
    assert t.epoch("unknown") == 0 and not t.alive("unknown", 0.0)


def test_config_for_cli_options() -> None:
    quick = config_for(True)
    assert quick.concurrency == 60 and quick.scenarios == QUICK and len(QUICK) == 7
    full = config_for(False, scenarios="kill-router, nats-restart", concurrency=10)
    assert full.scenarios == ("kill-router", "nats-restart") and full.concurrency == 10



def test_recovery_needs_a_heartbeat_after_the_fault_from_a_new_incarnation() -> None:
    """A killed node's last heartbeats (old incarnation) never count as it being back;
    a paused or reconnected node counts once heard after the fault."""
    hb = Heartbeats()
    hb.last["p0"] = (1000, 10.0)            # incarnation 1000, heard at t=10
    assert not hb.back("p0", since=11.0)    # nothing since the fault ended at 11
    assert hb.back("p0", since=9.0)         # heard after a fault ending at 9
    assert not hb.back("p0", since=9.0, incarnation_after_ms=1500)  # killed at 1500
    hb.last["p0"] = (2000, 12.0)            # the restarted incarnation
    assert hb.back("p0", since=11.0, incarnation_after_ms=1500)
    assert not hb.back("never-heard", since=0.0)


@pytest.mark.parametrize(("window", "want"), [
    ((0.0, 10.0), {"n": 3, "p50": 200.0, "p99": 298.0}),   # failed and tokenless skipped
    ((5.0, 10.0), {"n": 1, "p50": 300.0, "p99": 300.0}),   # by send time, not by end
    ((10.0, math.inf), {"n": 0, "p50": None, "p99": None}),
])
def test_ttft_windows_count_completed_requests_by_send_time(
        window: tuple[float, float], want: dict) -> None:
    results = [Outcome(t_start=1.0, t_first=1.1), Outcome(t_start=2.0, t_first=2.2),
               Outcome(t_start=6.0, t_first=6.3, t_end=20.0),
               Outcome(t_start=3.0, t_first=3.05, error="unavailable"),
               Outcome(t_start=4.0)]
    assert ttft_ms(results, *window) == want
