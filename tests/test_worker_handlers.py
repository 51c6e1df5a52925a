"""The worker's request handlers composed in one process: a prefill-side node that also
hosts the decode handler serves a request end to end, its hand-off to itself needing no
pull and announced on the stream (``HandoffAccepted``) before decode's tokens; its
decode endpoint refuses a bad hand-off with a typed error and keeps serving.
Real NATS (JetStream) and UCX, the sim engine in the worker's own process."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from cpd.bus import Bus
from cpd.engines.profile import engine_profile
from cpd.kvstore import events as kvevents
from cpd.ops.config import load_settings
from cpd.ops.natsserver import NatsServer
from cpd.protocol import subjects, wire
from cpd.protocol.errors import CpdError, ErrorCode, InvalidRequest
from cpd.protocol.hashing import block_hashes
from cpd.protocol.roles import Role
from services.kvindex import KvIndexService
from services.worker import WorkerService

pytestmark = pytest.mark.timeout(120)
NODE = "both0"


@pytest.fixture
async def both(nats_server: NatsServer, tmp_path: Path) -> AsyncIterator[WorkerService]:
    s = load_settings(environ={}, overrides=[
        f"nats.servers={nats_server.url}", "nats.drain_timeout_s=2", "worker.engine=sim",
        f"node.node_id={NODE}", f"worker.arena_dir={tmp_path}",
        "dataplane.arena_bytes=67108864"])
    worker = WorkerService(s, Role.PREFILL, handlers=(Role.PREFILL, Role.DECODE))
    await worker.start()
    try:
        yield worker
    finally:
        await worker.stop()


def test_a_worker_hosts_its_roles_handler_and_decodes_only() -> None:
    s = load_settings(environ={}, overrides=["worker.engine=sim"])
    with pytest.raises(ValueError):
        WorkerService(s, Role.DECODE, handlers=(Role.PREFILL,))
    with pytest.raises(ValueError):
        WorkerService(s, Role.PREFILL, handlers=(Role.PREPREFILL,))


async def test_one_process_prefills_and_decodes_its_own_hand_off(
        both: WorkerService, settings: object) -> None:
    ns = engine_profile(both.settings).namespace()
    bs = both.settings.cache.block_size
    prompt = list(range(1, 3 * bs + 11))
    req = wire.PrefillRequest(
        request_id="r-both", reply_to="", tokens=wire.pack_tokens(prompt),
        sampling=wire.SamplingParams(max_tokens=6, ignore_eos=True), namespace=ns.id,
        block_hashes=block_hashes(ns, prompt), decode_node=NODE,
        deadline_unix_ms=int(time.time() * 1000) + 60_000)
    bus = await Bus.open(both.settings, "test-both")
    acks = await bus.nc.subscribe(subjects.pull_ack(NODE))
    try:
        msgs = [m async for m in bus.stream(subjects.run(Role.PREFILL, NODE), req, timeout=60)]
        tokens = [t for m in msgs if isinstance(m, wire.TokenChunk) for t in m.token_ids]
        final = msgs[-1]
        assert isinstance(final, wire.Final) and len(tokens) == 6
        assert [m.seq for m in msgs] == list(range(len(msgs)))
        # The first token and prefill's report, then decode's word that it owns the
        # stream; decode's report right before the final.
        assert [type(m) for m in msgs[:3]] == [wire.TokenChunk, wire.PrefillReport,
                                               wire.HandoffAccepted]
        prefill, accepted, decode = msgs[1], msgs[2], msgs[-2]
        assert isinstance(prefill, wire.PrefillReport)
        assert isinstance(accepted, wire.HandoffAccepted) and accepted.node == NODE
        assert isinstance(decode, wire.DecodeReport)
        assert (prefill.node, decode.node) == (NODE, NODE)
        assert prefill.tokens.computed == len(prompt) and decode.tokens_pulled == 0
        # The hand-off's blocks were this process's own: acked, never pulled from a peer.
        ack = wire.decode((await acks.next_msg(timeout=5)).data, wire.PullAck)
        assert ack.ok and ack.request_id == "r-both"
        assert both.core is not None and not both.core.kv.store.leases()
        assert not both.core.running

        # The decode endpoint keeps its own checks: a hand-off with nothing left to
        # generate is refused, typed, and the process serves on.
        bad = wire.DecodeRequest(
            request_id="r-bad", reply_to=bus.nc.new_inbox(), tokens=wire.pack_tokens(prompt),
            first_token=1, sampling=wire.SamplingParams(max_tokens=1), namespace=ns.id,
            block_hashes=b"", source_node=NODE, lease_id="none",
            deadline_unix_ms=int(time.time() * 1000) + 60_000, seq_start=1)
        with pytest.raises(InvalidRequest):
            await bus.request(subjects.run(Role.DECODE, NODE), bad, expect=wire.Accepted,
                              timeout=10)
        again = [m async for m in bus.stream(subjects.run(Role.PREFILL, NODE),
                                             wire.PrefillRequest(**{
                                                 **{f: getattr(req, f)
                                                    for f in req.__struct_fields__},
                                                 "request_id": "r-again"}), timeout=60)]
        assert isinstance(again[-1], wire.Final)
        assert [t for m in again if isinstance(m, wire.TokenChunk) for t in m.token_ids] \
            == tokens
    finally:
        await acks.unsubscribe()
        await bus.close()
        await asyncio.sleep(0)


async def test_several_choices_share_one_prefill_and_one_hand_off(both: WorkerService) -> None:
    """``n`` = 3: the prefill computes the prompt's KV and sends no token of its own; the
    decode node runs every choice from the prompt on one hand-off, streaming them side
    by side under their index; a cancel of one choice stops only that one; a hand-off
    whose first token does not fit its number of choices is refused."""
    ns = engine_profile(both.settings).namespace()
    bs = both.settings.cache.block_size
    prompt = list(range(5, 2 * bs + 40))
    req = wire.PrefillRequest(
        request_id="r-n", reply_to="", tokens=wire.pack_tokens(prompt),
        sampling=wire.SamplingParams(max_tokens=400, ignore_eos=True, n=3),
        namespace=ns.id, block_hashes=block_hashes(ns, prompt), decode_node=NODE,
        deadline_unix_ms=int(time.time() * 1000) + 60_000)
    bus = await Bus.open(both.settings, "test-choices")
    try:
        msgs: list[wire.Message] = []
        async for m in bus.stream(subjects.run(Role.PREFILL, NODE), req, timeout=60):
            msgs.append(m)
            if (isinstance(m, wire.TokenChunk) and m.index == 1
                    and sum(len(c.token_ids) for c in msgs if isinstance(c, wire.TokenChunk)
                            and c.index == 1) == len(m.token_ids)):
                await bus.publish(subjects.cancel(NODE),
                                  wire.Cancel(request_id="r-n", choice=1))
        assert [type(m) for m in msgs[:2]] == [wire.PrefillReport, wire.HandoffAccepted]
        by_choice: dict[int, list[int]] = {}
        for m in msgs:
            if isinstance(m, wire.TokenChunk):
                by_choice.setdefault(m.index, []).extend(m.token_ids)
        final = msgs[-1]
        assert isinstance(final, wire.Final)
        assert [(e.index, e.finish_reason) for e in final.choices] == [
            (0, "length"), (1, "abort"), (2, "length")]
        assert [e.completion_tokens for e in final.choices] == [
            len(by_choice[i]) for i in range(3)]
        assert len(by_choice[0]) == len(by_choice[2]) == 400 > len(by_choice[1])
        assert final.usage.completion_tokens == sum(map(len, by_choice.values()))
        report = msgs[-2]
        assert isinstance(report, wire.DecodeReport)
        assert report.tokens_computed == 3 * (len(prompt) - 2 * bs)  # the KV loaded, each
        assert both.core is not None and not both.core.choices and not both.core.running

        # A first token with several choices, none with one, next tokens without a
        # first, a generated token past the vocabulary, nothing left to generate.
        for i, (first, more, n) in enumerate(((1, [], 2), (None, [], 1), (None, [5], 2),
                                              (1, [1 << 30], 1), (1, [2, 3, 4], 1))):
            bad = wire.DecodeRequest(
                request_id=f"r-bad-{i}", reply_to=bus.nc.new_inbox(),
                tokens=wire.pack_tokens(prompt), first_token=first, next_tokens=more,
                sampling=wire.SamplingParams(max_tokens=4, n=n), namespace=ns.id,
                block_hashes=b"", source_node=NODE, lease_id="none",
                deadline_unix_ms=int(time.time() * 1000) + 60_000, seq_start=1)
            with pytest.raises(InvalidRequest):
                await bus.request(subjects.run(Role.DECODE, NODE), bad, expect=wire.Accepted,
                                  timeout=10)
    finally:
        await bus.close()


async def test_a_worker_whose_clock_is_behind_its_last_epoch_starts_past_it(
        fresh_nats: NatsServer, tmp_path: Path) -> None:
    """The node's last incarnation stamped its events with an epoch an hour ahead of this
    clock (its clock ran ahead, or this one was set back). kvindex takes events of an
    epoch below the node's latest for stale: the new incarnation starts past the last
    epoch in CPD_KV, so what it computes is indexed and found."""
    node = "behind0"
    common = [f"nats.servers={fresh_nats.url}", "nats.drain_timeout_s=2"]
    s = load_settings(environ={}, overrides=[
        *common, "worker.engine=sim", f"node.node_id={node}", f"worker.arena_dir={tmp_path}",
        "dataplane.arena_bytes=67108864"])
    kvindex = KvIndexService(load_settings(environ={}, overrides=[
        *common, "node.node_id=kvi-behind", f"kvindex.snapshot_dir={tmp_path / 'snap'}"]))
    await kvindex.start()
    bus = await Bus.open(s, "test-epochs")
    worker: WorkerService | None = None
    try:
        js = bus.nc.jetstream()
        await kvevents.ensure_stream(js)
        ahead = int(time.time() * 1000) + 3_600_000
        await kvevents.KvEventPublisher(js, node, epoch=ahead).cleared()
        worker = WorkerService(s, Role.PREFILL, handlers=(Role.PREFILL, Role.DECODE))
        await worker.start()
        assert worker.epoch == ahead + 1
        assert worker.heartbeat_message().started_unix_ms == ahead + 1
        ns = engine_profile(s).namespace()
        prompt = list(range(1, 3 * s.cache.block_size + 11))
        hashes = block_hashes(ns, prompt)
        req = wire.PrefillRequest(
            request_id="r-epoch", reply_to="", tokens=wire.pack_tokens(prompt),
            sampling=wire.SamplingParams(max_tokens=2, ignore_eos=True), namespace=ns.id,
            block_hashes=hashes, decode_node=node,
            deadline_unix_ms=int(time.time() * 1000) + 60_000)
        msgs = [m async for m in bus.stream(subjects.run(Role.PREFILL, node), req, timeout=60)]
        assert isinstance(msgs[-1], wire.Final)
        found = 0
        for _ in range(100):
            reply = await bus.request(subjects.KVINDEX_LOOKUP, wire.LookupRequest(
                request_id="q", namespace=ns.id, block_hashes=hashes), expect=wire.LookupReply)
            found = max((m.num_blocks for m in reply.matches if m.node == node), default=0)
            if found == 3:
                break
            await asyncio.sleep(0.1)
        assert found == 3
    finally:
        if worker is not None:
            await worker.stop()
        await bus.close()
        await kvindex.stop()


async def test_deadlines_hold_on_the_workers_clock_whatever_the_routers_says(
        both: WorkerService) -> None:
    """A router whose clock runs 2 minutes behind sends a deadline whose instant has
    passed by this worker's clock, with 60 s left: served end to end (the hand-off to
    decode carries what is left). One whose clock runs ahead sends an instant far off
    with nothing left: refused as past its deadline."""
    ns = engine_profile(both.settings).namespace()
    prompt = list(range(7, 2 * both.settings.cache.block_size + 5))
    now = int(time.time() * 1000)

    def request(rid: str, deadline: int, budget: int | None) -> wire.PrefillRequest:
        return wire.PrefillRequest(
            request_id=rid, reply_to="", tokens=wire.pack_tokens(prompt),
            sampling=wire.SamplingParams(max_tokens=4, ignore_eos=True), namespace=ns.id,
            block_hashes=block_hashes(ns, prompt), decode_node=NODE,
            deadline_unix_ms=deadline, budget_ms=budget)

    bus = await Bus.open(both.settings, "test-deadlines")
    try:
        run = subjects.run(Role.PREFILL, NODE)
        msgs = [m async for m in bus.stream(run, request("r-behind", now - 60_000, 60_000),
                                            timeout=60)]
        assert isinstance(msgs[-1], wire.Final)
        assert sum(len(m.token_ids) for m in msgs if isinstance(m, wire.TokenChunk)) == 4
        for rid, deadline, budget in (("r-ahead", now + 180_000, 0),
                                      ("r-instant", now - 60_000, None)):
            with pytest.raises(CpdError) as e:
                _ = [m async for m in bus.stream(run, request(rid, deadline, budget),
                                                 timeout=30)]
            assert e.value.code == ErrorCode.DEADLINE_EXCEEDED
    finally:
        await bus.close()
