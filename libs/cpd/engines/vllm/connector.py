"""CPD's vLLM KV connector (``KVConnectorBase_V1``, loaded by ``kv_connector_module_path``).

It moves whole cache blocks between vLLM's paged KV cache and the worker's host-DRAM
block arena, a shared-memory file that the CPD worker process also maps (it serves
peers over UCX and fills slots pulled from them). All network I/O stays in the worker
process; the connector only copies memory, so engine steps never wait on a peer.

vLLM instantiates the connector once per role, as its own connectors are built: the
scheduler half (:mod:`cpd.engines.vllm.kv_scheduler`) decides what each step loads and
saves, the worker half (:mod:`cpd.engines.vllm.kv_worker`) copies memory; one step's
copies pass between them as :class:`~cpd.engines.vllm.kv_meta.CpdConnectorMetadata`.

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
A block holds the whole model's KV whatever the engine's tensor and pipeline parallelism:
each rank copies its own heads and layers (:mod:`cpd.engines.vllm.kv_layout`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from cpd.engines.vllm.kv_meta import PARAMS_KEY, CpdConnectorMetadata
from cpd.engines.vllm.kv_scheduler import ConnectorScheduler
from cpd.engines.vllm.kv_worker import ConnectorWorker
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

__all__ = ["PARAMS_KEY", "CpdConnector", "CpdConnectorMetadata", "checksum"]


class CpdConnector(KVConnectorBase_V1):
    """Block copies between vLLM's paged cache and CPD's shared-memory arena: the half
    of ``role`` (scheduler or worker), each method delegated to it."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole,
                 kv_cache_config: KVCacheConfig | None = None) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        extra = self._kv_transfer_config.kv_connector_extra_config
        self._scheduler: ConnectorScheduler | None = None
        self._worker: ConnectorWorker | None = None
        if role == KVConnectorRole.SCHEDULER:
            self._scheduler = ConnectorScheduler(vllm_config.cache_config.block_size,
                                                 bool(extra.get("async_load", False)))
        else:
            model = vllm_config.model_config
            self._worker = ConnectorWorker(
                extra["arena_path"], int(extra["num_slots"]), int(extra["slot_bytes"]),
                block_size=vllm_config.cache_config.block_size,
                num_layers=model.get_total_num_hidden_layers(),
                num_kv_heads=model.get_total_num_kv_heads(),
                tp_size=vllm_config.parallel_config.tensor_parallel_size)

    @property
    def scheduler(self) -> ConnectorScheduler:
        assert self._scheduler is not None, "a scheduler-side call on the worker half"
        return self._scheduler

    @property
    def worker(self) -> ConnectorWorker:
        assert self._worker is not None, "a worker-side call on the scheduler half"
        return self._worker

    # ------------------------------------------------------------ scheduler side

    def get_num_new_matched_tokens(self, request: Request,
                                   num_computed_tokens: int) -> tuple[int | None, bool]:
        return self.scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks,
                                 num_external_tokens: int) -> None:
        self.scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return self.scheduler.build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        self.scheduler.update_connector_output(connector_output)

    def request_finished(self, request: Request,
                         block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self.scheduler.request_finished(request, block_ids)

    # --------------------------------------------------------------- worker side

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        from vllm.distributed import get_tensor_model_parallel_rank

        self.worker.register_kv_caches(kv_caches, tp_rank=get_tensor_model_parallel_rank())

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        self.worker.start_load(self._metadata())

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # in-step loads complete in start_load_kv

    def get_finished(self, finished_req_ids: set[str]
                     ) -> tuple[set[str] | None, set[str] | None]:
        return self.worker.get_finished(finished_req_ids)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor,
                      attn_metadata: AttentionMetadata, **kwargs: Any) -> None:
        return  # all layers are saved together in wait_for_save

    def wait_for_save(self) -> None:
        self.worker.save(self._metadata())

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker.get_block_ids_with_load_errors()

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown()

    def _metadata(self) -> CpdConnectorMetadata:
        meta = self._get_connector_metadata()
        assert isinstance(meta, CpdConnectorMetadata)
        return meta
