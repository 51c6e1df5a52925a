"""Which requests a client's message cancels. ``CancelGenerate``: only the one it names,
served here for the inbox it names (the inbox proves the sender is the client).
``SupersedeGenerate`` (a gateway resumed the request elsewhere): every stream of that
request and tenant that began with fewer resumed tokens than it holds."""

from __future__ import annotations

import asyncio

import pytest

from cpd.protocol import wire
from services.router.cancels import Cancels


def _req(request_id: str = "r1", tenant: str = "default", resumed: int = 0
         ) -> wire.GenerateRequest:
    return wire.GenerateRequest(request_id=request_id, tokens=wire.pack_tokens([1, 2]),
                                tenant=tenant,
                                resume_tokens=wire.pack_tokens(list(range(resumed))))


async def _serving(cancels: Cancels, req: wire.GenerateRequest, inbox: str,
                   seen: list[wire.CancelReason | None]) -> asyncio.Task[None]:
    async def serve() -> None:
        with cancels.running(req, inbox):
            try:
                await asyncio.sleep(5)
            except asyncio.CancelledError:
                seen.append(cancels.by_client())
                raise

    task = asyncio.create_task(serve())
    await asyncio.sleep(0)
    return task


@pytest.mark.parametrize("reason", [wire.CancelReason.CLIENT_GONE,
                                    wire.CancelReason.READER_GONE])
@pytest.mark.parametrize(("request_id", "reply_to", "cancelled"), [
    ("r1", "_INBOX.a", True),
    ("r1", "_INBOX.b", False),   # someone else's inbox: not the client
    ("r2", "_INBOX.a", False),   # not served here
])
async def test_a_cancel_needs_the_request_and_its_inbox(
        request_id: str, reply_to: str, cancelled: bool, reason: wire.CancelReason) -> None:
    """The client's own cancel, or its inbox found without a subscriber."""
    cancels = Cancels()
    seen: list[wire.CancelReason | None] = []
    task = await _serving(cancels, _req(), "_INBOX.a", seen)
    ended = (cancels.cancel(wire.CancelGenerate(request_id=request_id, reply_to=reply_to))
             if reason is wire.CancelReason.CLIENT_GONE
             else cancels.reader_gone(request_id, reply_to))
    assert ended == int(cancelled)
    if not cancelled:
        task.cancel()  # as a stopping router would: not the client's doing
    with pytest.raises(asyncio.CancelledError):
        await task
    assert seen == [reason if cancelled else None]
    # Ended: nothing is left to cancel.
    assert not cancels.cancel(wire.CancelGenerate(request_id="r1", reply_to="_INBOX.a"))
    assert not cancels.reader_gone("r1", "_INBOX.a")


# The streams served here: (request id, tenant, tokens it resumed from, inbox).
_STREAMS = [("r1", "acme", 0, "_INBOX.gw0"),     # the first stream, its gateway died
            ("r1", "acme", 5, "_INBOX.gw1"),     # resumed from 5 tokens
            ("r1", "other", 0, "_INBOX.gw2"),    # the same id, another tenant
            ("r2", "acme", 0, "_INBOX.gw3")]     # another request


@pytest.mark.parametrize(("msg", "ended"), [
    # Resumed from 5 tokens: the stream that began with none ends; the one that resumed
    # (5) stays, as do another tenant's and another request's.
    (wire.SupersedeGenerate(request_id="r1", tenant="acme", resumed_tokens=5), {0}),
    # A later resume, from 9: both earlier streams of acme's r1 end.
    (wire.SupersedeGenerate(request_id="r1", tenant="acme", resumed_tokens=9), {0, 1}),
    # From 0 tokens (nothing had arrived): no stream began with fewer.
    (wire.SupersedeGenerate(request_id="r1", tenant="acme", resumed_tokens=0), set()),
    (wire.SupersedeGenerate(request_id="r1", tenant="nobody", resumed_tokens=9), set()),
    (wire.SupersedeGenerate(request_id="r9", tenant="acme", resumed_tokens=9), set()),
])
async def test_a_resume_ends_the_earlier_streams_of_its_request_and_tenant(
        msg: wire.SupersedeGenerate, ended: set[int]) -> None:
    cancels = Cancels()
    seen: list[list[wire.CancelReason | None]] = [[] for _ in _STREAMS]
    tasks = [await _serving(cancels, _req(rid, tenant, resumed), inbox, seen[i])
             for i, (rid, tenant, resumed, inbox) in enumerate(_STREAMS)]
    assert cancels.cancel(msg) == len(ended)
    await asyncio.sleep(0)
    for i, task in enumerate(tasks):
        assert task.done() is (i in ended), i
        if i not in ended:
            task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert seen[i] == [wire.CancelReason.SUPERSEDED if i in ended else None], i
    assert not cancels._tasks  # every stream ended: none is left behind
