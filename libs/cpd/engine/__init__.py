"""Engines behind the CPD workers: the protocol, the vLLM engine and its KV connector."""

from .protocol import ArenaSpec, Engine, EngineRequest, EngineStep

__all__ = ["ArenaSpec", "Engine", "EngineRequest", "EngineStep"]
