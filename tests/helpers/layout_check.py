"""CPD's KV connector on vLLM-CPU engines of other layouts than the default one, and
prints JSON results. A subprocess of tests/test_connector_layouts.py. Each engine runs in
a phase process of its own (``phase`` as the first argument), one after another over the
same arena.

``tp``: blocks moving between a tensor-parallel and a single-rank engine:

1. TP=1 generates the prompt plainly and saves its blocks to slots 0-4;
2. TP=2 (two ranks, one core each) generates plainly, saves to slots 8-12, then loads
   TP=1's blocks from slots 0-4 in place of computing them;
3. TP=1 loads TP=2's blocks from slots 8-12.

Greedy outputs must all be equal, and the two engines' saved bytes must agree.

``variants``: per model variant (the ``small`` preset, bfloat16 weights, an 8-bit KV
cache), a plain run, a saving run and a run loading the saved blocks.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

import numpy as np

BLOCK = 256
SLOTS = 16
PROMPT_BLOCKS = 5


def _prompt() -> list[int]:
    return np.random.default_rng(0).integers(0, 1900, size=PROMPT_BLOCKS * BLOCK + 77).tolist()


VARIANTS = {  # name: (preset, model dtype, KV cache dtype)
    "small": ("small", "float32", "auto"),
    "bfloat16": ("tiny", "bfloat16", "auto"),
    "fp8_kv": ("tiny", "float32", "fp8"),
}
DEFAULT = ("tiny", "float32", "auto")


def _slot_bytes(variant: tuple[str, str, str] = DEFAULT) -> int:
    from cpd.engines.profile import DTYPE_BYTES
    from cpd.modelbuild import PRESETS

    preset, dtype, kv = variant
    return BLOCK * PRESETS[preset].kv_bytes_per_token(DTYPE_BYTES[dtype if kv == "auto"
                                                                  else kv])


def phase(model_cache: str, arena_path: str, tp: int, save: list[int],
          load: list[int], checksums: list[int],
          variant: tuple[str, str, str] = DEFAULT) -> None:
    """One engine of ``tp`` ranks: a plain run, then a saving and a loading run."""
    from cpd.modelbuild.runtime import engine_kwargs, prepare_cpu_env

    prepare_cpu_env()
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(str(r % os.cpu_count()) for r in
                                                     range(tp))
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    from cpd.modelbuild import build

    preset, dtype, kv_cache_dtype = variant
    from cpd.engines.vllm.cpu import check_kv_cache_dtype, cpu_flags
    from cpd.protocol.errors import ConfigError

    try:  # as a worker's VllmEngine does before it starts vLLM on a CPU
        check_kv_cache_dtype(kv_cache_dtype, cpu_flags())
    except ConfigError:
        print("RESULT " + json.dumps({"refused": "config_error"}), flush=True)
        return
    folder = build(preset, model_cache)
    llm = LLM(**engine_kwargs(folder, dtype=dtype, prefix_caching=True), block_size=BLOCK,
              tensor_parallel_size=tp, distributed_executor_backend="mp",
              kv_cache_dtype=kv_cache_dtype,
              kv_transfer_config=KVTransferConfig(
                  kv_connector="CpdConnector",
                  kv_connector_module_path="cpd.engines.vllm.connector",
                  kv_role="kv_both", kv_load_failure_policy="recompute",
                  kv_connector_extra_config={"arena_path": arena_path, "num_slots": SLOTS,
                                             "slot_bytes": _slot_bytes(variant)}))

    def gen(params: dict | None, reset: bool = True) -> dict[str, Any]:
        if reset:
            llm.reset_prefix_cache()
        out = llm.generate([{"prompt_token_ids": _prompt()}], SamplingParams(
            temperature=0, max_tokens=16, ignore_eos=True,
            extra_args={"kv_transfer_params": {"cpd": params}} if params else None),
            use_tqdm=False)[0]
        return {"tokens": list(out.outputs[0].token_ids),
                "cpd": (out.kv_transfer_params or {}).get("cpd"),
                "cached_tokens": out.num_cached_tokens}

    result = {"plain": gen(None)}
    if save:
        result["save"] = gen({"save": save})
        # The same blocks from vLLM's own prefix cache: what a load must reproduce
        # bit for bit (in 16-bit floats a prefix hit may round otherwise than one prefill).
        result["gpu_hit"] = gen(None, reset=False)
    if load:
        if not checksums:  # the blocks this engine just saved
            from cpd.kvstore import checksum

            arena = np.memmap(arena_path, dtype=np.uint8, mode="r",
                              shape=(SLOTS, _slot_bytes(variant)))
            checksums = [checksum(arena[s]) for s in load]
        result["load"] = gen({"load": load, "load_checksums": checksums})
    print("RESULT " + json.dumps(result), flush=True)


def _run_phase(model_cache: str, arena_path: str, tp: int, save: list[int],
               load: list[int], checksums: list[int],
               variant: tuple[str, str, str] = DEFAULT) -> dict[str, Any]:
    out = subprocess.run([sys.executable, __file__, "phase", model_cache, arena_path,
                          json.dumps([tp, save, load, checksums, variant])],
                         capture_output=True, text=True, timeout=400)
    line = next((x for x in out.stdout.splitlines() if x.startswith("RESULT ")), None)
    if line is None:
        raise SystemExit(out.stdout[-3000:] + out.stderr[-6000:])
    return json.loads(line[len("RESULT "):])


def variants(model_cache: str, arena_path: str) -> None:
    """Each variant saves the prompt's blocks and loads them back."""
    results = {}
    slots = list(range(PROMPT_BLOCKS))
    for name, variant in VARIANTS.items():
        np.memmap(arena_path, dtype=np.uint8, mode="w+",
                  shape=(SLOTS, _slot_bytes(variant))).flush()
        results[name] = _run_phase(model_cache, arena_path, 1, slots, slots, [], variant)
        results[name]["slot_bytes"] = _slot_bytes(variant)
    print("RESULT " + json.dumps(results))


def tensor_parallel(model_cache: str, arena_path: str) -> None:
    """TP=1 and TP=2 engines load each other's blocks."""
    from cpd.kvstore import checksum
    from cpd.modelbuild import PRESETS

    slot_bytes = _slot_bytes()
    np.memmap(arena_path, dtype=np.uint8, mode="w+", shape=(SLOTS, slot_bytes)).flush()
    arena = np.memmap(arena_path, dtype=np.uint8, mode="r", shape=(SLOTS, slot_bytes))
    tp1_slots, tp2_slots = list(range(PROMPT_BLOCKS)), list(range(8, 8 + PROMPT_BLOCKS))
    results: dict[str, Any] = {"tp1": _run_phase(model_cache, arena_path, 1, tp1_slots, [], [])}
    results["tp2"] = _run_phase(model_cache, arena_path, 2, tp2_slots, tp1_slots,
                                [checksum(arena[s]) for s in tp1_slots])
    results["tp1_loads_tp2"] = _run_phase(model_cache, arena_path, 1, [], tp2_slots,
                                          [checksum(arena[s]) for s in tp2_slots])
    # The two engines' blocks: byte for byte in layer 0 (its K and V come straight from
    # the embeddings: no all-reduce before them), within float rounding after it.
    layers = PRESETS["tiny"].num_hidden_layers
    one = arena[tp1_slots].view(np.float32).reshape(PROMPT_BLOCKS, layers, -1)
    two = arena[tp2_slots].view(np.float32).reshape(PROMPT_BLOCKS, layers, -1)
    results["layer0_equal"] = bool(np.array_equal(one[:, 0], two[:, 0]))
    results["max_abs_diff"] = float(np.abs(one - two).max())
    results["max_abs"] = float(np.abs(one).max())
    print("RESULT " + json.dumps(results))


if __name__ == "__main__":
    if sys.argv[1] == "phase":
        tp, save, load, cks, var = json.loads(sys.argv[4])
        phase(sys.argv[2], sys.argv[3], tp, save, load, cks, tuple(var))
    else:
        {"tp": tensor_parallel, "variants": variants}[sys.argv[3]](*sys.argv[1:3])
