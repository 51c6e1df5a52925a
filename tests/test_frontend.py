"""The front-end process (``services.frontend``) on a real NATS server: its three parts
start in order under one node id and answer as the separate services do, the router's
lookups reach the index in the process while other processes still reach the parts
through NATS, and a stop asked of one part (the gateway's HTTP server failing) stops
the whole front end, the gateway first."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest

from cpd.bus import Bus
from cpd.client import Client
from cpd.ops.config import Settings, load_settings
from cpd.ops.natsserver import NatsServer
from cpd.protocol import wire
from cpd.protocol.errors import CpdError
from services.frontend import Frontend
from services.gateway import GatewayService
from services.kvindex import KvIndexService
from services.router import RouterService
from tools.cluster import wait_ready

pytestmark = pytest.mark.timeout(120)

NODE = "fe-test"


def _settings(nats: NatsServer, model_cache: Path, tmp_path: Path) -> Settings:
    return load_settings(environ={}, overrides=[
        f"nats.servers={nats.url}", "nats.drain_timeout_s=2", f"node.node_id={NODE}",
        f"model.cache_dir={model_cache}", "gateway.port=0",
        "node.heartbeat_interval_s=0.2", f"kvindex.snapshot_dir={tmp_path / 'snap'}"])


async def test_a_front_end_serves_as_its_three_services(
        fresh_nats: NatsServer, model_cache: Path, tmp_path: Path) -> None:
    settings = _settings(fresh_nats, model_cache, tmp_path)
    frontend = Frontend(settings)
    run = asyncio.create_task(frontend.run())
    try:
        for _ in range(600):  # the model loads, then each part starts in turn
            if len(frontend.parts) == 3 or run.done():
                break
            await asyncio.sleep(0.1)
        assert [type(p) for p in frontend.parts] == [KvIndexService, RouterService,
                                                    GatewayService]
        # Each part answers NATS micro under the front end's node id, like a service of
        # its own (what `cpd health` and `cpd up`'s readiness ask).
        for service in ("kvindex", "router", "gateway", "frontend"):
            await wait_ready(fresh_nats.url, service, NODE, 10)
        async with httpx.AsyncClient(base_url=frontend.gateway.url, timeout=10) as http:
            assert (await http.get("/health")).status_code == 200
        # Another process's client reaches the router through NATS.
        bus = await Bus.open(settings, "fe-test-client")
        try:
            status = await Client(bus).status()
            assert status.router.node == NODE
            assert status.kvindex is wire.KvIndexState.OK
        finally:
            await bus.close()
        # The router's lookup is answered by the index in the process.
        before = frontend.hub.delivered
        req = Client(frontend.router.bus).request(list(range(1, 600)), max_tokens=2)
        with pytest.raises(CpdError):  # no worker to serve it, after the lookup
            await frontend.router.decide(req)
        assert frontend.hub.delivered - before == 2  # the lookup and its answer
        # The gateway's HTTP server failing stops the whole front end.
        frontend.gateway.request_stop()
        await asyncio.wait_for(run, 30)
        assert all(p.stopping for p in frontend.parts)
        assert all(p.bus.nc.is_closed for p in frontend.parts)
    finally:
        if not run.done():
            run.cancel()
            await asyncio.gather(run, return_exceptions=True)
            await frontend.stop()
