"""Gateway tenants: API keys (SHA-256 digests in the config, ``Authorization: Bearer``),
per-tenant rate limits (token buckets, pure and over HTTP), request-size, prompt-length
and max_tokens limits, and the tenant's name reaching the router (its own cache
namespace). A real gateway and nats-server, a recording router, the real openai client;
the open default (no tenants) keeps today's behaviour."""

from __future__ import annotations

import tempfile
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import openai
import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader

from cpd.bus import Request, Service
from cpd.engines.servedmodel import ServedModel
from cpd.ops.config import Settings, api_key_digest, load_settings
from cpd.ops.natsserver import NatsServer
from cpd.protocol import subjects, wire
from cpd.protocol.errors import ConfigError
from services.gateway import GatewayService
from services.gateway.metrics import GatewayMetrics
from services.gateway.ratelimit import RateLimiter, TokenBucket, retry_after_header

pytestmark = pytest.mark.timeout(60)

SERVED = "cpd-tenant-model"
KEYS = {"acme": ["sk-acme-1", "sk-acme-2"], "burst": ["sk-burst"], "globex": ["sk-globex"]}


# -------------------------------------------------------------------- pure: buckets


def test_token_bucket_with_a_fake_clock() -> None:
    b = TokenBucket(rate_per_s=2.0, burst=3)
    assert [b.take(10.0) for _ in range(3)] == [0.0, 0.0, 0.0]  # a full burst at once
    assert b.take(10.0) == pytest.approx(0.5)  # one token takes 1/rate
    assert b.take(10.25) == pytest.approx(0.25)  # a refused try takes nothing
    assert b.take(10.5) == 0.0
    assert b.take(100.0) == 0.0 and b.tokens == pytest.approx(2.0)  # capped at the burst
    assert b.take(99.0) == 0.0  # a clock stepping back never adds tokens
    assert b.tokens == pytest.approx(1.0)
    with pytest.raises(ValueError):
        TokenBucket(rate_per_s=0, burst=1)
    assert retry_after_header(0.01) == "1" and retry_after_header(2.3) == "3"


def test_rate_limiter_keeps_tenants_apart_and_unlimited_ones_free() -> None:
    now = [0.0]
    rl = RateLimiter({"a": (1.0, 1), "b": (1.0, 2), "free": (0.0, 1)}, lambda: now[0])
    assert rl.check("a") == 0.0 and rl.check("a") == pytest.approx(1.0)
    assert rl.check("b") == 0.0 and rl.check("b") == 0.0  # a's use is not b's
    assert all(rl.check("free") == 0.0 for _ in range(100))
    now[0] = 1.0
    assert rl.check("a") == 0.0


def test_tenant_settings_are_validated() -> None:
    with pytest.raises(ConfigError):  # a key, not its digest
        _load_toml_text('[gateway.tenants.a]\napi_key_sha256 = ["sk-plain-key"]\n')
    d = api_key_digest("k")
    with pytest.raises(ConfigError):  # one key, two tenants
        _load_toml_text(f'[gateway.tenants.a]\napi_key_sha256 = ["{d}"]\n'
                        f'[gateway.tenants.b]\napi_key_sha256 = ["{d}"]\n')
    with pytest.raises(ConfigError):  # typo in a limit's name
        _load_toml_text('[gateway.tenants.a]\nrate_limit = 3\n')


def _load_toml_text(text: str, overrides: list[str] | None = None) -> Settings:
    with tempfile.NamedTemporaryFile("w", suffix=".toml", delete=False) as f:
        f.write(text)
    try:
        return load_settings(f.name, environ={}, overrides=overrides or [])
    finally:
        Path(f.name).unlink()


# ----------------------------------------------------------------- real gateway


class RecordingRouter(Service):
    """Answers ``generate`` with one token and a final; records what it got."""

    name = "router"

    def __init__(self, settings: Settings) -> None:
        super().__init__(settings)
        self.received: list[wire.GenerateRequest] = []

    async def setup(self) -> None:
        await self.add_endpoint("generate", subjects.GENERATE, self._generate,
                                expect=wire.GenerateRequest, queue=subjects.QUEUE_ROUTER)

    async def _generate(self, req: wire.GenerateRequest, request: Request) -> None:
        self.received.append(req)
        stream = request.stream(req.request_id)
        await stream.tokens([7], "ok")
        await stream.final(finish_reason="length", usage=wire.Usage(completion_tokens=1))


def _tenants_toml() -> str:
    limits = {"acme": "max_tokens = 8\nmax_prompt_tokens = 50\nmax_request_bytes = 2000\n",
              "burst": "rate_per_s = 0.5\nburst = 2\n", "globex": ""}
    parts = []
    for name, keys in KEYS.items():
        digests = ", ".join(f'"{api_key_digest(k)}"' for k in keys)
        parts.append(f"[gateway.tenants.{name}]\napi_key_sha256 = [{digests}]\n{limits[name]}")
    return "\n".join(parts)


def _overrides(nats: NatsServer, model_cache: Path) -> list[str]:
    return [f"nats.servers={nats.url}", "nats.drain_timeout_s=2", f"model.cache_dir={model_cache}",
            "gateway.port=0", f"gateway.served_model_name={SERVED}",
            "gateway.request_timeout_s=20"]


@pytest.fixture(scope="module")
def tenant_settings(nats_server: NatsServer, model_cache: Path) -> Settings:
    return _load_toml_text(_tenants_toml(), _overrides(nats_server, model_cache))


@pytest.fixture(scope="module")
def model(tenant_settings: Settings) -> ServedModel:
    return ServedModel.load(tenant_settings)


@pytest.fixture(scope="module")
def reader() -> InMemoryMetricReader:
    return InMemoryMetricReader()


@pytest.fixture(scope="module")
async def gateway(tenant_settings: Settings, model: ServedModel,
                  reader: InMemoryMetricReader) -> AsyncIterator[GatewayService]:
    service = GatewayService(tenant_settings, model=model)
    await service.start()
    # The app's metrics, on a reader of this test's own (the process-wide provider may
    # belong to another test): same instruments, same calls.
    assert service._server is not None
    gw = next(r.endpoint.__self__ for r in service._server.config.app.routes
              if getattr(r, "path", "") == "/v1/completions")
    gw.outcomes.metrics = GatewayMetrics(MeterProvider(metric_readers=[reader]).get_meter("test"))
    yield service
    await service.stop()


@pytest.fixture
async def router(tenant_settings: Settings) -> AsyncIterator[RecordingRouter]:
    service = RecordingRouter(tenant_settings)
    await service.start()
    yield service
    await service.stop()


def _oai(gateway: GatewayService, key: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{gateway.url}/v1", api_key=key, max_retries=0,
                              timeout=20)


def _rejections(reader: InMemoryMetricReader) -> dict[tuple[str, str], int]:
    out: dict[tuple[str, str], int] = {}
    data = reader.get_metrics_data()
    for rm in data.resource_metrics if data else []:
        for sm in rm.scope_metrics:
            for m in sm.metrics:
                if m.name == "cpd_gateway_tenant_rejections":
                    for p in m.data.data_points:
                        out[(p.attributes["tenant"], p.attributes["reason"])] = p.value
    return out


async def test_keys_name_the_tenant_whose_namespace_the_request_uses(
        gateway: GatewayService, router: RecordingRouter) -> None:
    for key, tenant in (("sk-acme-1", "acme"), ("sk-acme-2", "acme"), ("sk-globex", "globex")):
        async with _oai(gateway, key) as oai:
            resp = await oai.completions.create(model=SERVED, prompt="hello", max_tokens=2)
        assert resp.choices[0].text == "ok"
        assert router.received[-1].tenant == tenant
    async with _oai(gateway, "sk-globex") as oai:
        chat = await oai.chat.completions.create(
            model=SERVED, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert chat.choices[0].message.content == "ok" and router.received[-1].tenant == "globex"


async def test_missing_or_unknown_keys_are_401_and_reach_nobody(
        gateway: GatewayService, router: RecordingRouter,
        reader: InMemoryMetricReader) -> None:
    before = _rejections(reader).get(("unknown", "unauthorized"), 0)
    async with _oai(gateway, "sk-wrong") as oai:
        with pytest.raises(openai.AuthenticationError) as e:
            await oai.completions.create(model=SERVED, prompt="hello", max_tokens=2)
    assert e.value.status_code == 401 and e.value.code == "invalid_api_key"
    async with httpx.AsyncClient(base_url=gateway.url, timeout=20) as http:
        for headers in ({}, {"Authorization": "Basic c2stYWNtZS0x"},
                        {"Authorization": "Bearer"},
                        # The digest itself is not a key.
                        {"Authorization": f"Bearer {api_key_digest('sk-acme-1')}"}):
            r = await http.post("/v1/completions", headers=headers,
                                json={"model": SERVED, "prompt": "x", "max_tokens": 1})
            assert r.status_code == 401, headers
            assert r.headers["www-authenticate"] == "Bearer"
            err = r.json()["error"]
            assert err["code"] == "invalid_api_key" and err["type"] == "invalid_request_error"
            assert "key" in err["message"]
        # Models and health stay open (no tenant data there).
        assert (await http.get("/v1/models")).status_code == 200
    assert router.received == []
    assert _rejections(reader)[("unknown", "unauthorized")] == before + 5


async def test_rate_limit_is_429_with_retry_after_per_tenant(
        gateway: GatewayService, router: RecordingRouter,
        reader: InMemoryMetricReader) -> None:
    async with _oai(gateway, "sk-burst") as oai:
        for _ in range(2):  # the burst
            await oai.completions.create(model=SERVED, prompt="hello", max_tokens=1)
        with pytest.raises(openai.RateLimitError) as e:
            await oai.completions.create(model=SERVED, prompt="hello", max_tokens=1)
    assert e.value.status_code == 429 and e.value.code == "rate_limit_exceeded"
    assert 1 <= int(e.value.response.headers["retry-after"]) <= 2  # 0.5/s: 2 s at most
    # Another tenant is not slowed down by it.
    async with _oai(gateway, "sk-globex") as oai:
        await oai.completions.create(model=SERVED, prompt="hello", max_tokens=1)
    assert [r.tenant for r in router.received] == ["burst", "burst", "globex"]
    assert _rejections(reader)[("burst", "rate_limited")] == 1


async def test_size_prompt_and_max_tokens_limits(
        gateway: GatewayService, router: RecordingRouter, model: ServedModel,
        reader: InMemoryMetricReader) -> None:
    async with _oai(gateway, "sk-acme-1") as oai:
        with pytest.raises(openai.APIStatusError) as e:  # body over 2000 bytes
            await oai.completions.create(model=SERVED, prompt="word " * 500, max_tokens=1)
        assert e.value.status_code == 413 and e.value.code == "payload_too_large"
        long_prompt = "hello world " * 40  # < 2000 bytes, > 50 tokens
        assert len(model.encode(long_prompt)) > 50
        with pytest.raises(openai.BadRequestError) as e:
            await oai.completions.create(model=SERVED, prompt=long_prompt, max_tokens=1)
        assert e.value.code == "prompt_too_long" and "at most 50" in e.value.message
        with pytest.raises(openai.BadRequestError) as e:
            await oai.completions.create(model=SERVED, prompt=list(range(51)), max_tokens=1)
        assert e.value.code == "prompt_too_long"
        with pytest.raises(openai.BadRequestError) as e:
            await oai.completions.create(model=SERVED, prompt="hi", max_tokens=9)
        assert "cap of 8" in e.value.message and e.value.param == "max_tokens"
        assert router.received == []
        # Within the limits it passes; a chat's default length is clamped to the cap.
        await oai.completions.create(model=SERVED, prompt="hi", max_tokens=8)
        await oai.chat.completions.create(model=SERVED,
                                          messages=[{"role": "user", "content": "hi"}])
    assert [r.sampling.max_tokens for r in router.received] == [8, 8]
    # Another tenant has none of acme's limits.
    async with _oai(gateway, "sk-globex") as oai:
        await oai.completions.create(model=SERVED, prompt="hello world " * 40, max_tokens=9)
    got = _rejections(reader)
    assert {k: got.get(k) for k in [("acme", "request_too_large"), ("acme", "prompt_too_long"),
                                    ("acme", "max_tokens")]} == {
        ("acme", "request_too_large"): 1, ("acme", "prompt_too_long"): 2,
        ("acme", "max_tokens"): 1}


async def test_without_tenants_the_gateway_stays_open_as_the_default_tenant(
        nats_server: NatsServer, model_cache: Path, model: ServedModel,
        router: RecordingRouter) -> None:
    s = load_settings(environ={}, overrides=_overrides(nats_server, model_cache))
    assert not s.gateway.tenants
    service = GatewayService(s, model=model)
    await service.start()
    try:
        async with _oai(service, "anything") as oai:
            await oai.completions.create(model=SERVED, prompt="hello", max_tokens=30)
        async with httpx.AsyncClient(base_url=service.url, timeout=20) as http:
            r = await http.post("/v1/completions",
                                json={"model": SERVED, "prompt": "x", "max_tokens": 1})
            assert r.status_code == 200
    finally:
        await service.stop()
    assert [(r.tenant, r.sampling.max_tokens) for r in router.received] == [
        ("default", 30), ("default", 1)]
