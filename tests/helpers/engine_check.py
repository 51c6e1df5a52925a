"""Drives cpd.engines.vllm.engine.VllmEngine (AsyncLLM + CPD's connector) on the local
model and prints JSON results (a subprocess of tests/test_vllm_engine.py)."""

from __future__ import annotations

import asyncio
import json
import os
import sys

import numpy as np


async def run(model_cache: str, arena_path: str) -> dict:
    from cpd.engines import ArenaSpec, EngineRequest
    from cpd.engines.vllm.connector import checksum
    from cpd.engines.vllm.engine import VllmEngine
    from cpd.modelbuild import PRESETS, build
    from cpd.ops.config import EngineSettings
    from cpd.protocol import wire

    folder = build("tiny", model_cache)
    bs, slots = 256, 8
    slot_bytes = bs * PRESETS["tiny"].kv_bytes_per_token()
    arena = np.memmap(arena_path, dtype=np.uint8, mode="w+", shape=(slots, slot_bytes))
    # [engine] settings as a worker passes them (a shorter context, a smaller batch).
    settings = EngineSettings(max_model_len=4096, max_num_seqs=4, max_num_batched_tokens=4096)
    engine = VllmEngine(folder, block_size=bs, arena=ArenaSpec(arena_path, slots, slot_bytes),
                        engine=settings)
    rpc_path = os.environ.get("VLLM_RPC_BASE_PATH")
    await engine.start()
    prompt = np.random.default_rng(3).integers(0, 1900, size=3 * bs + 5).tolist()
    greedy = wire.SamplingParams(max_tokens=10, ignore_eos=True)

    async def gen(rid: str, **kw: object) -> dict:
        steps = [s async for s in engine.generate(EngineRequest(rid, prompt, greedy, **kw))]
        last = steps[-1]
        return {"tokens": [t for s in steps for t in s.token_ids], "steps": len(steps),
                "finished": last.finished, "reason": last.finish_reason,
                "cached": last.cached_tokens, "loaded": last.loaded_blocks,
                "saved": last.saved_blocks}

    sched = engine._llm.vllm_config.scheduler_config
    out = {"max_model_len": engine.max_model_len, "max_num_seqs": sched.max_num_seqs,
           "max_num_batched_tokens": sched.max_num_batched_tokens, "plain": await gen("a")}
    out["save"] = await gen("b", save_slots=[0, 1, 2])
    await engine._llm.reset_prefix_cache()
    cks = [checksum(arena[i]) for i in range(3)]
    out["load"] = await gen("c", load_slots=[0, 1, 2], load_checksums=cks)
    # Abort: the stream ends early and the engine keeps serving.
    long = wire.SamplingParams(max_tokens=2000, ignore_eos=True)
    got = 0
    async for step in engine.generate(EngineRequest("d", prompt, long)):
        got += len(step.token_ids)
        if got >= 3:
            await engine.abort("d")
    out["aborted_tokens"] = got
    out["after_abort"] = await gen("e")
    # Runs that end once their text is whole: after a whole character ("a", 97), or at
    # max_tokens while every token is a lone lead byte (228), each forced by logit_bias;
    # and the same "a" run without asking.
    for name, token, whole in (("whole_a", 97, True), ("whole_half", 228, True),
                               ("plain_a", 97, False)):
        s = wire.SamplingParams(max_tokens=4, ignore_eos=True, logit_bias={token: 100.0})
        steps = [x async for x in engine.generate(
            EngineRequest(name, prompt, s, until_whole_text=whole))]
        out[name] = {"tokens": [t for x in steps for t in x.token_ids],
                     "reason": steps[-1].finish_reason,
                     "connector_figures": steps[-1].scheduled_at > 0}
    out["stops_at_whole_text"] = engine.stops_at_whole_text
    sockets = engine._sockets
    out["sockets_while_running"] = len(os.listdir(sockets))
    await engine.stop()
    out["sockets_left"] = os.path.exists(sockets)
    out["rpc_path_restored"] = os.environ.get("VLLM_RPC_BASE_PATH") == rpc_path
    return out


if __name__ == "__main__":
    print("RESULT " + json.dumps(asyncio.run(run(sys.argv[1], sys.argv[2]))))
