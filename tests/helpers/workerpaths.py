"""A request straight to one worker of a test cluster (no router), and the paths a prompt
takes through pre-prefill, prefill and decode, each asserted from the final message as
the router would assemble it: shared by the worker tests of every model preset.

``c`` is a cluster as these tests see it (:func:`view`): ``{"bus", "ns", "procs", "tmp"}``.
"""

from __future__ import annotations

import asyncio
import time

from cpd.protocol import subjects, wire
from cpd.protocol.hashing import Namespace, block_hashes
from services.router.outcome import Reports, RouterTimes, assemble
from tests.helpers.cluster import VllmCluster

BS = 256
MAX_TOKENS = 10
# "ptp" (a prefill node of two tensor-parallel ranks) is started by its own test.
NODES = {"pp0": "preprefill", "p0": "prefill", "d0": "decode", "ptp": "prefill"}


def view(c: VllmCluster) -> dict:
    """What these helpers use of a started cluster."""
    return {"bus": c.bus, "ns": c.ns, "procs": c.procs, "tmp": c.tmp}


async def ask(c: dict, node: str, prompt: list[int],
              sources: list[wire.LoadSource] = ()) -> tuple[list[int], wire.Final]:
    """``prompt`` run on ``node`` (greedy, :data:`MAX_TOKENS`), handed off to ``d0``:
    its tokens and the final message the router would assemble."""
    ns: Namespace = c["ns"]
    req = wire.PrefillRequest(
        request_id=f"r{time.monotonic_ns()}", reply_to="", tokens=wire.pack_tokens(prompt),
        sampling=wire.SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True),
        namespace=ns.id, block_hashes=block_hashes(ns, prompt), decode_node="d0",
        deadline_unix_ms=int(time.time() * 1000) + 300_000, sources=list(sources))
    msgs = [m async for m in c["bus"].stream(subjects.run(NODES[node], node), req,
                                             timeout=300)]
    tokens = [t for m in msgs if isinstance(m, wire.TokenChunk) for t in m.token_ids]
    assert [m.seq for m in msgs] == list(range(len(msgs)))
    # The final as the router would assemble it from the workers' reports.
    reports = Reports(
        prefill=next((m for m in msgs if isinstance(m, wire.PrefillReport)), None),
        decode=next((m for m in msgs if isinstance(m, wire.DecodeReport)), None))
    return tokens, assemble(wire.Route(), reports, msgs[-1], prompt_tokens=len(prompt),
                            completion_tokens=len(tokens), times=RouterTimes(), failovers=0)


async def _matches(c: dict, hashes: bytes) -> list[wire.TierMatch]:
    """kvindex's locations of the blocks ``hashes``."""
    r = await c["bus"].request(subjects.KVINDEX_LOOKUP, wire.LookupRequest(
        namespace=c["ns"].id, block_hashes=hashes), expect=wire.LookupReply)
    return r.matches


async def visible_on(c: dict, prompt: list[int], node: str,
                     tier: wire.Tier = wire.Tier.DRAM) -> int:
    """The blocks of ``prompt`` kvindex shows on ``node``'s ``tier`` (0 after 10 s)."""
    hashes = block_hashes(c["ns"], prompt)
    for _ in range(100):
        matches = await _matches(c, hashes)
        if hit := {(m.node, m.tier): m.num_blocks for m in matches}.get((node, tier), 0):
            return hit
        await asyncio.sleep(0.1)
    return 0


async def source_of(c: dict, prompt: list[int], node: str, num_blocks: int) -> wire.LoadSource:
    """What the router would plan: ``node``'s DRAM run with the read capability kvindex
    returns with the location (the node's data plane serves nothing without it)."""
    hashes = block_hashes(c["ns"], prompt)
    for _ in range(100):
        match = next((m for m in await _matches(c, hashes)
                      if (m.node, m.tier) == (node, wire.Tier.DRAM)
                      and m.num_blocks >= num_blocks and m.capability), None)
        if match is not None:
            return wire.LoadSource(node=node, tier=wire.Tier.DRAM, first_block=0,
                                   num_blocks=num_blocks, capability=match.capability)
        await asyncio.sleep(0.1)
    raise AssertionError(f"kvindex never showed {num_blocks} blocks with a capability on {node}")


async def reset_gpu_cache(c: dict, node: str) -> None:
    """Empty ``node``'s engine prefix cache."""
    await c["bus"].request(subjects.admin(NODES[node], node), wire.ResetCache(reason="test"),
                           expect=wire.Accepted)


async def every_path(c: dict, prompt: list[int], want: list[int], prefill: str = "p0"
                     ) -> None:
    """``prompt`` cold on pp0, then on ``prefill``: warm from pp0's DRAM, warm from its
    own DRAM, and from its engine's prefix cache: each path asserted from the final
    message, each output ``want``."""
    n = len(prompt)
    blocks = (n - 1) // BS  # the last prompt token is always computed
    cached = blocks * BS
    tokens, final = await ask(c, "pp0", prompt)  # cold
    r = final.route
    assert tokens == want, f"cold, {n} tokens"
    assert (r.prefill_node, r.tokens.computed, r.tokens.gpu) == ("pp0", n, 0)
    assert r.decode_tokens_pulled == n // BS * BS
    src = await source_of(c, prompt, "pp0", blocks)
    tokens, final = await ask(c, prefill, prompt, [src])  # warm, peer's DRAM
    r = final.route
    assert tokens == want, f"warm-remote, {n} tokens"
    assert (r.tokens.remote, r.tokens.dram, r.tokens.computed) == (cached, 0, n - cached)
    await reset_gpu_cache(c, prefill)
    tokens, final = await ask(c, prefill, prompt)  # warm, own DRAM
    r = final.route
    assert tokens == want, f"warm-local-DRAM, {n} tokens"
    assert (r.tokens.dram, r.tokens.gpu, r.tokens.remote) == (cached, 0, 0)
    tokens, final = await ask(c, prefill, prompt)  # warm, GPU prefix cache
    r = final.route
    assert tokens == want, f"GPU hit, {n} tokens"
    assert (r.tokens.gpu, r.tokens.dram, r.tokens.remote) == (cached, 0, 0)
    assert r.tokens.computed == n - cached
