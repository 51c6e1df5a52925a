"""CPD's vLLM KV connector (``KVConnectorBase_V1``, loaded by ``kv_connector_module_path``).

It moves whole cache blocks between vLLM's paged KV cache and the worker's host-DRAM
block arena, a shared-memory file that the CPD worker process also maps (it serves
peers over UCX and fills slots pulled from them). All network I/O stays in the worker
process; the connector only copies memory, so engine steps never wait on a peer.

What a request asks for travels in ``SamplingParams.extra_args["kv_transfer_params"]
["cpd"]`` (set by :mod:`cpd.engines.vllm.engine`):

* ``load``: arena slots (and checksums) holding the request's first blocks, in order.
  The scheduler side reports them as external hits beyond what vLLM's own prefix cache
  already holds; the worker side verifies each slot's checksum before copying it in and
  reports failures through ``get_block_ids_with_load_errors`` so vLLM recomputes them.
* ``save``: arena slot per prompt block index (or -1): when a step completes a full
  prompt block, its KV is copied out to that slot (write-through), before the step ends.

Loads run in one of two ways (extra config ``async_load``, the worker's
``worker.async_kv_load``):

* inside the step that first schedules the request (vLLM's synchronous external hit):
  every request in that step waits for the copy;
* off the step: the request waits in vLLM's ``WAITING_FOR_REMOTE_KVS`` while a loader
  thread copies its blocks (on a side CUDA stream on GPUs) and the batch keeps stepping;
  ``get_finished`` hands it back once its blocks are in, failed blocks included (vLLM
  recomputes from the first one). A decode node receiving whole 100K-token prompts
  would otherwise stall its batch for each prompt's copy.

Engine block size must equal CPD's cache block size (one engine block = one CPD block).
"""

from __future__ import annotations

import contextlib
import logging
import re
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from cpd.kvstore import checksum

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

PARAMS_KEY = "cpd"

log = logging.getLogger(__name__)

# (engine block, arena slot, checksum; 0: not verified)
_Load = tuple[int, int, int]


@dataclass
class CpdConnectorMetadata(KVConnectorMetadata):
    """One step's copies: blocks to load inside the step; per request, blocks to load
    off the step; (engine block, slot) to save."""

    loads: list[_Load] = field(default_factory=list)
    async_loads: dict[str, list[_Load]] = field(default_factory=dict)
    saves: list[tuple[int, int]] = field(default_factory=list)


@dataclass
class _ReqState:
    load_slots: list[int]
    load_checksums: list[int]
    save_slots: list[int]
    prompt_blocks: int
    first_load: int = 0      # blocks below this were already in vLLM's prefix cache
    num_load: int = 0        # blocks loaded from the arena
    block_ids: list[int] = field(default_factory=list)
    saved_upto: int = 0      # prompt blocks [0, saved_upto) handled for saving
    saved: int = 0
    load_failed: int = 0
    # Blocks from this index on failed verification once: never offered again.
    load_limit: int | None = None
    load_queued: bool = False  # its loads are in some step's metadata already
    load_async: bool = False


class CpdConnector(KVConnectorBase_V1):
    """Block copies between vLLM's paged cache and CPD's shared-memory arena."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole,
                 kv_cache_config: KVCacheConfig | None = None) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        extra = self._kv_transfer_config.kv_connector_extra_config
        self.block_size = vllm_config.cache_config.block_size
        self.arena_path: str = extra["arena_path"]
        self.num_slots = int(extra["num_slots"])
        self.slot_bytes = int(extra["slot_bytes"])
        self.async_load = bool(extra.get("async_load", False))
        self._reqs: dict[str, _ReqState] = {}
        # Scheduler side: off-step loads queued since the last metadata was built.
        self._async_loads: dict[str, list[_Load]] = {}
        self._arena: np.ndarray | None = None
        self._layers: list[torch.Tensor] = []
        self._load_errors: set[int] = set()
        # Worker side: the loader thread and its loads in flight, per request.
        self._loader: ThreadPoolExecutor | None = None
        self._inflight: dict[str, tuple[Future[set[int]], list[_Load]]] = {}
        self._load_stream: Any = None

    # ------------------------------------------------------------ scheduler side

    def get_num_new_matched_tokens(self, request: Request,
                                   num_computed_tokens: int) -> tuple[int | None, bool]:
        params = (request.kv_transfer_params or {}).get(PARAMS_KEY)
        if not params:
            return 0, False
        bs = self.block_size
        # The last prompt token is always computed: its logits are the first output.
        prompt_blocks = (request.num_prompt_tokens - 1) // bs
        st = _ReqState(load_slots=list(params.get("load", [])),
                       load_checksums=list(params.get("load_checksums", [])),
                       save_slots=list(params.get("save", [])),
                       prompt_blocks=request.num_prompt_tokens // bs)
        prev = self._reqs.get(request.request_id)
        if prev is not None:
            # Asked again (preempted, or every block of its off-step load failed): a block
            # that failed verification would only fail again, so it is computed instead.
            st.load_failed, st.load_limit = prev.load_failed, prev.load_limit
        self._reqs[request.request_id] = st
        have = min(len(st.load_slots), prompt_blocks)
        if st.load_limit is not None:
            have = min(have, st.load_limit)
        # Blocks below ``first`` are in vLLM's own prefix cache (the GPU tier).
        st.first_load = first = num_computed_tokens // bs
        if have <= first:
            return 0, False
        st.num_load = have - first
        return have * bs - num_computed_tokens, self.async_load

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks,
                                 num_external_tokens: int) -> None:
        st = self._reqs.get(request.request_id)
        if st is None or st.load_queued:
            return  # e.g. scheduled after its off-step load: vLLM asks with 0 tokens
        if num_external_tokens == 0:
            st.num_load = 0
        elif self.async_load:
            # The request now waits for this load and is not among the next step's new
            # requests, so its copies are queued here, with the blocks just allocated.
            st.block_ids = list(blocks.get_block_ids()[0])
            self._async_loads[request.request_id] = self._load_list(st)
            st.load_queued = st.load_async = True

    @staticmethod
    def _load_list(st: _ReqState) -> list[_Load]:
        return [(st.block_ids[i], st.load_slots[i],
                 st.load_checksums[i] if i < len(st.load_checksums) else 0)
                for i in range(st.first_load, st.first_load + st.num_load)]

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = CpdConnectorMetadata(async_loads=self._async_loads)
        self._async_loads = {}
        bs = self.block_size
        for req in scheduler_output.scheduled_new_reqs:
            st = self._reqs.get(req.req_id)
            if st is None:
                continue
            st.block_ids = list(req.block_ids[0])
            if not st.load_queued:
                meta.loads.extend(self._load_list(st))
                st.load_queued = True
            done = req.num_computed_tokens + scheduler_output.num_scheduled_tokens[req.req_id]
            self._saves(st, done // bs, meta)
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            st = self._reqs.get(req_id)
            if st is None:
                continue
            new_ids = cached.new_block_ids[i]
            if new_ids is not None:
                if req_id in cached.resumed_req_ids:
                    st.block_ids = list(new_ids[0])
                else:
                    st.block_ids.extend(new_ids[0])
            done = cached.num_computed_tokens[i] + scheduler_output.num_scheduled_tokens[req_id]
            self._saves(st, done // bs, meta)
        return meta

    def _saves(self, st: _ReqState, full_blocks: int, meta: CpdConnectorMetadata) -> None:
        upto = min(full_blocks, st.prompt_blocks, len(st.block_ids))
        for i in range(st.saved_upto, upto):
            # Blocks that came from the arena are already there; -1 means "not wanted".
            if i < len(st.save_slots) and st.save_slots[i] >= 0 and not (
                    st.first_load <= i < st.first_load + st.num_load):
                meta.saves.append((st.block_ids[i], st.save_slots[i]))
                st.saved += 1
        st.saved_upto = max(st.saved_upto, upto)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        bad = connector_output.invalid_block_ids
        if not bad:
            return
        # vLLM recomputes from the first failed block on: count only what really loaded.
        for st in self._reqs.values():
            for i in range(st.first_load, st.first_load + st.num_load):
                if i < len(st.block_ids) and st.block_ids[i] in bad:
                    st.load_failed += st.first_load + st.num_load - i
                    st.num_load = i - st.first_load
                    st.load_limit = i
                    break

    def request_finished(self, request: Request,
                         block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        st = self._reqs.pop(request.request_id, None)
        if st is None:
            return False, None
        # Saves happen inside the step (wait_for_save), so the blocks can be freed now. A
        # request aborted during its off-step load keeps its blocks anyway: vLLM frees
        # them only once get_finished reports the load done.
        return False, {PARAMS_KEY: {"loaded_blocks": st.num_load,
                                    "cached_blocks": st.first_load,
                                    "failed_blocks": st.load_failed,
                                    "saved_blocks": st.saved,
                                    "async_load": st.load_async}}

    # --------------------------------------------------------------- worker side

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
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

    def _load(self, loads: list[_Load]) -> set[int]:
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

    def _load_off_step(self, loads: list[_Load]) -> set[int]:
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

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, CpdConnectorMetadata)
        self._load_errors |= self._load(meta.loads)
        if meta.async_loads and self._loader is None:
            # One thread: loads share one host link, in arrival order.
            self._loader = ThreadPoolExecutor(1, thread_name_prefix="cpd-kv-load")
        for req_id, loads in meta.async_loads.items():
            assert self._loader is not None
            self._inflight[req_id] = (self._loader.submit(self._load_off_step, loads), loads)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # in-step loads complete in start_load_kv

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

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor,
                      attn_metadata: AttentionMetadata, **kwargs: Any) -> None:
        return  # all layers are saved together in wait_for_save

    def wait_for_save(self) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, CpdConnectorMetadata)
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
