"""A bare nats-py responder that answers every request on ``subjects.BENCH_ECHO`` with
the same bytes, decoding nothing: the floor of request/reply over NATS on this host.

``cpd bench kvindex`` runs it next to kvindex and sends it the same lookups at the same
rate, in alternating rounds, so kvindex's latency can be read against what NATS, nats-py
and the host cost with no service at all behind the subject.

Run as ``python -m bench.echo NATS_URL REPLY_HEX``.
"""

from __future__ import annotations

import asyncio
import sys

import nats
import uvloop
from nats.aio.msg import Msg

from cpd.protocol import subjects


async def serve(url: str, reply: bytes) -> None:
    """Answer every request on ``subjects.BENCH_ECHO`` with ``reply`` until killed."""
    nc = await nats.connect(url)

    async def on_request(msg: Msg) -> None:
        await nc.publish(msg.reply, reply)

    await nc.subscribe(subjects.BENCH_ECHO, cb=on_request)
    await nc.flush()
    await asyncio.Event().wait()


def main() -> None:
    """Entry point: ``python -m bench.echo NATS_URL REPLY_HEX``."""
    uvloop.run(serve(sys.argv[1], bytes.fromhex(sys.argv[2])))


if __name__ == "__main__":
    main()
