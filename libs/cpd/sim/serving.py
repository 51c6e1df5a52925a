"""The simulated engine in a deployment (``worker.engine = "sim"``, DESIGN.md §9): what
workers and the router derive from the ``[sim]`` settings so that they agree.

* the cache namespace (no model files: the preset and the vocabulary stand for them);
* the arena slot size: the preset's KV bytes of one block divided by
  ``sim.kv_scale_down``, so real (scaled-down) bytes cross the real data plane;
* the router's prefill cost seeds: the preset's coefficients in wall milliseconds;
* the engine itself, per role (decode nodes may use their own preset).
"""

from __future__ import annotations

from cpd.config import Settings
from cpd.engine.protocol import ArenaSpec
from cpd.hashing import Namespace

from .costmodel import CostModel, preset
from .engine import SimEngine
from .scheduler import SchedulerConfig

# Bump when the sim's token or KV-byte derivation changes: old blocks must not match.
SIM_REVISION = "sim1"
# KV "dtype" of the namespace: simulated bytes are interchangeable only with each other.
SIM_KV_DTYPE = "sim"


def cost_model(settings: Settings, role: str = "prefill") -> CostModel:
    """The cost preset of a worker of ``role``."""
    s = settings.sim
    return preset(s.decode_preset if role == "decode" and s.decode_preset else s.preset)


def model_name(settings: Settings) -> str:
    """The served model's name in a sim deployment (clients may pass it as ``model``)."""
    return f"sim-{settings.sim.preset}"


def namespace(settings: Settings) -> Namespace:
    """The cache namespace of a sim deployment."""
    s = settings.sim
    return Namespace(model_id=model_name(settings), model_revision=SIM_REVISION,
                     tokenizer_hash=f"vocab-{s.vocab_size}", kv_dtype=SIM_KV_DTYPE,
                     block_size=settings.cache.block_size,
                     adapter_id=settings.cache.adapter_id)


def slot_bytes(settings: Settings) -> int:
    """Bytes of one arena slot: the modelled KV of a block, scaled down (at least 1)."""
    block = cost_model(settings).kv_bytes_per_token * settings.cache.block_size
    return max(1, -(-block // settings.sim.kv_scale_down))


def prefill_cost_ms(settings: Settings) -> tuple[float, float, float]:
    """(fixed, per token, per token × context) in wall ms: the preset's simulated
    coefficients divided by the time scale, as the router's queue estimates are wall."""
    scale = settings.sim.time_scale
    fixed, per_token, per_ctx = cost_model(settings).prefill_coefficients_ms()
    return fixed / scale, per_token / scale, per_ctx / scale


def build_engine(settings: Settings, role: str, arena: ArenaSpec | None) -> SimEngine:
    """The sim engine of a worker of ``role`` over its block ``arena``."""
    s = settings.sim
    bs = settings.cache.block_size
    return SimEngine(
        cost_model(settings, role), block_size=bs, arena=arena, time_scale=s.time_scale,
        scheduler=SchedulerConfig(max_num_batched_tokens=s.max_num_batched_tokens,
                                  max_num_seqs=s.max_num_seqs, block_size=bs),
        max_model_len=s.max_model_len, vocab_size=s.vocab_size,
        gpu_cache_blocks=s.gpu_cache_blocks or None)
