"""Which request a client's ``CancelGenerate`` cancels: only the one it names, served
here for the inbox it names (the inbox proves the sender is the client)."""

from __future__ import annotations

import asyncio

import pytest

from cpd.protocol import wire
from services.router.cancels import Cancels


@pytest.mark.parametrize(("request_id", "reply_to", "cancelled"), [
    ("r1", "_INBOX.a", True),
    ("r1", "_INBOX.b", False),   # someone else's inbox: not the client
    ("r2", "_INBOX.a", False),   # not served here
])
async def test_a_cancel_needs_the_request_and_its_inbox(request_id: str, reply_to: str,
                                                        cancelled: bool) -> None:
    cancels = Cancels()
    seen: list[bool] = []

    async def serve() -> None:
        with cancels.running("r1", "_INBOX.a"):
            try:
                await asyncio.sleep(5)
            except asyncio.CancelledError:
                seen.append(cancels.by_client())
                raise

    task = asyncio.create_task(serve())
    await asyncio.sleep(0)
    assert cancels.cancel(wire.CancelGenerate(request_id=request_id,
                                              reply_to=reply_to)) is cancelled
    if not cancelled:
        task.cancel()  # as a stopping router would: not the client's doing
    with pytest.raises(asyncio.CancelledError):
        await task
    assert seen == [cancelled]
    # Ended: nothing is left to cancel.
    assert not cancels.cancel(wire.CancelGenerate(request_id="r1", reply_to="_INBOX.a"))
