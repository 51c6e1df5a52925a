"""What CPD's vLLM KV connector's two halves share: the request parameters' key and the
copies one step's metadata carries from the scheduler half to the worker half."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

PARAMS_KEY = "cpd"
"""The key of CPD's entry in a request's ``kv_transfer_params``."""

Load = tuple[int, int, int]
"""(engine block, arena slot, checksum; 0: not verified)"""


@dataclass
class CpdConnectorMetadata(KVConnectorMetadata):
    """One step's copies: blocks to load inside the step; per request, blocks to load
    off the step; (engine block, slot) to save."""

    loads: list[Load] = field(default_factory=list)
    async_loads: dict[str, list[Load]] = field(default_factory=dict)
    saves: list[tuple[int, int]] = field(default_factory=list)
