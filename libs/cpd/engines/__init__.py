"""Engines behind the CPD workers: the engine protocol, the profile that resolves what
differs between engine kinds, the served model, the vLLM engine with CPD's KV connector
(:mod:`cpd.engines.vllm`) and the simulated engine (:mod:`cpd.engines.sim`)."""

from .profile import EngineProfile, engine_profile, served_model
from .protocol import ArenaSpec, Engine, EngineRequest, EngineStep
from .servedmodel import ServedModel

__all__ = ["ArenaSpec", "Engine", "EngineProfile", "EngineRequest", "EngineStep", "ServedModel",
           "engine_profile", "served_model"]
