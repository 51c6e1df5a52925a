"""The prefix loader's check of pulled bytes against kvindex's record: what it asks, how
long it waits for seals on their way, and that the pull gets the record (never the
peer's word). The transfer itself is ``tests/test_transfer.py``'s; the whole path on
real services is ``tests/test_router_e2e.py``'s (warm loads from a peer)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from cpd.protocol import subjects, wire
from cpd.protocol.errors import RequestTimeout
from services.worker import loader as loader_mod
from services.worker.loader import PrefixLoader
from services.worker.peers import Peers

H = [bytes([i]) * 16 for i in range(4)]


class _Kvindex:
    """kvindex's checksums endpoint, answering from a script: each answer a list of
    checksums (fewer than asked: seals still on their way) or an error to raise."""

    def __init__(self, *answers: list[int] | Exception, delay_s: float = 0.0) -> None:
        self.answers = list(answers)
        self.delay_s = delay_s
        self.asked: list[wire.ChecksumsRequest] = []

    async def request(self, subject: str, msg: wire.Message, **_: Any) -> wire.ChecksumsReply:
        assert subject == subjects.KVINDEX_CHECKSUMS and isinstance(msg, wire.ChecksumsRequest)
        self.asked.append(msg)
        await asyncio.sleep(self.delay_s)
        answer = self.answers.pop(0) if len(self.answers) > 1 else self.answers[0]
        if isinstance(answer, Exception):
            raise answer
        return wire.ChecksumsReply(checksums=wire.pack_checksums(answer))


def _loader(bus: Any, client: Any = None) -> PrefixLoader:
    peers = Peers("p0", "prefill", heartbeat_interval_s=1.0, connect_ahead_delay_s=0.0)
    peers.addresses["pp0"] = b"addr"
    return PrefixLoader("prefill", kv=None, client=client, peers=peers,  # type: ignore[arg-type]
                        bus=bus, audit=None)


@pytest.mark.parametrize("answers, expected, asks", [
    ([[11, 12, 13]], [11, 12, 13], 1),                 # all recorded: one question
    ([[11], [11, 12], [11, 12, 13]], [11, 12, 13], 3),  # seals on their way: asked again
    ([[11]], [11, -1, -1], None),                      # never recorded: recomputed
    ([RequestTimeout("slow")], [-1, -1, -1], None),    # kvindex unreachable: recomputed
])
async def test_a_pull_is_checked_against_what_kvindex_recorded(
        monkeypatch: pytest.MonkeyPatch, answers: list, expected: list[int],
        asks: int | None) -> None:
    monkeypatch.setattr(loader_mod, "_RECORD_WAIT_S", 0.1)
    kvi = _Kvindex(*answers)
    got = await _loader(kvi).recorded("r1", "ns", "pp0", H[:3])
    assert got == dict(zip(H[:3], expected, strict=True))
    assert all((a.node, a.namespace, a.block_hashes) == ("pp0", "ns", b"".join(H[:3]))
               for a in kvi.asked)
    if asks is not None:
        assert len(kvi.asked) == asks


class _Client:
    """A transfer client that lands the bytes, then awaits ``expected`` as the real one
    does (or fails before it needs it)."""

    def __init__(self, fail: Exception | None = None) -> None:
        self.fail = fail
        self.vouched: dict[bytes, int] | None = None

    async def pull(self, address: bytes, hashes: list[bytes], store: Any, *,
                   expected: Any, **_: Any) -> list[wire.BlockSeal]:
        await asyncio.sleep(0.01)  # the bytes travel
        if self.fail is not None:
            raise self.fail
        self.vouched = dict(await expected())
        return [wire.BlockSeal(h, 64, self.vouched[h]) for h in hashes]


async def test_the_pull_gets_kvindexs_record_asked_while_the_bytes_travel() -> None:
    kvi = _Kvindex([21, 22])
    client = _Client()
    got, failure = await _loader(kvi, client).pull("prefix", "pp0", H[:2], namespace="ns",
                                                   capability=b"cap", request_id="r1")
    assert (got, failure) == (2, None)
    assert client.vouched == {H[0]: 21, H[1]: 22}
    assert [a.request_id for a in kvi.asked] == ["r1"]


async def test_a_failed_pull_leaves_no_record_lookup_behind() -> None:
    from cpd.protocol.errors import PeerGone

    before = len(asyncio.all_tasks())
    kvi = _Kvindex([21, 22], delay_s=30.0)  # kvindex still thinking when the pull fails
    got, failure = await asyncio.wait_for(_loader(kvi, _Client(PeerGone("gone"))).pull(
        "prefix", "pp0", H[:2], namespace="ns", capability=b"cap"), 5.0)
    assert got == 0 and failure is not None and failure.code == "peer_gone"
    assert len(kvi.asked) == 1 and len(asyncio.all_tasks()) == before
