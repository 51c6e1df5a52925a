"""Readiness: when a started service is serving, not just running.

A NATS micro PING is answered before a service's ``setup()`` ends
(``cpd.bus.service.Service.start``), so each role adds its own probe: kvindex answers
a lookup with something other than ``recovering``, a worker heartbeats as the incarnation
just started, a router lists every worker alive.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Callable, Collection
from typing import Any

import nats.errors

from cpd.bus import Bus, connect
from cpd.client import Client
from cpd.ops.config import NatsSettings
from cpd.protocol import subjects, wire
from cpd.protocol.errors import CpdError
from tools.cluster.procs import Proc, last_log_line

# How often a probe asks again.
_POLL_S = 0.2
# How often a start names the processes still starting (engines take tens of seconds).
PROGRESS_EVERY_S = 10.0


async def wait_ready(url: str | None, service: str, node_id: str, timeout: float,
                     nats_settings: NatsSettings | None = None) -> None:
    """Wait until ``node_id`` of ``service`` answers a NATS micro PING; connects as the
    identity ``nats_settings`` names (secure set-ups), anonymously by default. A front
    end answers as its gateway, the last of its parts to start."""
    if service == "frontend":
        service = "gateway"
    nc = await connect(nats_settings or NatsSettings(), f"cpd-ready-{node_id}", url=url)
    try:
        deadline = time.monotonic() + timeout
        # A fresh reply subject per ping: with least-privilege NATS a service may answer
        # each reply subject once (allow_responses), so a reused one would be refused.
        base = nc.new_inbox()
        sub = await nc.subscribe(f"{base}.*")
        n = 0
        while time.monotonic() < deadline:
            n += 1
            await nc.publish(subjects.micro_ping(service), b"", reply=f"{base}.{n}")
            end = time.monotonic() + 0.5
            while (left := end - time.monotonic()) > 0:
                try:
                    msg = await sub.next_msg(timeout=left)
                except nats.errors.TimeoutError:
                    break
                with contextlib.suppress(ValueError, KeyError, TypeError):
                    if json.loads(msg.data)["metadata"]["node"] == node_id:
                        return
        raise CpdError(f"{service} ({node_id}) not ready within {timeout:.0f}s")
    finally:
        await nc.close()


async def until_ready(ready: asyncio.Future[Any], procs: list[Proc],
                      failed: Callable[[Proc], str | None]) -> None:
    """Await ``ready`` (e.g. a gather of :func:`wait_ready`) while watching ``procs``:
    the first process for which ``failed`` returns a message ends the wait with a
    :class:`CpdError` of that message, instead of waiting out the timeout."""
    try:
        while not ready.done():
            for p in procs:
                if (why := failed(p)) is not None:
                    raise CpdError(why)
            await asyncio.wait([ready], timeout=0.25)
        ready.result()
    finally:
        ready.cancel()
        with contextlib.suppress(BaseException):
            await ready


async def report_starting(procs: list[Proc], pending: Collection[str], t0: float,
                          report: Callable[[str], None]) -> None:
    """Every :data:`PROGRESS_EVERY_S` until cancelled, a line for each of ``procs`` still
    ``pending``: how long since ``t0`` (monotonic) and what its log says it is doing."""
    while True:
        await asyncio.sleep(PROGRESS_EVERY_S)
        elapsed = time.monotonic() - t0
        for p in procs:
            if p.node_id in pending:
                report(f"{p.node_id} starting ({elapsed:.0f} s): "
                       f"{last_log_line(p.log_path, since=p.log_offset)}")


async def kvindex_serving(bus: Bus, timeout: float) -> None:
    """Wait until kvindex answers a lookup and is done replaying the stream (a lookup
    during the replay answers ``recovering``; before ``setup()`` ends, none answers)."""
    # Any well-formed lookup will do: ``recovering`` is answered before it is read.
    probe = wire.LookupRequest(request_id="cpd-ready", namespace="0" * 32,
                               block_hashes=bytes(wire.HASH_BYTES))
    deadline = time.monotonic() + timeout
    status = "no answer"
    while time.monotonic() < deadline:
        with contextlib.suppress(CpdError):
            reply = await bus.request(subjects.KVINDEX_LOOKUP, probe, expect=wire.LookupReply,
                                      timeout=max(0.1, min(2.0, deadline - time.monotonic())))
            if reply.status != "recovering":
                return
            status = reply.status
        await asyncio.sleep(_POLL_S)
    raise CpdError(f"kvindex not serving within {timeout}s ({status})")


async def heartbeat_since(bus: Bus, node: str, since_ms: int,
                          timeout: float) -> wire.Heartbeat:
    """The first heartbeat of ``node`` from an incarnation started at or after
    ``since_ms`` (unix ms): a restarted worker is back, not its predecessor's echo."""
    sub = await bus.nc.subscribe(subjects.heartbeat(node))
    try:
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            try:
                msg = await sub.next_msg(timeout=left)
            except nats.errors.TimeoutError:
                break
            with contextlib.suppress(CpdError):
                if (hb := wire.decode(msg.data, wire.Heartbeat)).started_unix_ms >= since_ms:
                    return hb
        raise CpdError(f"{node} sent no heartbeat within {timeout}s")
    finally:
        with contextlib.suppress(Exception):
            await sub.unsubscribe()


async def router_sees(client: Client, nodes: Collection[str], timeout: float) -> None:
    """Wait until the router's status lists every one of ``nodes`` as alive."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(CpdError):
            status = await client.status(timeout_s=1.0)
            if set(nodes) <= {n.node for n in status.nodes if n.alive}:
                return
        await asyncio.sleep(_POLL_S)
    raise CpdError(f"the router did not see {sorted(nodes)} within {timeout:.0f}s")


__all__ = ["PROGRESS_EVERY_S", "heartbeat_since", "kvindex_serving", "report_starting",
           "router_sees", "until_ready", "wait_ready"]
