"""The front-end process: the gateway, a router replica and (``frontend.kvindex``) a
kvindex replica, started in one process and reaching each other through one
:class:`~cpd.bus.LocalHub` instead of NATS.

Each part is the same :class:`~cpd.bus.Service` it is in a process of its own: its own
NATS connection and identity, endpoints, NATS micro name (``cpd-gateway``,
``cpd-router``, ``cpd-kvindex``, all under this process's node id) and graceful stop.
What changes is the path of a request: the gateway's request reaches the router in the
process, the router's lookup reaches the index in the process, and the router's stream
comes back to the gateway in the process. Workers, other routers and other index
replicas are reached through NATS as before, and reach these parts through NATS too.

Parts start in dependency order (the index, the router, the gateway: each serves before
the next begins) and stop in reverse, the gateway first so that in-flight HTTP requests
finish while the router still relays them. A stop asked of any part (SIGTERM, or the
gateway's HTTP server failing) stops the whole process: a front end without one of its
parts is not one a load balancer should keep sending to.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
from typing import TypeVar

from cpd.bus import LocalHub, Service, run_service
from cpd.engines.profile import served_model
from cpd.engines.servedmodel import ServedModel
from cpd.ops import telemetry
from cpd.ops.config import Settings
from services.gateway import GatewayService
from services.kvindex import KvIndexService
from services.router import RouterService

_S = TypeVar("_S", bound=Service)


class Frontend:
    """One front-end process: its parts, started and stopped together."""

    name = "frontend"

    def __init__(self, settings: Settings, *, nats_url: str | None = None,
                 model: ServedModel | None = None) -> None:
        """``model``: the served model when the caller has it loaded already (else it is
        loaded once, for the router and the gateway alike)."""
        self.settings = settings
        self.nats_url = nats_url
        self.hub = LocalHub()
        self.log = telemetry.get_logger("cpd.frontend", node=settings.node.node_id)
        self._model = model
        self.parts: list[Service] = []
        """The parts started so far, in start order."""

    @property
    def router(self) -> RouterService:
        """The router part (once started)."""
        return self._part(RouterService)

    @property
    def gateway(self) -> GatewayService:
        """The gateway part (once started)."""
        return self._part(GatewayService)

    def _part(self, kind: type[_S]) -> _S:
        for part in self.parts:
            if isinstance(part, kind):
                return part
        raise LookupError(f"the front end runs no started {kind.__name__}")

    async def start(self) -> None:
        """Load the model, then start each part once the one before it serves; a start
        that fails stops the parts it started."""
        model = self._model or await asyncio.to_thread(served_model, self.settings)
        s, url, hub = self.settings, self.nats_url, self.hub
        kvindex = [KvIndexService(s, nats_url=url, hub=hub)] if s.frontend.kvindex else []
        try:
            for part in (*kvindex, RouterService(s, nats_url=url, model=model, hub=hub),
                         GatewayService(s, nats_url=url, model=model, hub=hub)):
                await part.start()  # one that fails releases what it took
                self.parts.append(part)
        except BaseException:
            await self.stop()
            raise
        self.log.info("frontend.started", parts=[p.name for p in self.parts])

    async def stop(self) -> None:
        """Stop the parts, the last started first: each stops taking work and drains
        while the ones it relies on still serve (the router keeps relaying, and sending
        its keep-alives, to the gateway's last streams)."""
        for part in reversed(self.parts):
            with contextlib.suppress(Exception):
                await part.stop()

    async def run(self) -> None:
        """Start, serve until SIGTERM/SIGINT or until any part asks to stop, then stop."""
        loop = asyncio.get_running_loop()
        stop = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            with contextlib.suppress(NotImplementedError, RuntimeError):
                loop.add_signal_handler(sig, stop.set)
        await self.start()
        waits = [asyncio.ensure_future(p.stop_requested()) for p in self.parts]
        waits.append(asyncio.ensure_future(stop.wait()))
        try:
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in waits:
                w.cancel()
            await self.stop()


def serve(settings: Settings) -> None:
    """Run one front-end process until SIGTERM/SIGINT (``python -m services.frontend``,
    ``cpd serve frontend``)."""
    # Every part's metrics on the gateway's /metrics, as in a gateway of its own.
    telemetry.setup("frontend", settings.telemetry, prometheus_reader=True)
    run_service(Frontend(settings))
