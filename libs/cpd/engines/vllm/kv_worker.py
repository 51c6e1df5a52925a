"""The worker half of CPD's vLLM KV connector: block copies between vLLM's paged KV
cache and the worker's shared-memory block arena, inside the step or on a loader thread
(a side CUDA stream on GPUs), with each loaded slot's checksum verified first. Each rank
of a tensor-parallel engine copies its own heads (:mod:`cpd.engines.vllm.kv_layout`)."""

from __future__ import annotations

import contextlib
import logging
import re
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np
import torch

from cpd.engines.vllm.kv_layout import ShardLayout, runs
from cpd.engines.vllm.kv_meta import CpdConnectorMetadata, Load
from cpd.kvstore import checksum

log = logging.getLogger(__name__)


class ConnectorWorker:
    """The worker side of one engine rank over the arena file ``arena_path`` of
    ``num_slots`` slots of ``slot_bytes``. A slot holds a whole block (every layer and
    KV head of the model: :mod:`cpd.engines.vllm.kv_layout`); this rank copies its
    share. ``get_finished``, ``get_block_ids_with_load_errors`` and ``shutdown`` mean
    what vLLM's ``KVConnectorBase_V1`` says."""

    def __init__(self, arena_path: str, num_slots: int, slot_bytes: int, *,
                 block_size: int, num_layers: int = 0, num_kv_heads: int = 0,
                 tp_size: int = 1) -> None:
        self.arena_path = arena_path
        self.num_slots = num_slots
        self.slot_bytes = slot_bytes
        self.block_size = block_size
        # The whole model's shape (0: this rank's own, for a single-rank engine).
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.tp_size = tp_size
        self.layout: ShardLayout | None = None
        self._arena: np.ndarray | None = None
        # Per layer of this rank: the engine's cache as bytes with blocks first, and this
        # rank's heads of every arena slot (a strided view into the arena).
        self._layers: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._on_gpu = False
        # Whether the arena is page-locked for the GPU's copy engines (DMA, asynchronous).
        self._pinned = False
        self._load_errors: set[int] = set()
        # The loader thread and its loads in flight, per request.
        self._loader: ThreadPoolExecutor | None = None
        self._inflight: dict[str, tuple[Future[set[int]], list[Load]]] = {}
        self._load_stream: Any = None

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor], *,
                           tp_rank: int = 0) -> None:
        """Map the engine's per-layer caches (of this ``tp_rank``) and the arena; one
        block of the whole model must be exactly one arena slot."""
        names = sorted(kv_caches, key=lambda n: (_layer_no(n), n))
        numbers = [_layer_no(n) for n in names]
        if min(numbers) < 0:  # unnumbered layers: the order of their names
            numbers = list(range(len(names)))
        caches = [_blocks_first(kv_caches[n].view(torch.uint8)) for n in names]
        block = caches[0][0]
        axis = _heads_axis(block.shape, self.block_size)
        heads = self.num_kv_heads or block.shape[axis] * self.tp_size
        self.layout = ShardLayout(
            num_layers=self.num_layers or len(names), num_kv_heads=heads,
            tp_size=self.tp_size, tp_rank=tp_rank,
            layer_bytes=block.numel() // block.shape[axis] * heads)
        lay = self.layout
        if block.shape[axis] != lay.local_heads:
            raise ValueError(f"rank {tp_rank} holds {block.shape[axis]} KV heads, not "
                             f"{lay.local_heads} of {heads} over {self.tp_size} ranks")
        if lay.slot_bytes != self.slot_bytes:
            raise ValueError(f"arena slot is {self.slot_bytes} bytes but one block of the "
                             f"model is {lay.layer_bytes} x {lay.num_layers} layers")
        self._arena = np.memmap(self.arena_path, dtype=np.uint8, mode="r+",
                                shape=(self.num_slots, self.slot_bytes))
        arena = torch.from_numpy(self._arena)
        whole = list(block.shape)
        whole[axis] = heads
        self._layers = []
        for no, cache in zip(numbers, caches, strict=True):
            off = lay.layer_offset(no)
            slots = arena[:, off:off + lay.layer_bytes].view(self.num_slots, *whole)
            mine = slots.narrow(axis + 1, lay.first_head, lay.local_heads)
            self._layers.append((cache, mine))
        self._on_gpu = caches[0].is_cuda
        if self._on_gpu:
            self._pinned = _pin(self._arena)

    def _copy(self, pairs: list[tuple[int, int]], *, save: bool) -> None:
        # One copy per layer and run of consecutive blocks and slots, straight between
        # the engine's cache and the arena (the device-to-host copy itself on a GPU).
        for block, slot, n in runs(pairs):
            for cache, slots in self._layers:
                if save:
                    slots[slot:slot + n].copy_(cache[block:block + n])
                else:
                    cache[block:block + n].copy_(slots[slot:slot + n], non_blocking=True)

    def _load(self, loads: list[Load]) -> set[int]:
        """Copies verified slots into their engine blocks; returns the blocks that
        failed their checksum (vLLM recomputes from the first one on)."""
        assert self._arena is not None
        bad = {block for block, slot, ck in loads
               if ck and checksum(self._arena[slot]) != ck}
        self._copy([(block, slot) for block, slot, _ in loads if block not in bad],
                   save=False)
        return bad

    def _load_off_step(self, loads: list[Load]) -> set[int]:
        # The loader thread. On a GPU the copies go to a side stream so the model's
        # kernels on the compute stream are not serialised behind them.
        on_gpu = self._on_gpu
        if on_gpu and self._load_stream is None:
            self._load_stream = torch.cuda.Stream(device=self._layers[0][0].device)
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
        assert self.layout is not None
        if meta.saves and self.layout.writes:
            self._copy(list(meta.saves), save=True)
            if self._on_gpu:
                torch.cuda.current_stream().synchronize()

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def shutdown(self) -> None:
        if self._loader is not None:
            self._loader.shutdown(wait=True)
            self._loader = None
        if self._pinned and self._arena is not None:
            torch.cuda.cudart().cudaHostUnregister(self._arena.ctypes.data)
            self._pinned = False


def _pin(arena: np.ndarray) -> bool:
    """Page-lock the arena's mapping for the GPU (``cudaHostRegister``): its copies then
    run on the copy engines, asynchronously, at the link's rate. Pageable memory still
    works (staged through a driver buffer), so a refusal is logged, not fatal."""
    err = torch.cuda.cudart().cudaHostRegister(arena.ctypes.data, arena.nbytes, 0)
    if int(err) != 0:
        log.warning("could not page-lock the %d-byte KV arena (CUDA error %s); its copies "
                    "are staged through pageable memory", arena.nbytes, err)
        return False
    return True


def _layer_no(name: str) -> int:
    """The model's index of a layer from its name (``model.layers.3.self_attn.attn``);
    pipeline stages keep the model's numbering."""
    m = re.search(r"\.(\d+)\.", name)
    return int(m.group(1)) if m else -1


def _blocks_first(t: torch.Tensor) -> torch.Tensor:
    # CPU attention keeps [num_blocks, kv_heads, block_size, 2*head]; layouts with K and
    # V split in front ([2, num_blocks, ...]) are viewed with the blocks first.
    return t if t.shape[0] != 2 else t.movedim(1, 0)


def _heads_axis(block: Sequence[int], block_size: int) -> int:
    """The KV-heads axis of one block's view: [heads, tokens, bytes] on CPU, [2, tokens,
    heads, bytes] (or [2, heads, tokens, bytes]) with K and V in front."""
    if len(block) == 3 and block[1] == block_size:
        return 0
    if len(block) == 4 and block[0] == 2 and (block[1] == block_size) != (block[2] == block_size):
        return 2 if block[1] == block_size else 1
    raise ValueError(f"unknown KV cache block layout {tuple(block)} "
                     f"(block size {block_size})")
