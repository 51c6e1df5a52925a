"""Hypothesis-driven hostile bodies against the gateway's OpenAI endpoints, through the
real app (httpx's ASGI transport), a real NATS server and a scripted router: malformed
JSON, wrong types, NaN/negative sampling, huge prompts, unknown models, bad roles and
oversized bodies get a 4xx OpenAI error object, never a 500, and the gateway keeps
serving valid requests. ``CPD_FUZZ_GATEWAY_CASES`` examples per endpoint (5,000: 10,000
across both)."""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cpd.bus import Request, Service
from cpd.client import Client
from cpd.engines.servedmodel import ServedModel
from cpd.ops.config import Settings, load_settings
from cpd.ops.natsserver import NatsServer
from cpd.protocol import subjects, wire
from services.gateway.app import create_app

CASES = int(os.environ.get("CPD_FUZZ_GATEWAY_CASES", "5000"))
SERVED = "cpd-fuzz-model"
BATCH = 10

pytestmark = pytest.mark.timeout(240)


class ScriptedRouter(Service):
    """Answers every generate with one token and a final message (what a valid body
    gets), so that the gateway's whole path runs."""

    name = "router"

    async def setup(self) -> None:
        await self.add_endpoint("generate", subjects.GENERATE, self._generate,
                                expect=wire.GenerateRequest, queue=subjects.QUEUE_ROUTER)
        await self.add_endpoint("status", subjects.ROUTER_STATUS, self._status,
                                expect=wire.StatusRequest, queue=subjects.QUEUE_ROUTER)

    async def _generate(self, req: wire.GenerateRequest, r: Request) -> None:
        out = r.stream(req.request_id)
        await out.tokens([7], "x")
        await out.final(finish_reason="length", usage=wire.Usage(completion_tokens=1))

    async def _status(self, _: wire.StatusRequest, __: Request) -> wire.StatusReply:
        return wire.StatusReply(router=wire.RouterStats(node=self.node_id))


# ------------------------------------------------------------------------ strategies

_num = (st.integers(-(2**70), 2**70) | st.floats(allow_nan=True, allow_infinity=True)
        | st.sampled_from([0, -1, 1, 2**31, 2**63, 1e308]))
_any: Any = st.recursive(
    st.none() | st.booleans() | _num | st.text(max_size=30),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                max_size=4),
    max_leaves=12)
_model = st.sampled_from([SERVED, "", "gpt-4", "x" * 300]) | _any
_text = (st.text(max_size=200) | st.sampled_from(["", "\x00", "\ud800".encode(
    "utf-8", "surrogatepass").decode("utf-8", "replace")]) | st.just("y " * 40_000))
_tokens = st.lists(st.integers(-(2**40), 2**40), max_size=50) | st.lists(
    st.integers(0, 50_000), min_size=1, max_size=20)
_sampling = st.fixed_dictionaries({}, optional={
    "max_tokens": _num | _any, "temperature": _num | _any, "top_p": _num | _any,
    "top_k": _num, "seed": _num, "n": _num, "stream": st.booleans() | _any,
    "stop": _any, "logprobs": _any, "stop_token_ids": _tokens | _any,
    "ignore_eos": _any, "stream_options": _any, "echo": _any, "user": _any,
    "frequency_penalty": _num, "max_completion_tokens": _num | _any,
})
_completion = st.builds(
    lambda base, extra: {**base, **extra},
    st.fixed_dictionaries({}, optional={"model": _model,
                                        "prompt": _text | _tokens | st.lists(_text) | _any}),
    _sampling)
_message = st.fixed_dictionaries({}, optional={
    "role": st.sampled_from(["user", "system", "assistant", "tool", "bogus", "", "USER"]) | _any,
    "content": _text | st.lists(st.fixed_dictionaries({"type": st.sampled_from(
        ["text", "image_url", "x"]), "text": _text})) | _any,
    "name": _any})
_chat = st.builds(
    lambda base, extra: {**base, **extra},
    st.fixed_dictionaries({}, optional={"model": _model,
                                        "messages": st.lists(_message, max_size=4) | _any}),
    _sampling)


def _raw(kind: st.SearchStrategy[dict]) -> st.SearchStrategy[bytes]:
    """Bodies as bytes: JSON (NaN/Infinity literals included), truncated or garbled
    JSON, other JSON types, random bytes, empty and oversized bodies."""
    as_json = kind.map(lambda b: json.dumps(b, allow_nan=True).encode())
    return st.one_of(
        as_json, as_json,
        st.tuples(as_json, st.integers(0, 200)).map(lambda t: t[0][:t[1]]),
        _any.map(lambda v: json.dumps(v, allow_nan=True).encode()),
        st.binary(max_size=300),
        st.sampled_from([b"", b"{", b"null", b"[]", b'{"prompt": "\xff"}',
                         b'{"prompt": "a", "prompt": 1}', b"{" * 10_000,
                         b'{"prompt": "' + b"z" * (3 << 20) + b'"}']),
    )


# --------------------------------------------------------------------------- the test


@pytest.fixture(scope="module")
def gw_settings(nats_server: NatsServer, model_cache: Path) -> Settings:
    return load_settings(environ={}, overrides=[
        f"nats.servers={nats_server.url}", "nats.drain_timeout_s=2",
        f"model.cache_dir={model_cache}", f"gateway.served_model_name={SERVED}",
        "gateway.request_timeout_s=10"])


def _check(status: int, body: bytes, what: bytes) -> None:
    assert status < 500, f"{status} {body[:500]!r} <- {what[:200]!r}"
    if status == 200:
        return
    assert 400 <= status < 500
    err = json.loads(body)["error"]
    assert isinstance(err["message"], str) and err["message"]
    assert "type" in err and "code" in err


def test_gateway_bodies(gw_settings: Settings) -> None:
    loop = asyncio.new_event_loop()
    model = ServedModel.load(gw_settings)
    router = ScriptedRouter(gw_settings)

    async def start() -> tuple[Client, httpx.AsyncClient]:
        await router.start()
        client = await Client.connect(settings=gw_settings, name="fuzz-gateway")
        app = create_app(client, model, gw_settings)
        http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                 base_url="http://gateway", timeout=30)
        return client, http

    client, http = loop.run_until_complete(start())
    seen: dict[str, int] = {}

    async def post(path: str, body: bytes) -> tuple[int, bytes]:
        r = await http.post(path, content=body, headers={"content-type": "application/json"})
        return r.status_code, r.content

    async def batch(path: str, bodies: list[bytes]) -> list[tuple[int, bytes]]:
        return await asyncio.gather(*(post(path, b) for b in bodies))

    def run(path: str, kind: st.SearchStrategy[dict]) -> None:
        # Each example is a batch sent at once: the gateway serves them concurrently,
        # as it would a burst, and hypothesis' per-example overhead is shared.
        @settings(max_examples=CASES // BATCH, deadline=None, derandomize=True,
                  database=None, suppress_health_check=list(HealthCheck))
        @given(bodies=st.lists(_raw(kind), min_size=BATCH, max_size=BATCH))
        def case(bodies: list[bytes]) -> None:
            replies = loop.run_until_complete(batch(path, bodies))
            for body, (status, reply) in zip(bodies, replies, strict=True):
                seen[f"{path} {status}"] = seen.get(f"{path} {status}", 0) + 1
                _check(status, reply, body)

        case()

    try:
        run("/v1/completions", _completion)
        run("/v1/chat/completions", _chat)
        # Still serving: a valid request of each kind completes.
        status, reply = loop.run_until_complete(post("/v1/completions", json.dumps(
            {"model": SERVED, "prompt": "hello", "max_tokens": 1}).encode()))
        assert status == 200 and json.loads(reply)["choices"][0]["text"] == "x"
        status, reply = loop.run_until_complete(post("/v1/chat/completions", json.dumps(
            {"model": SERVED, "messages": [{"role": "user", "content": "hi"}],
             "max_tokens": 1}).encode()))
        assert status == 200, reply
    finally:
        async def stop() -> None:
            await http.aclose()
            await client.close()
            await router.stop()

        loop.run_until_complete(stop())
        loop.close()
    total = sum(seen.values())
    assert total >= 2 * CASES
    # Both sides reached: refusals and served requests.
    assert sum(n for k, n in seen.items() if k.endswith(" 200")) > 0
    assert sum(n for k, n in seen.items() if k.endswith(" 400")) > CASES // 2
