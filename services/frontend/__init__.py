"""frontend: the gateway, a router replica and a kvindex replica in one process, reaching
each other without NATS (:mod:`cpd.bus.local`); ``process`` holds the process."""

from services.frontend.process import Frontend, serve

__all__ = ["Frontend", "serve"]
