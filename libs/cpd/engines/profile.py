"""What differs between the engines a worker may run, in one place.

``worker.engine`` selects the vLLM engine on the model of ``[model]`` or the simulated
engine of ``[sim]``. Workers, the router, the gateway and the tools all need to agree on
what follows from that choice: the served model (its name, cache namespace, limits,
tokenizer), the bytes of one KV block in a worker's arena, the router's prefill cost
seeds, the engine itself, and the bridge of its GPU prefix-cache events into ``CPD_KV``.
:func:`engine_profile` resolves that once from the settings; nothing else branches on the
engine kind.
"""

from __future__ import annotations

import abc
import json
from pathlib import Path
from typing import ClassVar, Protocol

from cpd.kvstore import KvEventPublisher, kv_block_bytes
from cpd.ops.config import Settings
from cpd.ops.cpuset import parse_cpu_list
from cpd.protocol.errors import ConfigError
from cpd.protocol.hashing import Namespace
from cpd.protocol.roles import Role
from cpd.sim.costmodel import CostModel, preset
from cpd.sim.scheduler import SchedulerConfig

from .protocol import ArenaSpec, Engine
from .servedmodel import ServedModel

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "fp8": 1, "fp8_e4m3": 1,
               "fp8_e5m2": 1}
"""Bytes of one value of each KV dtype (``Settings.kv_dtype``)."""

# Bump when the sim's token or KV-byte derivation changes: old blocks must not match.
SIM_REVISION = "sim1"
# KV "dtype" of the sim namespace: simulated bytes are interchangeable only with each other.
SIM_KV_DTYPE = "sim"


class CacheEventBridge(Protocol):
    """Forwards an engine's GPU prefix-cache changes to kvindex (GPU-tier events)."""

    async def start(self) -> None: ...

    async def close(self) -> None: ...


class EngineProfile(abc.ABC):
    """What one engine kind implies for a deployment of ``settings``."""

    kind: ClassVar[str]

    def __init__(self, settings: Settings) -> None:
        self.settings = settings

    @abc.abstractmethod
    def served_model(self) -> ServedModel:
        """The model the workers serve (may build the local model: call off the loop)."""

    @property
    def slot_bytes(self) -> int:
        """Bytes of one arena slot: ``dataplane.block_bytes`` when set, else the engine's
        KV bytes of one cache block."""
        return self.settings.dataplane.block_bytes or self._block_bytes()

    @abc.abstractmethod
    def _block_bytes(self) -> int: ...

    @abc.abstractmethod
    def prefill_cost_ms(self) -> tuple[float, float, float]:
        """The router's prefill cost seeds in wall ms: (fixed, per token, per token ×
        context)."""

    @abc.abstractmethod
    def build_engine(self, role: str, model: ServedModel, arena: ArenaSpec, *,
                     kv_events_endpoint: str) -> Engine:
        """The engine of a worker of ``role`` over its block ``arena``; vLLM publishes
        its KV events on ``kv_events_endpoint`` (a ZeroMQ address)."""

    @abc.abstractmethod
    def cache_event_bridge(self, engine: Engine, publisher: KvEventPublisher,
                           namespace: Namespace, *, kv_events_endpoint: str
                           ) -> CacheEventBridge:
        """The bridge of ``engine``'s GPU prefix-cache events into ``CPD_KV``."""


class VllmProfile(EngineProfile):
    """vLLM on the model of ``[model]``: a local preset (built when missing) or a folder."""

    kind = "vllm"

    def served_model(self) -> ServedModel:
        return ServedModel.load(self.settings)

    def _block_bytes(self) -> int:
        """One block's KV across all layers, from the model's shape: the preset's, or the
        ``config.json`` of ``model.path`` (a Hugging Face checkpoint)."""
        from cpd.modelbuild import PRESETS

        s = self.settings
        if s.model.path:
            layers, kv_heads, head_dim = _kv_shape(Path(s.model.path) / "config.json")
        else:
            p = PRESETS[s.model.preset]
            layers, kv_heads, head_dim = p.num_hidden_layers, p.num_key_value_heads, p.head_dim
        return kv_block_bytes(layers=layers, kv_heads=kv_heads, head_dim=head_dim,
                              block_tokens=s.cache.block_size,
                              dtype_bytes=DTYPE_BYTES[s.kv_dtype])

    def prefill_cost_ms(self) -> tuple[float, float, float]:
        c = self.settings.router
        return c.prefill_fixed_ms, c.prefill_per_token_ms, c.prefill_per_token_ctx_ms

    def build_engine(self, role: str, model: ServedModel, arena: ArenaSpec, *,
                     kv_events_endpoint: str) -> Engine:
        from .vllm.engine import VllmEngine

        s = self.settings
        return VllmEngine(model.folder, block_size=s.cache.block_size, arena=arena,
                          dtype=s.model.dtype, kv_cache_gib=s.worker.engine_kv_cache_gib,
                          kv_events_endpoint=kv_events_endpoint,
                          long_prefill_token_threshold=s.worker.long_prefill_token_threshold,
                          async_kv_load=s.worker.loads_async(role),
                          executor=s.worker.engine_executor, threads=s.worker.engine_threads,
                          cpus=parse_cpu_list(s.worker.engine_cpus),
                          engine=s.engine_for(role),
                          metrics=bool(s.telemetry.prometheus_port),
                          allow_untested_vllm=s.worker.allow_untested_vllm)

    def cache_event_bridge(self, engine: Engine, publisher: KvEventPublisher,
                           namespace: Namespace, *, kv_events_endpoint: str
                           ) -> CacheEventBridge:
        from .vllm.gpu_events import GpuEventBridge

        return GpuEventBridge(kv_events_endpoint, publisher, namespace.id, namespace.to_spec())


class SimProfile(EngineProfile):
    """The simulated engine of ``[sim]`` (docs/sim.md): no model files, the preset and
    the vocabulary stand for them; arena slots hold the preset's KV bytes of a block
    divided by ``sim.kv_scale_down``, so real (scaled-down) bytes cross the real data
    plane; the router's cost seeds are the preset's coefficients in wall milliseconds."""

    kind = "sim"

    def cost_model(self, role: str = Role.PREFILL) -> CostModel:
        """The cost preset of a worker of ``role`` (decode may have its own)."""
        s = self.settings.sim
        return preset(s.decode_preset if role == Role.DECODE and s.decode_preset else s.preset)

    @property
    def model_name(self) -> str:
        """The served model's name (clients may pass it as ``model``)."""
        return f"sim-{self.settings.sim.preset}"

    def namespace(self) -> Namespace:
        """The cache namespace of the sim deployment."""
        s = self.settings
        return Namespace(model_id=self.model_name, model_revision=SIM_REVISION,
                         tokenizer_hash=f"vocab-{s.sim.vocab_size}", kv_dtype=SIM_KV_DTYPE,
                         block_size=s.cache.block_size, adapter_id=s.cache.adapter_id,
                         tenant_salt=s.cache.tenant_salt)

    def served_model(self) -> ServedModel:
        s = self.settings.sim
        return ServedModel(folder=Path(), name=self.model_name, namespace=self.namespace(),
                           max_model_len=s.max_model_len, vocab_size=s.vocab_size,
                           eos_token_id=None, chat_template=None,
                           has_tokenizer=False)

    def _block_bytes(self) -> int:
        block = self.cost_model().kv_bytes_per_token * self.settings.cache.block_size
        return max(1, -(-block // self.settings.sim.kv_scale_down))

    def prefill_cost_ms(self) -> tuple[float, float, float]:
        scale = self.settings.sim.time_scale
        fixed, per_token, per_ctx = self.cost_model().prefill_coefficients_ms()
        return fixed / scale, per_token / scale, per_ctx / scale

    def build_engine(self, role: str, model: ServedModel | None, arena: ArenaSpec | None, *,
                     kv_events_endpoint: str = "") -> Engine:
        from .sim.engine import SimEngine

        s, w = self.settings.sim, self.settings.worker
        bs = self.settings.cache.block_size
        return SimEngine(
            self.cost_model(role), block_size=bs, arena=arena, time_scale=s.time_scale,
            scheduler=SchedulerConfig(
                max_num_batched_tokens=s.max_num_batched_tokens, max_num_seqs=s.max_num_seqs,
                block_size=bs, long_prefill_token_threshold=w.long_prefill_token_threshold,
                async_kv_load=w.loads_async(role)),
            max_model_len=s.max_model_len, vocab_size=s.vocab_size,
            gpu_cache_blocks=s.gpu_cache_blocks or None, host_slack_s=s.host_slack_s)

    def cache_event_bridge(self, engine: Engine, publisher: KvEventPublisher,
                           namespace: Namespace, *, kv_events_endpoint: str = ""
                           ) -> CacheEventBridge:
        from .sim.bridge import SimCacheEventBridge
        from .sim.engine import SimEngine

        if not isinstance(engine, SimEngine):
            raise TypeError(f"the sim profile bridges a SimEngine, not {type(engine).__name__}")
        return SimCacheEventBridge(engine, publisher, namespace.id, namespace.to_spec())


_PROFILES: dict[str, type[EngineProfile]] = {p.kind: p for p in (VllmProfile, SimProfile)}


def engine_profile(settings: Settings) -> EngineProfile:
    """The profile of ``settings.worker.engine``."""
    return _PROFILES[settings.worker.engine](settings)


def served_model(settings: Settings) -> ServedModel:
    """The model the workers of ``settings`` serve (shorthand for the profile's)."""
    return engine_profile(settings).served_model()


__all__ = ["CacheEventBridge", "EngineProfile", "SimProfile", "VllmProfile", "engine_profile",
           "served_model"]


def _kv_shape(config_json: Path) -> tuple[int, int, int]:
    """(layers, KV heads, head dim) of a Hugging Face model's ``config.json``: KV heads
    default to the attention heads (no grouped-query attention), the head dim to the
    hidden size over the attention heads."""
    try:
        cfg = json.loads(config_json.read_text())
        heads = int(cfg["num_attention_heads"])
        return (int(cfg["num_hidden_layers"]), int(cfg.get("num_key_value_heads") or heads),
                int(cfg.get("head_dim") or int(cfg["hidden_size"]) // heads))
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ConfigError(f"model.path: cannot read the KV shape from {config_json}: "
                          f"{e!r}") from None
