"""Wire schema: round trips of every kind, schema evolution, and typed errors for bad input."""

from __future__ import annotations

import contextlib
import math

import msgspec
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cpd.protocol import wire
from cpd.protocol.errors import (
    CpdError,
    MalformedMessage,
    SchemaVersionError,
    UnknownKind,
    WrongKind,
)

H = bytes(range(16))
SAMPLES: list[wire.Message] = [
    wire.GenerateRequest(request_id="r1", prompt="hello", tenant="t1", priority=2,
                         sampling=wire.SamplingParams(max_tokens=3, temperature=0.7, top_p=0.9,
                                                      top_k=40, seed=5, stop_token_ids=[2])),
    wire.GenerateRequest(request_id="r3", prompt="x", sampling=wire.SamplingParams(
        max_tokens=9, min_tokens=2, min_p=0.05, repetition_penalty=1.1,
        presence_penalty=0.5, frequency_penalty=-0.5, logit_bias={7: -3.0},
        stop=["\n\n", "END"], include_stop_str_in_output=True, skip_special_tokens=False)),
    wire.GenerateRequest(request_id="r2", tokens=wire.pack_tokens([1, 2, 3]), timeout_ms=500),
    wire.TokenChunk(request_id="r1", seq=0, token_ids=[5, 6], text="ab"),
    wire.TokenChunk(request_id="r1", seq=1, token_ids=[2], ends_with_stop_token=True),
    wire.TokenChunk(request_id="r1", seq=2, token_ids=[3, 4], logprobs=[
        wire.TokenLogprob(logprob=-0.1, rank=1, top=[(3, -0.1)]),
        wire.TokenLogprob(logprob=-2.5, rank=3, top=[])]),
    wire.Final(request_id="r1", seq=3, finish_reason="length",
               usage=wire.Usage(prompt_tokens=10, completion_tokens=3, cached_tokens=8),
               timings=wire.Timings(ttft_ms=12.5, total_ms=40.0),
               route=wire.Route(policy="cpd", path="warm", prefill_node="p0", decode_node="d0",
                                tokens=wire.PromptTokens(dram=256, computed=10))),
    wire.PrefillReport(request_id="r1", seq=1, node="p0",
                       tokens=wire.PromptTokens(remote=256, computed=4),
                       load_error=wire.LoadError(peer="pp0", code="unavailable"),
                       load_ms=1.5, prefill_ms=7.25),
    wire.DecodeReport(request_id="r1", seq=9, node="d0", tokens_pulled=256,
                      tokens_computed=5, handoff_ms=2.0, decode_ms=30.5),
    wire.Error(request_id="r1", seq=1, code="overloaded", message="busy", retryable=True),
    wire.LookupRequest(request_id="r1", namespace="ns", block_hashes=H * 3),
    wire.LookupReply(request_id="r1", num_blocks=3,
                     matches=[wire.TierMatch("n1", wire.Tier.DRAM, 3)],
                     pending=[wire.PendingMatch("n2", 5)]),
    wire.LookupReply(status="recovering"),
    wire.ChecksumsRequest(request_id="r1", namespace="ns", node="p0", block_hashes=H * 2),
    wire.ChecksumsReply(request_id="r1", checksums=wire.pack_checksums([1, (1 << 64) - 1])),
    wire.BlocksAllocated(node="n1", seq=1, namespace="ns", blocks=[wire.BlockRef(H, b"", 256)]),
    wire.BlocksWriting(node="n1", seq=2, hashes=[H]),
    wire.BlocksSealed(node="n1", seq=3, seals=[wire.BlockSeal(H, 1024, 0xDEADBEEF)],
                      trace="00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"),
    wire.BlocksEvicted(node="n1", seq=4, hashes=[H]),
    wire.BlocksFailed(node="n1", seq=5, hashes=[H], reason="checksum"),
    wire.NodeCleared(node="n1", seq=6, tier=wire.Tier.GPU),
    wire.LeaseExpired(node="n1", seq=0, epoch=5, reason="no heartbeat"),
    wire.GpuBlocksStored(node="n1", seq=7, engine_hashes=[1, 2], parent_engine_hash=None,
                         tokens=wire.pack_tokens(range(32)), engine_block_size=16),
    wire.GpuBlocksRemoved(node="n1", seq=8, engine_hashes=[1]),
    wire.Reannounce(from_seq=4, reason="gap"),
    wire.BlocksVisible(namespace="ns", node="n1", tier=wire.Tier.DRAM, block_hashes=H),
    wire.BlockCopies(namespace="ns", shared=H, last=H, kvindex="k0", misses=12),
    wire.BlocksInvalidated(node="n1", reason="lease expired"),
    wire.Heartbeat(node="n1", role="prefill", started_unix_ms=1, lease_ttl_ms=5000,
                   ucx_address=b"\x01\x02", capacity_blocks=100),
    wire.LoadReport(node="n1", role="prefill", queue_depth=2, queued_new_tokens=300,
                    prefills=[wire.PrefillWork(100, 0, 3.5), wire.PrefillWork(200, 4096)],
                    prefill_token_cap=2048),
    wire.PrefillRequest(request_id="r1", reply_to="_INBOX.x", tokens=wire.pack_tokens([1]),
                        sampling=wire.SamplingParams(), namespace="ns", block_hashes=H,
                        decode_node="d0", deadline_unix_ms=123,
                        sources=[wire.LoadSource(node="n1", tier=wire.Tier.DRAM, first_block=0,
                                                 num_blocks=1)]),
    wire.DecodeRequest(request_id="r1", reply_to="_INBOX.x", tokens=wire.pack_tokens([1]),
                       first_token=7, sampling=wire.SamplingParams(), namespace="ns",
                       block_hashes=H, source_node="p0", lease_id="l1", deadline_unix_ms=9),
    wire.DecodeRequest(request_id="r2", reply_to="_INBOX.x", tokens=wire.pack_tokens([1]),
                       first_token=228, next_tokens=[189, 160],
                       sampling=wire.SamplingParams(), namespace="ns", block_hashes=H,
                       source_node="p0", lease_id="l1", deadline_unix_ms=9),
    wire.Accepted(request_id="r1", node="d0"),
    wire.HandoffAccepted(request_id="r1", seq=2, node="d0"),
    wire.ResetCache(reason="test"),
    wire.PullAck(request_id="r1", lease_id="l1"),
    wire.Cancel(request_id="r1"),
    wire.CancelGenerate(request_id="r1", reply_to="_INBOX_client.abc"),
    wire.SupersedeGenerate(request_id="r1", tenant="acme", resumed_tokens=12),
    wire.StatusRequest(),
    wire.StatusReply(router=wire.RouterStats(node="r0", policy="cpd", completed=3,
                                             paths={"cold": 1, "warm": 2}),
                     nodes=[wire.NodeStatus(node="p0", role="prefill", alive=True,
                                            est_queue_ms=12.0)], kvindex="recovering"),
    wire.BlockGet(xfer_id=7, hashes=H * 2, namespace="ns", timeout_ms=500),
    wire.BlockPut(xfer_id=8, namespace="ns", blocks=[wire.BlockRef(H, b"", 256)],
                  seals=[wire.BlockSeal(H, 1024, 0xDEADBEEF)], timeout_ms=500),
    wire.BlockReply(xfer_id=7, namespace="ns", blocks=[wire.BlockRef(H, b"", 256)],
                    seals=[wire.BlockSeal(H, 1024, 0xDEADBEEF)], accepted=b"\x01"),
    wire.BlockReply(xfer_id=9, ok=False, code="block_evicted", message="gone", missing=H),
]


def test_every_kind_has_a_sample() -> None:
    assert {m.__struct_config__.tag for m in SAMPLES} == wire.KINDS


@pytest.mark.parametrize("msg", SAMPLES, ids=lambda m: m.__struct_config__.tag)
def test_round_trip(msg: wire.Message) -> None:
    data = wire.encode(msg)
    assert wire.decode(data) == msg
    assert wire.decode(data, type(msg)) == msg


def test_expect_rejects_other_kinds() -> None:
    with pytest.raises(WrongKind):
        wire.decode(wire.encode(SAMPLES[0]), wire.LookupRequest)


def test_unknown_kind_is_typed_and_skippable() -> None:
    data = msgspec.msgpack.encode({"kind": "from_the_future", "v": 1, "x": 1})
    with pytest.raises(UnknownKind):
        wire.decode(data)


def test_other_schema_major_is_refused() -> None:
    data = msgspec.msgpack.encode({"kind": "token", "v": 2, "request_id": "r", "seq": 0,
                                   "token_ids": []})
    with pytest.raises(SchemaVersionError):
        wire.decode(data)


class _TokenChunkV1_1(msgspec.Struct, tag="token", tag_field="kind", kw_only=True):
    """What a later minor version could send: a field appended with a default."""

    v: int = 1
    request_id: str
    seq: int
    token_ids: list[int]
    text: str = ""
    draft_token_ids: list[int] = msgspec.field(default_factory=list)


def test_newer_minor_fields_are_ignored_by_older_readers() -> None:
    newer = _TokenChunkV1_1(request_id="r", seq=1, token_ids=[1], draft_token_ids=[5])
    old = wire.decode(msgspec.msgpack.encode(newer), wire.TokenChunk)
    assert old == wire.TokenChunk(request_id="r", seq=1, token_ids=[1])


def test_older_messages_get_defaults_in_newer_readers() -> None:
    older = wire.encode(wire.TokenChunk(request_id="r", seq=1, token_ids=[1]))
    newer = msgspec.msgpack.decode(older, type=_TokenChunkV1_1)
    assert newer.draft_token_ids == [] and newer.token_ids == [1]


def test_a_load_report_without_a_prefill_list_holds_nothing() -> None:
    """No ``prefills``: an empty list (the router prices an idle node); a field this
    reader lacks (a worker-side queue estimate) is ignored."""
    data = msgspec.msgpack.encode({"kind": "load", "v": 1, "node": "n1", "role": "prefill",
                                   "est_queue_ms": 40.0})
    report = wire.decode(data, wire.LoadReport)
    assert report == wire.LoadReport(node="n1", role="prefill") and report.prefills == []


@pytest.mark.parametrize("bad", [
    {"temperature": -1.0}, {"temperature": math.nan}, {"top_p": 0.0}, {"top_p": 1.5},
    {"max_tokens": 0}, {"max_tokens": -3}, {"top_k": -2}, {"stop_token_ids": [-1]},
])
def test_invalid_sampling_is_malformed(bad: dict) -> None:
    raw = {"kind": "generate", "v": 1, "request_id": "r", "prompt": "x",
           "sampling": {"max_tokens": 4, **bad}}
    with pytest.raises(MalformedMessage):
        wire.decode(msgspec.msgpack.encode(raw))


def test_missing_required_field_is_malformed() -> None:
    with pytest.raises(MalformedMessage):
        wire.decode(msgspec.msgpack.encode({"kind": "token", "v": 1, "seq": 0}))


@settings(max_examples=2000, deadline=None)
@given(st.binary(max_size=512))
def test_random_bytes_never_escape_as_untyped_errors(data: bytes) -> None:
    with contextlib.suppress(CpdError):
        wire.decode(data)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 2**32 - 1), max_size=300))
def test_token_packing_round_trips(tokens: list[int]) -> None:
    assert wire.unpack_tokens(wire.pack_tokens(tokens)).tolist() == tokens


def test_token_packing_rejects_out_of_range_and_odd_lengths() -> None:
    with pytest.raises(ValueError):
        wire.pack_tokens([-1])
    with pytest.raises(ValueError):
        wire.pack_tokens(np.array([2**32]))
    with pytest.raises(MalformedMessage):
        wire.unpack_tokens(b"\x00\x01\x02")


def test_hash_arrays() -> None:
    hs = [bytes([i]) * 16 for i in range(4)]
    assert wire.split_hashes(wire.join_hashes(hs)) == hs
    with pytest.raises(MalformedMessage):
        wire.split_hashes(b"x" * 17)
    with pytest.raises(ValueError):
        wire.join_hashes([b"short"])


def test_100k_token_prompt_fits_one_message() -> None:
    msg = wire.GenerateRequest(request_id="r", tokens=wire.pack_tokens(np.arange(100_000)))
    assert len(wire.encode(msg)) < 900 * 1024
