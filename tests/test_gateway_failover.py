"""A gateway killed under load: two gateway processes in front of one router, real NATS
and UCX, sim workers. Streams go to gateway 0 through :mod:`cpd.apiclient`; once each
has tokens, gateway 0 is killed with ``kill -9``. Every stream resumes on gateway 1 under
its own request id and ends with exactly the tokens the deterministic sim gives for its
prompt (none lost, none repeated), and the same text as a stream that never broke; the
router ends the dead gateway's earlier streams, which nobody reads any more. Streams
whose client does not resume end at the router too, once it finds their inboxes without
a subscriber."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator

import httpx
import numpy as np
import pytest

from cpd import apiclient
from cpd.protocol import subjects, wire
from tools.bench.faults import reference_tokens
from tools.bench.hostinfo import free_port
from tools.cluster import Cluster, ClusterSpec, NodeSpec

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

STREAMS = 12
MAX_TOKENS = 96
PROMPT_TOKENS = 400
ABANDONED, ABANDONED_TOKENS = 4, 3000


@pytest.fixture(scope="module")
async def cluster(tmp_path_factory: pytest.TempPathFactory
                  ) -> AsyncIterator[tuple[Cluster, list[str]]]:
    ports = [free_port(), free_port()]
    nodes = (NodeSpec("kvi", "kvindex"), NodeSpec("pp0", "preprefill"),
             NodeSpec("p0", "prefill"), NodeSpec("d0", "decode"), NodeSpec("router", "router"),
             *(NodeSpec(f"gateway-{i}", "gateway",
                        overrides=(f"gateway.port={port}", "gateway.host=127.0.0.1"))
               for i, port in enumerate(ports)))
    # Decode steps slowed four times so that every stream is still under way at the kill.
    spec = ClusterSpec(nodes=nodes, engine="sim", workdir=tmp_path_factory.mktemp("gwfail"),
                       overrides=("sim.time_scale=0.25", "dataplane.arena_bytes=67108864",
                                  "router.reader_check_interval_s=1"),
                       label="gateway-failover")
    async with Cluster(spec) as c:
        await c.connect()
        yield c, [f"http://127.0.0.1:{port}" for port in ports]


def _body(prompt: list[int]) -> dict:
    return {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
            "ignore_eos": True}


async def test_streams_survive_a_gateway_killed_under_them(
        cluster: tuple[Cluster, list[str]]) -> None:
    c, gateways = cluster
    rng = np.random.default_rng(5)
    prompts = [rng.integers(10, 30_000, PROMPT_TOKENS).tolist() for _ in range(STREAMS)]
    seen: dict[str, int] = {}

    def progress(r: apiclient.StreamResult) -> None:
        seen[r.request_id] = len(r.token_ids)

    async with httpx.AsyncClient(timeout=60) as http:
        tasks = [asyncio.create_task(apiclient.stream(
            http, gateways, "/v1/completions", _body(p), request_id=f"gwfail-{i}",
            on_chunk=progress)) for i, p in enumerate(prompts)]
        deadline = time.monotonic() + 60
        while len([n for n in seen.values() if n >= 2]) < STREAMS:
            assert time.monotonic() < deadline, seen
            assert not any(t.done() for t in tasks), "a stream ended before the kill"
            await asyncio.sleep(0.02)
        at_kill = dict(seen)
        c.kill("gateway-0")
        results = await asyncio.gather(*tasks)
        # The same prompts, never broken, on the gateway left.
        whole = await asyncio.gather(*(apiclient.stream(http, gateways[1:], "/v1/completions",
                                                        _body(p)) for p in prompts[:4]))
    for i, (prompt, r) in enumerate(zip(prompts, results, strict=True)):
        assert r.request_id == f"gwfail-{i}"
        assert r.gateways == gateways, r.gateways  # broke on gateway 0, resumed on 1
        assert r.token_ids == reference_tokens(prompt, MAX_TOKENS), (i, at_kill[r.request_id])
        assert r.finish_reason == "length"
        assert r.cpd is not None and r.cpd["request_id"] == r.request_id
        if i < len(whole):
            assert r.text == whole[i].text and whole[i].resumes == 0
    assert all(n < MAX_TOKENS for n in at_kill.values())  # each broke mid-stream
    reply = await c.bus.request(subjects.ROUTER_STATUS, wire.StatusRequest(),
                                expect=wire.StatusReply)
    assert reply.router.resumed >= STREAMS
    # The dead gateway's streams had no reader left: each resume ended its earlier
    # stream (those that had not ended on their own first).
    assert reply.router.cancelled.get(wire.CancelReason.SUPERSEDED, 0) >= STREAMS - 2, (
        reply.router.cancelled)


async def test_streams_of_a_dead_gateway_that_nobody_resumes_end_at_the_router(
        cluster: tuple[Cluster, list[str]]) -> None:
    """The gateway under four long streams killed, their client gone with it: the
    router finds their inboxes without a subscriber (two checks a second apart) and
    ends them and their nodes' work, instead of generating to the end for nobody."""
    c, gateways = cluster
    await c.restart("gateway-0")
    rng = np.random.default_rng(7)
    seen: dict[str, int] = {}

    def progress(r: apiclient.StreamResult) -> None:
        seen[r.request_id] = len(r.token_ids)

    async def never_resumed(i: int) -> None:  # one try: a broken stream is left alone
        body = {**_body(rng.integers(10, 30_000, PROMPT_TOKENS).tolist()),
                "max_tokens": ABANDONED_TOKENS}
        with contextlib.suppress(apiclient.StreamLost):
            await apiclient.stream(http, gateways[:1], "/v1/completions", body,
                                   request_id=f"abandoned-{i}", attempts=1,
                                   on_chunk=progress)

    async with httpx.AsyncClient(timeout=60) as http:
        tasks = [asyncio.create_task(never_resumed(i)) for i in range(ABANDONED)]
        deadline = time.monotonic() + 60
        while len([n for n in seen.values() if n >= 2]) < ABANDONED:
            assert time.monotonic() < deadline, seen
            await asyncio.sleep(0.02)
        c.kill("gateway-0")
        t_kill = time.monotonic()
        await asyncio.gather(*tasks)
    while True:
        reply = await c.bus.request(subjects.ROUTER_STATUS, wire.StatusRequest(),
                                    expect=wire.StatusReply)
        if reply.router.in_flight == 0:
            break
        assert time.monotonic() - t_kill < 20, reply.router
        await asyncio.sleep(0.2)
    assert reply.router.cancelled.get(wire.CancelReason.READER_GONE, 0) == ABANDONED, (
        reply.router.cancelled)
