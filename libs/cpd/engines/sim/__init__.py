"""The simulated engine: the engine protocol over the cost model, scheduler and prefix
cache of :mod:`cpd.sim` (no model files, no GPU), and its cache-event bridge."""

from .bridge import SimCacheEventBridge
from .engine import SimEngine

__all__ = ["SimCacheEventBridge", "SimEngine"]
