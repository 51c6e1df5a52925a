"""The gateway process: the HTTP API of :mod:`services.gateway.app` served by uvicorn on
the service's own event loop, next to its NATS connection.

It is a :class:`cpd.bus.Service` like the others, so ``cpd up`` sees it ready through
NATS micro (``cpd-gateway``) and it stops the same way: on SIGTERM the HTTP server stops
taking connections and lets in-flight requests finish (streams included, up to
``nats.drain_timeout_s``) while NATS is still up; then the connection drains.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Iterator

import uvicorn

from cpd.bus import LocalHub, Service, run_service
from cpd.client import Client
from cpd.engines.profile import served_model
from cpd.engines.servedmodel import ServedModel
from cpd.ops import telemetry
from cpd.ops.config import Settings
from services.gateway.app import create_app

# Past uvicorn's own graceful-shutdown limit, how long stopping waits for it to return.
_SHUTDOWN_MARGIN_S = 1.0


class _Server(uvicorn.Server):
    """uvicorn without its signal handlers: the service owns SIGTERM/SIGINT."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


class GatewayService(Service):
    """The OpenAI-compatible HTTP gateway; ``url`` is where it listens once started."""

    name = "gateway"

    def __init__(self, settings: Settings, *, nats_url: str | None = None,
                 model: ServedModel | None = None, hub: LocalHub | None = None) -> None:
        """``model``: the served model when the caller has it loaded already."""
        super().__init__(settings, nats_url=nats_url, hub=hub)
        self.model = model
        self.url = ""
        self._server: _Server | None = None
        self._serving: asyncio.Task[None] | None = None

    async def prepare(self) -> None:
        # Before the service announces itself (readiness probes ping it): building or
        # hashing the model folder and loading the chat renderer take seconds, which
        # neither the first chat nor a probe that found the service up should wait.
        if self.model is None:
            # Through the engine profile: the sim engine's model has no tokenizer.
            self.model = await asyncio.to_thread(served_model, self.settings)
        await asyncio.to_thread(self.model.prepare_chat)

    async def setup(self) -> None:
        cfg = self.settings.gateway
        assert self.model is not None
        client = Client(self.bus, default_timeout_s=cfg.request_timeout_s)
        app = create_app(client, self.model, self.settings)
        # Bound here, not by uvicorn: a busy port fails start() with an OSError (uvicorn
        # would exit the process), and port 0 tells us the port the OS chose.
        sock = _listen(cfg.host, cfg.port)
        config = uvicorn.Config(app, log_level="warning", log_config=None, lifespan="off",
                                access_log=False,
                                timeout_graceful_shutdown=self.settings.nats.drain_timeout_s)
        self._server = _Server(config)
        self._serving = self.spawn(self._server.serve(sockets=[sock]), "http",
                                   background=True)
        self._serving.add_done_callback(self._on_http_exit)
        host, port = sock.getsockname()[:2]
        self.url = f"http://{f'[{host}]' if ':' in host else host}:{port}"
        self.log.info("gateway.listening", url=self.url,
                      model=cfg.served_model_name or self.model.name)

    async def stop(self) -> None:
        """Stop HTTP first (in-flight requests still need NATS), then the service."""
        await self._stop_http()
        await super().stop()

    async def _stop_http(self) -> None:
        if self._server is None or self._serving is None or self._serving.done():
            return
        self._server.should_exit = True
        await asyncio.wait({self._serving},
                           timeout=self.settings.nats.drain_timeout_s + _SHUTDOWN_MARGIN_S)

    def _on_http_exit(self, task: asyncio.Task[None]) -> None:
        if self.stopping or (self._server is not None and self._server.should_exit):
            return
        # A gateway without its HTTP server is useless: stop instead of lingering.
        error = None if task.cancelled() else task.exception()
        self.log.error("gateway.http_stopped", error=repr(error))
        self.request_stop()


def _listen(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host:port`` (IPv4 or IPv6, as the host resolves)."""
    family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    return socket.create_server((host, port), family=family)


def serve(settings: Settings) -> None:
    """Run one gateway process until SIGTERM/SIGINT (``python -m services.gateway``,
    ``cpd serve gateway``)."""
    # Metrics are served on the gateway's own /metrics, not on a port of their own.
    telemetry.setup("gateway", settings.telemetry, prometheus_reader=True)
    run_service(GatewayService(settings))
