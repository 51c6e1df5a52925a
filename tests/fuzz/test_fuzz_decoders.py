"""Property tests of the pure decoders every service relies on: whatever the bytes, the
answer is a message or a typed :class:`~cpd.protocol.errors.CpdError`, never another exception.
Also the corpus generator itself (deterministic, and its msgpack writer is msgpack)."""

from __future__ import annotations

import contextlib
import math

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cpd import transfer
from cpd.protocol import subjects, wire
from cpd.protocol.errors import CpdError
from cpd.transfer import framing
from tools import fuzzing
from tools.bench.fuzz import expected_rejection

pytestmark = pytest.mark.timeout(120)

_FAST = settings(max_examples=2000, deadline=None, derandomize=True, database=None,
                 suppress_health_check=list(HealthCheck))
_FEW = settings(max_examples=150, deadline=None, derandomize=True, database=None,
                suppress_health_check=list(HealthCheck))
KINDS = [f.kind for f in fuzzing.FAMILIES.values()]


def _decodes_or_refuses(data: bytes, kind: type[wire.Message] | None) -> None:
    with contextlib.suppress(CpdError):
        wire.decode(data, kind)


@_FAST
@given(data=st.binary(max_size=2048), kind=st.sampled_from([None, *KINDS]))
def test_random_bytes_decode_or_raise_typed(data: bytes, kind: type | None) -> None:
    _decodes_or_refuses(data, kind)


@_FEW
@given(family=st.sampled_from(sorted(fuzzing.FAMILIES)), seed=st.integers(0, 2**32))
def test_corpus_cases_decode_or_raise_typed(family: str, seed: int) -> None:
    kind = fuzzing.FAMILIES[family].kind
    for case in fuzzing.cases(family, 20, seed):
        _decodes_or_refuses(case.data, kind)


def test_deep_nesting_is_a_typed_error() -> None:
    """Found by this fuzzer: msgspec raised RecursionError on deeply nested input."""
    nested = b"\x81\xa4kind" + b"\x91" * 100_000 + b"\x00"
    with pytest.raises(CpdError):
        wire.decode(nested)


@_FEW
@given(family=st.sampled_from(sorted(fuzzing.FAMILIES)), seed=st.integers(0, 2**16))
def test_corpus_is_deterministic(family: str, seed: int) -> None:
    assert fuzzing.cases(family, 30, seed) == fuzzing.cases(family, 30, seed)


def test_corpus_mixes_every_category() -> None:
    for family in fuzzing.FAMILIES:
        got = {c.category for c in fuzzing.cases(family, 2000, 1)}
        assert got == {"random", "bytes", "struct", "hostile", "oversized", "valid"}, family


_plain = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1)
    | st.floats(allow_nan=False) | st.text(max_size=40) | st.binary(max_size=40),
    lambda inner: st.lists(inner, max_size=5)
    | st.dictionaries(st.text(max_size=10), inner, max_size=5),
    max_leaves=30)


@settings(max_examples=500, deadline=None, derandomize=True, database=None,
          suppress_health_check=list(HealthCheck))
@given(value=_plain)
def test_pack_is_msgpack(value: object) -> None:
    assert msgspec.msgpack.decode(fuzzing.pack(value)) == value


def test_pack_writes_what_msgspec_refuses() -> None:
    raw = fuzzing.pack({"s": fuzzing.RawStr(b"\xff"), "n": math.nan})
    with pytest.raises(msgspec.DecodeError):
        msgspec.msgpack.decode(raw)  # invalid UTF-8 in a str


@_FAST
@given(data=st.binary(max_size=512))
def test_transfer_header_decoder_is_typed(data: bytes) -> None:
    cap = transfer.header_capacity(16)
    framed = (framing.LENGTH.pack(len(data)) + data)[:cap]
    buf = bytearray(cap)
    buf[:len(framed)] = framed
    with contextlib.suppress(CpdError):
        framing.unframe(buf, wire.Message)


@_FAST
@given(address=st.binary(max_size=64) | st.text(max_size=64))
def test_ucx_address_decoder_is_typed(address: bytes | str) -> None:
    try:
        host, port = transfer.decode_address(address)
    except CpdError:
        return
    assert host and 0 < port < 65536


@_FAST
@given(value=st.text(max_size=300))
def test_reply_subjects_cannot_inject_protocol(value: str) -> None:
    try:
        subjects.check_reply_subject(value)
    except ValueError:
        return
    assert value.isascii() and not any(c.isspace() for c in value)
    assert all(t and t not in ("*", ">") for t in value.split("."))


@_FAST
@given(data=st.binary(max_size=256))
def test_packed_arrays_are_typed(data: bytes) -> None:
    for fn in (wire.unpack_tokens, wire.split_hashes):
        with contextlib.suppress(CpdError):
            fn(data)


def _hb(node: str) -> bytes:
    return wire.encode(wire.Heartbeat(node=node, role="prefill", started_unix_ms=1,
                                      lease_ttl_ms=1000))


@pytest.mark.parametrize(("data", "kind", "subject", "code"), [
    (_hb("fz0"), wire.Heartbeat, subjects.heartbeat("fz0"), None),
    (_hb("fz1"), wire.Heartbeat, subjects.heartbeat("fz0"), "forged_sender"),
    (wire.encode(wire.LoadReport(node="fz0", role="decode")), wire.LoadReport,
     subjects.load("prefill", "fz0"), "forged_sender"),
    (_hb("fz1"), wire.Heartbeat, subjects.GENERATE, None),  # not a node's own subject
    (b"\xc1", wire.Heartbeat, subjects.heartbeat("fz0"), "malformed"),
])
def test_the_fuzzer_expects_what_a_receiver_refuses(data: bytes, kind: type[wire.Message],
                                                    subject: str, code: str | None) -> None:
    assert expected_rejection(data, kind, subject) == code
