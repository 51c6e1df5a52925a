"""How vLLM is started on the locally built model (shared by checks, benches, engines)."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def prepare_cpu_env(kv_cache_gib: int = 1, *, cpu: bool = True) -> None:
    """Environment vLLM needs before import: offline model files and quiet stats; on a
    CPU (``cpu``) also a bounded KV cache and the compile cache that loads back."""
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    if cpu:
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(kv_cache_gib))
        # vLLM-CPU's AOT-compiled model never loads back from its cache (its artifact has
        # no ``finalize_loading``), so each start compiled the model again: 10-25 s per
        # engine. The classic torch.compile cache does load: a restart warms up in ~4 s.
        os.environ.setdefault("VLLM_USE_AOT_COMPILE", "0")


def engine_thread_env(threads: int, cpus: Sequence[int] = ()) -> dict[str, str]:
    """OpenMP settings of an engine's model process: ``threads`` threads (0: one per CPU
    of ``cpus``), bound to ``cpus`` one place each when given. Read by the process's
    OpenMP runtime when it starts, so they are set before the engine spawns it."""
    env = {}
    n = threads or len(cpus)
    if n:
        env["OMP_NUM_THREADS"] = str(n)
    if cpus:
        env["OMP_PLACES"] = ",".join(f"{{{c}}}" for c in cpus)
        env["OMP_PROC_BIND"] = "close"
    return env


def engine_kwargs(folder: str | os.PathLike[str], *, dtype: str = "float32",
                  prefix_caching: bool = True, max_model_len: int | None = None) -> dict[str, Any]:
    """Keyword arguments for ``vllm.LLM`` / ``AsyncEngineArgs`` on a local model folder."""
    cfg = json.loads((Path(folder) / "config.json").read_text())
    return {
        "model": str(folder),
        "tokenizer": str(folder),
        "dtype": dtype,
        "max_model_len": max_model_len or cfg["max_position_embeddings"],
        "enable_prefix_caching": prefix_caching,
        # A share of one NUMA node on CPU; above free memory vLLM-CPU refuses to start.
        "gpu_memory_utilization": 0.15,
        "seed": 0,
    }
