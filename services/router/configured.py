"""The routing policy a router runs, built from its settings and its workers' engine
profile (the planner builds the router it simulates here too, so both decide alike)."""

from __future__ import annotations

from cpd.engines.profile import EngineProfile
from cpd.ops.config import Settings
from services.router.cost import LoadCost, PrefillCost
from services.router.policy import PolicyConfig, Router


def make_policy(settings: Settings, profile: EngineProfile) -> Router:
    """The routing policy of a router serving ``settings`` (the planner builds the
    router it simulates here too, so both decide alike)."""
    return Router(PolicyConfig.from_settings(settings.router), prefill_cost(profile),
                  LoadCost(kv_bytes_per_token=max(1, profile.slot_bytes
                                                  // settings.cache.block_size),
                           per_transfer_ms=settings.router.transfer_fixed_ms))


def prefill_cost(profile: EngineProfile) -> PrefillCost:
    """The prefill cost seeds of the engines the workers run (configured for vLLM, the
    preset's coefficients in wall ms for the sim engine)."""
    fixed, per_token, per_ctx = profile.prefill_cost_ms()
    return PrefillCost(fixed_ms=fixed, per_token_ms=per_token, per_token_ctx_ms=per_ctx)
