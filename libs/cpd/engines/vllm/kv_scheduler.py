"""The scheduler half of CPD's vLLM KV connector: which of a request's blocks vLLM
should take from the arena (external hits beyond its own prefix cache), which full
prompt blocks each step copies out to their slots, and what a finished request loaded,
saved and failed. It runs in vLLM's scheduler and touches no memory."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from cpd.engines.vllm.kv_meta import PARAMS_KEY, CpdConnectorMetadata, Load

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request


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
    scheduled_at: float = 0.0  # first given blocks to run (time.monotonic())


class ConnectorScheduler:
    """The scheduler side of one engine (``block_size``: the engine's, equal to CPD's;
    ``async_load``: loads run off the step); its public methods are the scheduler-side
    calls of vLLM's ``KVConnectorBase_V1``, with their meanings."""

    def __init__(self, block_size: int, async_load: bool) -> None:
        self.block_size = block_size
        self.async_load = async_load
        self._reqs: dict[str, _ReqState] = {}
        # Off-step loads queued since the last metadata was built.
        self._async_loads: dict[str, list[Load]] = {}

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
            st.scheduled_at = prev.scheduled_at
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
        if st is not None and not st.scheduled_at:
            st.scheduled_at = time.monotonic()  # out of the waiting queue: queue time ends
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
    def _load_list(st: _ReqState) -> list[Load]:
        return [(st.block_ids[i], st.load_slots[i],
                 st.load_checksums[i] if i < len(st.load_checksums) else 0)
                for i in range(st.first_load, st.first_load + st.num_load)]

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> CpdConnectorMetadata:
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
                                    "async_load": st.load_async,
                                    "scheduled_at": st.scheduled_at}}
