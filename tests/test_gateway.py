"""The OpenAI-compatible gateway, driven by the real ``openai`` client against a real NATS
server and a scripted router: replies and streams in OpenAI's shapes with CPD's route,
errors mapped to HTTP statuses, health, disconnects, and the Prometheus metrics of a
gateway process."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import msgspec
import openai
import pytest
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

import cpd
from cpd.bus import Request, Service
from cpd.engines.servedmodel import ServedModel
from cpd.ops import telemetry
from cpd.ops.config import Settings, load_settings
from cpd.ops.natsserver import NatsServer
from cpd.protocol import subjects, wire
from cpd.protocol.errors import (
    CpdError,
    ErrorCode,
    Overloaded,
    PromptTooLong,
    Unavailable,
    UnknownNamespace,
)
from services.gateway import GatewayService, protocol
from services.gateway.bestof import Ranking

pytestmark = pytest.mark.timeout(60)

SERVED_NAME = "cpd-test-model"
# What the scripted router generates, one token per chunk; "" is a token whose bytes end
# mid-character (the router sends no text for it yet).
PIECES = ("Once", " upon", "", " a time", " café", "!")
FIRST_TOKEN = 100
ROOT = Path(__file__).resolve().parent.parent


# The gateway's request spans, recorded in this process (what an OTLP exporter would get).
_spans = InMemorySpanExporter()
telemetry.export_spans(SimpleSpanProcessor(_spans))

class FakeRouter(Service):
    """Answers ``generate`` with ``PIECES`` (or a scripted failure) and ``status``."""

    name = "router"

    def __init__(self, settings: Settings, model: ServedModel) -> None:
        super().__init__(settings)
        self.model = model
        self.received: list[wire.GenerateRequest] = []
        self.error: CpdError | None = None  # raised instead of answering
        self.fail_after: int | None = None  # tokens sent before the stream fails
        self.error_after_wait: CpdError | None = None  # sent after first_delay_s
        self.token_delay_s = 0.0
        self.first_delay_s = 0.0  # before the first token
        self.finished = asyncio.Event()
        # What status reports: a live prefill-side and decode worker unless a test says.
        self.nodes = [wire.NodeStatus(node="pp-0", role="preprefill", alive=True),
                      wire.NodeStatus(node="d-0", role="decode", alive=True)]
        self.kvindex: str = "ok"

    async def setup(self) -> None:
        await self.add_endpoint("generate", subjects.GENERATE, self._generate,
                                expect=wire.GenerateRequest, queue=subjects.QUEUE_ROUTER)
        await self.add_endpoint("status", subjects.ROUTER_STATUS, self._status,
                                expect=wire.StatusRequest, queue=subjects.QUEUE_ROUTER)

    async def _generate(self, req: wire.GenerateRequest, request: Request) -> None:
        self.received.append(req)
        if self.error is not None:
            raise self.error
        stream = request.stream(req.request_id)
        prompt_tokens = (len(self.model.encode(req.prompt)) if req.prompt is not None
                         else len(wire.unpack_tokens(req.tokens or b"")))
        n = min(req.sampling.max_tokens, len(PIECES))
        await asyncio.sleep(self.first_delay_s)
        if self.error_after_wait is not None:
            await stream.error(self.error_after_wait)
            return
        # Choice c (of the request's n) gets the first n - c pieces, side by side.
        lengths = [n - c for c in range(req.sampling.n)]
        for i in range(n):
            if i == self.fail_after:
                await stream.error(Unavailable("decode node lost"))
                return
            k = req.sampling.logprobs
            for c in (c for c, length in enumerate(lengths) if i < length):
                await stream.tokens([FIRST_TOKEN + i], PIECES[i], index=c, logprobs=(
                    None if k is None else [wire.TokenLogprob(
                        logprob=-0.5 - i, rank=2,  # the second most likely
                        top=[(7, -0.25), (FIRST_TOKEN + i, -0.5 - i), (9, -3.0)][:k])]))
            await asyncio.sleep(self.token_delay_s)
        ends = [wire.ChoiceEnd(index=c, completion_tokens=length, finish_reason=(
            "length" if length == req.sampling.max_tokens else "stop"))
            for c, length in enumerate(lengths)]
        await stream.final(
            finish_reason=ends[0].finish_reason, choices=ends if len(ends) > 1 else [],
            usage=wire.Usage(prompt_tokens=prompt_tokens, completion_tokens=sum(lengths),
                             cached_tokens=prompt_tokens // 2),
            timings=wire.Timings(ttft_ms=1.5, total_ms=3.0),
            route=wire.Route(policy="fake", path="cold", prefill_node="pp-0",
                             decode_node="d-0",
                             tokens=wire.PromptTokens(
                                 dram=prompt_tokens // 2,
                                 computed=prompt_tokens - prompt_tokens // 2)))
        self.finished.set()

    async def _status(self, _: wire.StatusRequest, __: Request) -> wire.StatusReply:
        return wire.StatusReply(router=wire.RouterStats(node=self.node_id, policy="fake"),
                                nodes=self.nodes, kvindex=self.kvindex)  # type: ignore[arg-type]


# ------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def gw_settings(nats_server: NatsServer, model_cache: Path) -> Settings:
    return load_settings(environ={}, overrides=[
        f"nats.servers={nats_server.url}", "nats.drain_timeout_s=2",
        f"model.cache_dir={model_cache}", "gateway.port=0",
        f"gateway.served_model_name={SERVED_NAME}", "gateway.request_timeout_s=20",
        "gateway.sse_keepalive_s=0.2"])


@pytest.fixture(scope="module")
def model(gw_settings: Settings) -> ServedModel:
    return ServedModel.load(gw_settings)


@pytest.fixture(scope="module")
async def gateway(gw_settings: Settings, model: ServedModel) -> AsyncIterator[GatewayService]:
    service = GatewayService(gw_settings, model=model)
    await service.start()
    yield service
    await service.stop()


@pytest.fixture
async def router(gw_settings: Settings, model: ServedModel) -> AsyncIterator[FakeRouter]:
    service = FakeRouter(gw_settings, model)
    await service.start()
    yield service
    await service.stop()


@pytest.fixture
async def oai(gateway: GatewayService) -> AsyncIterator[openai.AsyncOpenAI]:
    # No retries: each test sees exactly one attempt and its error.
    client = openai.AsyncOpenAI(base_url=f"{gateway.url}/v1", api_key="x", max_retries=0,
                                timeout=20)
    yield client
    await client.close()


@pytest.fixture
async def http(gateway: GatewayService) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=gateway.url, timeout=20) as client:
        yield client


def _extra(obj: Any, name: str) -> Any:
    """A field the OpenAI SDK's models do not declare (kept as extras)."""
    return (obj.model_extra or {}).get(name)


async def _sse_events(response: httpx.Response) -> list[Any]:
    """The ``data:`` payloads of an SSE body, JSON-decoded except ``[DONE]``."""
    events = []
    async for line in response.aiter_lines():
        if line.startswith("data: "):
            data = line[len("data: "):]
            events.append(data if data == "[DONE]" else msgspec.json.decode(data))
    return events


# ------------------------------------------------------------------- completions


async def test_completion_reply_has_openai_shape_and_cpd_route(
        oai: openai.AsyncOpenAI, router: FakeRouter, gw_settings: Settings,
        model: ServedModel) -> None:
    resp = await oai.completions.create(model=SERVED_NAME, prompt="def fib(n):",
                                        max_tokens=4, temperature=0, seed=7)
    assert resp.object == "text_completion" and resp.model == SERVED_NAME
    assert resp.id.startswith("cmpl-") and resp.created > 0
    assert resp.choices[0].text == "".join(PIECES[:4])
    assert resp.choices[0].finish_reason == "length"
    prompt_tokens = len(model.encode("def fib(n):"))
    assert resp.usage is not None
    assert (resp.usage.prompt_tokens, resp.usage.completion_tokens,
            resp.usage.total_tokens) == (prompt_tokens, 4, prompt_tokens + 4)
    cpd = _extra(resp, "cpd")
    assert cpd["route"]["path"] == "cold" and cpd["route"]["prefill_node"] == "pp-0"
    assert cpd["timings"]["ttft_ms"] == 1.5
    assert resp.id == f"cmpl-{cpd['request_id']}" == f"cmpl-{router.received[-1].request_id}"
    sent = router.received[-1]
    # The gateway tokenizes once and sends the ids: the router never sees text.
    assert sent.prompt is None and sent.tokens is not None
    assert wire.unpack_tokens(sent.tokens).tolist() == model.encode("def fib(n):")
    assert sent.model == model.name  # clients' alias, the cluster's own name
    assert (sent.sampling.max_tokens, sent.sampling.temperature, sent.sampling.seed) == (
        4, 0.0, 7)
    assert sent.timeout_ms == int(gw_settings.gateway.request_timeout_s * 1000)


async def test_several_choices_whole_and_streamed(oai: openai.AsyncOpenAI,
                                                  router: FakeRouter) -> None:
    """``n`` reaches the router; each choice's text, log probabilities (offsets of its
    own text) and finish reason come under its index, whole or streamed (chat)."""
    resp = await oai.completions.create(model=SERVED_NAME, prompt="x", n=3, max_tokens=6,
                                        logprobs=1)
    assert router.received[-1].sampling.n == 3
    assert [c.index for c in resp.choices] == [0, 1, 2]
    assert [c.text for c in resp.choices] == ["".join(PIECES[:6 - c]) for c in range(3)]
    assert [c.finish_reason for c in resp.choices] == ["length", "stop", "stop"]
    for c in resp.choices:
        assert c.logprobs is not None and c.logprobs.text_offset is not None
        assert len(c.logprobs.text_offset) == 6 - c.index
        assert c.logprobs.text_offset[0] == 0
    assert resp.usage is not None and resp.usage.completion_tokens == 6 + 5 + 4
    stream = await oai.chat.completions.create(
        model=SERVED_NAME, messages=[{"role": "user", "content": "x"}], n=2, max_tokens=6,
        stream=True)
    texts: dict[int, str] = {}
    finishes: dict[int, str] = {}
    async for chunk in stream:
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + (c.delta.content or "")
            if c.finish_reason:
                finishes[c.index] = c.finish_reason
    assert texts == {0: "".join(PIECES), 1: "".join(PIECES[:5])}
    assert finishes == {0: "length", 1: "stop"}


async def test_best_of_returns_the_most_likely_choices(oai: openai.AsyncOpenAI,
                                                       router: FakeRouter) -> None:
    """``best_of`` = 3, ``n`` = 2: three choices generated with their log probabilities
    (choice c's tokens score -0.5 - i each, and it has 6 - c of them: the shorter, the
    likelier), the two best returned, best first, without log probabilities unless
    asked; usage counts every token generated."""
    resp = await oai.completions.create(model=SERVED_NAME, prompt="x", n=2, best_of=3,
                                        max_tokens=6)
    sampling = router.received[-1].sampling
    assert (sampling.n, sampling.logprobs) == (3, 0)
    assert [(c.index, c.text) for c in resp.choices] == [(0, "".join(PIECES[:4])),
                                                         (1, "".join(PIECES[:5]))]
    assert all(c.logprobs is None for c in resp.choices)
    assert resp.usage is not None and resp.usage.completion_tokens == 6 + 5 + 4
    asked = await oai.completions.create(model=SERVED_NAME, prompt="x", best_of=2,
                                         max_tokens=6, logprobs=1)
    assert [c.text for c in asked.choices] == ["".join(PIECES[:5])]
    lp = asked.choices[0].logprobs
    assert lp is not None and lp.token_logprobs == [-0.5 - i for i in range(5)]


async def test_completion_defaults_and_stop_reason(oai: openai.AsyncOpenAI,
                                                   router: FakeRouter) -> None:
    resp = await oai.completions.create(model=SERVED_NAME, prompt="x")
    # Fewer pieces than the default 16 tokens: the router stopped on its own.
    assert resp.choices[0].text == "".join(PIECES)
    assert resp.choices[0].finish_reason == "stop"
    sampling = router.received[-1].sampling
    assert sampling.max_tokens == 16 and sampling.temperature == 1.0  # OpenAI's defaults


async def test_completion_stream_assembles_the_router_text(oai: openai.AsyncOpenAI,
                                                          router: FakeRouter) -> None:
    stream = await oai.completions.create(model=SERVED_NAME, prompt="def fib(n):",
                                          max_tokens=5, stream=True,
                                          stream_options={"include_usage": True})
    chunks = [c async for c in stream]
    texts = [c.choices[0].text for c in chunks if c.choices and c.choices[0].text]
    assert texts == [p for p in PIECES[:5] if p]  # no chunk for the text-less token
    assert all(c.object == "text_completion" and c.model == SERVED_NAME for c in chunks)
    assert len({c.id for c in chunks}) == 1
    last = next(c for c in chunks if c.choices and c.choices[0].finish_reason)
    assert last.choices[0].finish_reason == "length"
    assert _extra(last, "cpd")["route"]["path"] == "cold"
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 5


async def test_completion_logprobs_as_vllm_writes_them(
        oai: openai.AsyncOpenAI, router: FakeRouter, model: ServedModel) -> None:
    """Per token: its text, log probability, offset, and the token with the ``logprobs``
    most likely ones (the token first, without repeats): whole and streamed alike."""
    def text(t: int) -> str:
        return model.tokenizer.decode([t], skip_special_tokens=False)

    resp = await oai.completions.create(model=SERVED_NAME, prompt="x", max_tokens=3,
                                        logprobs=2)
    lp = resp.choices[0].logprobs
    assert router.received[-1].sampling.logprobs == 2
    assert lp is not None and lp.tokens == [text(FIRST_TOKEN + i) for i in range(3)]
    assert lp.token_logprobs == [-0.5, -1.5, -2.5]
    assert lp.top_logprobs == [{text(FIRST_TOKEN + i): -0.5 - i, text(7): -0.25}
                               for i in range(3)]
    assert lp.text_offset == [0, len(lp.tokens[0]), len(lp.tokens[0]) + len(lp.tokens[1])]
    stream = await oai.completions.create(model=SERVED_NAME, prompt="x", max_tokens=3,
                                          logprobs=2, stream=True)
    parts = [c.choices[0].logprobs async for c in stream
             if c.choices and c.choices[0].logprobs]
    # One part per token, the text-less one included; offsets run across chunks.
    assert [t for p in parts for t in p.tokens] == lp.tokens
    assert [o for p in parts for o in p.text_offset] == lp.text_offset
    no = await oai.completions.create(model=SERVED_NAME, prompt="x", max_tokens=1)
    assert no.choices[0].logprobs is None and router.received[-1].sampling.logprobs is None


async def test_chat_logprobs_as_vllm_writes_them(oai: openai.AsyncOpenAI,
                                                router: FakeRouter,
                                                model: ServedModel) -> None:
    resp = await oai.chat.completions.create(
        model=SERVED_NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=2,
        logprobs=True, top_logprobs=2)
    content = resp.choices[0].logprobs.content  # type: ignore[union-attr]
    assert router.received[-1].sampling.logprobs == 2
    first = model.tokenizer.decode([FIRST_TOKEN], skip_special_tokens=False)
    assert content[0].token == first and content[0].logprob == -0.5
    assert content[0].bytes == list(first.encode())
    assert [(t.token, t.logprob) for t in content[0].top_logprobs] == [
        (first, -0.5), (model.tokenizer.decode([7], skip_special_tokens=False), -0.25)]
    await oai.chat.completions.create(model=SERVED_NAME, max_tokens=1, logprobs=True,
                                      messages=[{"role": "user", "content": "hi"}])
    assert router.received[-1].sampling.logprobs == 0
    with pytest.raises(openai.BadRequestError) as err:
        await oai.chat.completions.create(model=SERVED_NAME, max_tokens=1, top_logprobs=2,
                                          messages=[{"role": "user", "content": "hi"}])
    assert err.value.body["param"] == "top_logprobs"  # type: ignore[index]


async def test_echo_sends_the_prompt_first(oai: openai.AsyncOpenAI, router: FakeRouter,
                                           model: ServedModel) -> None:
    resp = await oai.completions.create(model=SERVED_NAME, prompt="def f", max_tokens=2,
                                        echo=True)
    assert resp.choices[0].text == "def f" + "".join(PIECES[:2])
    ids = model.encode("def g")
    stream = await oai.completions.create(model=SERVED_NAME, prompt=ids, max_tokens=2,
                                          echo=True, stream=True)
    texts = [c.choices[0].text async for c in stream if c.choices]
    assert "".join(texts) == model.tokenizer.decode(ids, skip_special_tokens=False) + "".join(
        PIECES[:2])


async def test_token_id_prompts(oai: openai.AsyncOpenAI, router: FakeRouter,
                                model: ServedModel) -> None:
    for prompt in ([1, 2, 3], [[1, 2, 3]]):
        resp = await oai.completions.create(model=SERVED_NAME, prompt=prompt, max_tokens=2)
        assert resp.choices[0].text == "".join(PIECES[:2])
        sent = router.received[-1]
        assert sent.prompt is None and wire.unpack_tokens(sent.tokens or b"").tolist() == [
            1, 2, 3]
        assert resp.usage is not None and resp.usage.prompt_tokens == 3
    with pytest.raises(openai.BadRequestError) as err:
        await oai.completions.create(model=SERVED_NAME, prompt=[1, model.vocab_size],
                                     max_tokens=2)
    assert err.value.body["param"] == "prompt"  # type: ignore[index]
    with pytest.raises(openai.BadRequestError) as err:
        await oai.completions.create(model=SERVED_NAME, prompt=[1] * model.max_model_len)
    assert err.value.body["code"] == "prompt_too_long"  # type: ignore[index]
    assert len(router.received) == 2  # both refused at the door


# -------------------------------------------------------------------------- chat


async def test_chat_reply_renders_messages_with_the_template(
        oai: openai.AsyncOpenAI, router: FakeRouter, model: ServedModel) -> None:
    messages = [{"role": "system", "content": "You answer briefly."},
                {"role": "user", "content": "What is a fox?"}]
    resp = await oai.chat.completions.create(model=SERVED_NAME, messages=messages,  # type: ignore[arg-type]
                                             max_completion_tokens=3)
    assert resp.object == "chat.completion" and resp.id.startswith("chatcmpl-")
    msg = resp.choices[0].message
    assert msg.role == "assistant" and msg.content == "".join(PIECES[:3])
    assert resp.choices[0].finish_reason == "length"
    assert _extra(resp, "cpd")["route"]["path"] == "cold"
    sent = router.received[-1]
    assert sent.prompt is None and sent.tokens is not None
    assert model.decode(wire.unpack_tokens(sent.tokens).tolist()) == model.render_chat(messages)
    assert sent.sampling.max_tokens == 3


@pytest.mark.parametrize("kind", ["chat", "completion"])
async def test_a_request_is_tokenized_once(oai: openai.AsyncOpenAI, router: FakeRouter,
                                           model: ServedModel,
                                           monkeypatch: pytest.MonkeyPatch, kind: str) -> None:
    """The gateway tokenizes (once) and sends ids: the router and the workers take them
    as they are (the router tokenizes only a request that carries text)."""
    calls: list[str] = []
    encode = ServedModel.encode
    monkeypatch.setattr(ServedModel, "encode",
                        lambda self, text, **kw: calls.append(text) or encode(self, text, **kw))
    if kind == "chat":
        await oai.chat.completions.create(
            model=SERVED_NAME, messages=[{"role": "user", "content": "Count the foxes."}],
            max_completion_tokens=2)
    else:
        await oai.completions.create(model=SERVED_NAME, prompt="Count the foxes.",
                                     max_tokens=2)
    sent = router.received[-1]
    assert len(calls) == 1 and sent.prompt is None
    assert wire.unpack_tokens(sent.tokens or b"").tolist() == encode(model, calls[0])


@pytest.mark.parametrize(("chars", "on_loop"), [(4_000, True), (10_000, False)])
async def test_a_short_prompt_is_tokenized_on_the_loop_and_a_long_one_on_a_thread(
        oai: openai.AsyncOpenAI, router: FakeRouter, monkeypatch: pytest.MonkeyPatch,
        chars: int, on_loop: bool) -> None:
    """Up to ``gateway.tokenize_inline_chars`` (8,192 by default) a prompt is tokenized
    on the event loop (as costly as the hop to a thread); past it on a thread, so the
    loop goes on relaying other streams meanwhile."""
    where: list[bool] = []
    encode = ServedModel.encode

    def spy(self: ServedModel, text: str, **kw: bool) -> list[int]:
        try:
            asyncio.get_running_loop()
            where.append(True)
        except RuntimeError:
            where.append(False)
        return encode(self, text, **kw)
    monkeypatch.setattr(ServedModel, "encode", spy)
    await oai.completions.create(model=SERVED_NAME, prompt="fox " * (chars // 4),
                                 max_tokens=2)
    assert where == [on_loop] and router.received[-1].tokens


async def test_chat_without_max_tokens_may_fill_the_context(
        oai: openai.AsyncOpenAI, router: FakeRouter, model: ServedModel) -> None:
    messages = [{"role": "user", "content": [{"type": "text", "text": "Hi"},
                                             {"type": "text", "text": " there"}]}]
    await oai.chat.completions.create(model=SERVED_NAME, messages=messages)  # type: ignore[arg-type]
    sent = router.received[-1]
    # Text parts joined by a newline, as vLLM joins them.
    prompt = model.render_chat([{"role": "user", "content": "Hi\n there"}])
    ids = model.encode(prompt, add_special_tokens=False)
    assert wire.unpack_tokens(sent.tokens or b"").tolist() == ids
    assert sent.sampling.max_tokens == model.max_model_len - len(ids)


async def test_chat_stream_has_role_deltas_usage_and_route(oai: openai.AsyncOpenAI,
                                                           router: FakeRouter) -> None:
    stream = await oai.chat.completions.create(
        model=SERVED_NAME, messages=[{"role": "user", "content": "Tell me a story"}],
        max_tokens=6, stream=True, stream_options={"include_usage": True})
    chunks = [c async for c in stream]
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "".join(PIECES)
    last = next(c for c in chunks if c.choices and c.choices[0].finish_reason)
    assert last.choices[0].finish_reason == "length"
    assert _extra(last, "cpd")["route"]["decode_node"] == "d-0"
    usage = chunks[-1].usage
    assert usage is not None and usage.completion_tokens == 6
    assert usage.prompt_tokens_details is not None
    assert usage.prompt_tokens_details.cached_tokens == usage.prompt_tokens // 2


# --------------------------------------------------------------- models, health


async def test_models_lists_the_served_model(oai: openai.AsyncOpenAI) -> None:
    models = [m async for m in oai.models.list()]
    assert [m.id for m in models] == [SERVED_NAME] and models[0].owned_by == "cpd"


async def test_health_is_liveness_and_ready_needs_a_router_and_workers(
        http: httpx.AsyncClient, router: FakeRouter) -> None:
    resp = await http.get("/health")
    assert resp.status_code == 200 and resp.json() == {"status": "ok", "nats_connected": True}
    resp = await http.get("/ready")
    assert resp.status_code == 200 and resp.json() == {"status": "ready", "workers": 2}
    router.nodes = [router.nodes[0]]  # no decode node
    resp = await http.get("/ready")
    assert resp.status_code == 503 and resp.json()["reason"] == "no live decode worker"
    router.nodes = [wire.NodeStatus(node="pp-0", role="preprefill", alive=False),
                    wire.NodeStatus(node="d-0", role="decode", alive=True)]
    resp = await http.get("/ready")
    assert resp.status_code == 503 and resp.json()["reason"] == "no live prefill worker"
    router.nodes = []
    resp = await http.get("/ready")
    assert resp.json()["reason"] == "no live prefill or decode worker"
    router.kvindex = "recovering"
    resp = await http.get("/ready")
    assert resp.status_code == 503 and resp.json()["reason"] == "kvindex is recovering"
    # A slow index (some lookups past their deadline) serves: it keeps the gateway in
    # service; a lagging or unavailable one does not.
    router.nodes = [wire.NodeStatus(node="pp-0", role="preprefill", alive=True),
                    wire.NodeStatus(node="d-0", role="decode", alive=True)]
    for state, code in (("slow", 200), ("lagging", 503), ("unavailable", 503), ("ok", 200)):
        router.kvindex = state
        assert (await http.get("/ready")).status_code == code, state


async def test_ready_without_a_router(http: httpx.AsyncClient) -> None:
    assert (await http.get("/health")).status_code == 200  # alive all the same
    resp = await http.get("/ready")
    assert resp.status_code == 503
    assert resp.json()["status"] == "unavailable" and "router" in resp.json()["reason"]


async def test_tokenize_detokenize_version_and_the_openapi_schema(
        http: httpx.AsyncClient, model: ServedModel) -> None:
    resp = await http.post("/tokenize", json={"model": SERVED_NAME, "prompt": "def fib(n):"})
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert body["tokens"] == model.encode("def fib(n):") and body["count"] == len(body["tokens"])
    assert body["max_model_len"] == model.max_model_len
    messages = [{"role": "user", "content": "hello"}]
    chat = (await http.post("/tokenize", json={"messages": messages})).json()
    rendered = protocol.chat_prompt(protocol.ChatRequest(
        messages=[protocol.ChatMessage(role="user", content="hello")]), model)
    assert chat["tokens"] == model.encode(rendered)
    resp = await http.post("/detokenize", json={"tokens": body["tokens"]})
    assert resp.status_code == 200 and resp.json() == {"prompt": "def fib(n):"}
    for path, bad, param in (("/detokenize", {"tokens": [-1]}, "tokens"),
                             ("/detokenize", {"tokens": "x"}, "tokens"),
                             ("/tokenize", {}, "prompt"),
                             ("/tokenize", {"prompt": "x", "model": "other"}, "model")):
        resp = await http.post(path, json=bad)
        assert resp.status_code in (400, 404) and resp.json()["error"]["param"] == param, bad
    assert (await http.get("/version")).json() == {"version": cpd.__version__}
    schema = (await http.get("/openapi.json")).json()
    assert {"/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize",
            "/version", "/health", "/ready"} <= set(schema["paths"])
    assert (await http.get("/docs")).status_code == 200


async def test_a_waiting_stream_gets_its_headers_then_keepalives(
        http: httpx.AsyncClient, router: FakeRouter) -> None:
    """A request whose first token is slow in coming (a queued cold prefill) gets its
    HTTP headers after ``gateway.stream_headers_after_s`` and a chunk with no choices
    every ``gateway.sse_keepalive_s`` (0.2 s here) until it comes, never an SSE comment;
    an error after the headers is an SSE error event."""
    router.first_delay_s = 1.5
    body = {"model": SERVED_NAME, "prompt": "hi", "max_tokens": 3, "stream": True}
    t0 = time.monotonic()
    async with http.stream("POST", "/v1/completions", json=body) as resp:
        headers_after = time.monotonic() - t0
        assert resp.status_code == 200
        lines = [line async for line in resp.aiter_lines()]
    assert headers_after < 1.2  # long before the first token
    assert not [x for x in lines if x.startswith(":")]
    data = [msgspec.json.decode(x[6:]) for x in lines
            if x.startswith("data: ") and x != "data: [DONE]"]
    keepalives = [x for x in data if not x["choices"]]
    assert len(keepalives) >= 3 and all(x["object"] == "text_completion" for x in keepalives)
    assert data[0]["choices"] == []       # the stream opens with keep-alives
    assert "".join(x["choices"][0]["text"] for x in data if x["choices"]) == "".join(
        PIECES[:3])
    assert [x for x in lines if x][-1] == "data: [DONE]"
    router.error_after_wait = Unavailable("no decode node")
    async with http.stream("POST", "/v1/completions", json=body) as resp:
        assert resp.status_code == 200
        events = await _sse_events(resp)
    assert events[-2]["error"]["code"] == "unavailable" and events[-1] == "[DONE]"


@pytest.mark.parametrize("backend", ["openai", "openai-chat"])
async def test_vllm_benchmark_client_times_the_first_token_past_keepalives(
        gateway: GatewayService, router: FakeRouter, backend: str) -> None:
    """vLLM's own benchmark request functions (``vllm bench serve``), which strip each
    network read before splitting on blank lines, read a stream whose first token comes
    after several keep-alives: the request succeeds and its TTFT is the first token's."""
    import aiohttp
    from vllm.benchmarks.lib.endpoint_request_func import (
        ASYNC_REQUEST_FUNCS,
        RequestFuncInput,
    )

    router.first_delay_s = 1.2
    path = "/v1/chat/completions" if backend == "openai-chat" else "/v1/completions"
    req = RequestFuncInput(prompt="hi", api_url=gateway.url + path, prompt_len=1,
                           output_len=3, model=SERVED_NAME)
    async with aiohttp.ClientSession() as session:
        out = await ASYNC_REQUEST_FUNCS[backend](req, session)
    assert out.success, out.error
    assert out.ttft >= 1.1 and out.generated_text == "".join(PIECES[:3])


async def test_openai_client_streams_past_keepalives(oai: openai.AsyncOpenAI,
                                                     router: FakeRouter) -> None:
    """The official client yields the keep-alives as chunks without choices and the
    text whole."""
    router.first_delay_s = 1.5   # headers after 0.5 s, then a keep-alive every 0.2 s
    stream = await oai.chat.completions.create(
        model=SERVED_NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=3,
        stream=True)
    chunks = [c async for c in stream]
    assert sum(not c.choices for c in chunks) >= 2
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "".join(
        PIECES[:3])


@pytest.mark.parametrize(("field", "value"), [
    ("seed", 1 << 64), ("seed", -(1 << 63) - 1), ("priority", 1 << 63), ("top_k", 1 << 31),
    ("top_k", -2), ("stop_token_ids", [1 << 32])])
async def test_integers_past_what_the_engines_take_are_refused(
        http: httpx.AsyncClient, router: FakeRouter, field: str, value: object) -> None:
    """Every integer a client may set is bounded where it is read (a 400 naming the
    field), so none can fail later when the request is encoded for the router."""
    resp = await http.post("/v1/completions", json={"prompt": "hi", field: value})
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] in (field, f"{field}[0]")
    assert not router.received


async def test_truncate_prompt_tokens_is_refused_not_dropped(
        http: httpx.AsyncClient, router: FakeRouter) -> None:
    resp = await http.post("/v1/completions",
                           json={"prompt": "hi", "truncate_prompt_tokens": 10})
    assert resp.status_code == 400
    assert resp.json()["error"]["param"] == "truncate_prompt_tokens"
    assert not router.received


async def test_sampling_fields_reach_the_router(oai: openai.AsyncOpenAI,
                                                router: FakeRouter) -> None:
    """vLLM's sampling fields travel to the router as the wire's SamplingParams: stop
    strings (one or a list), penalties, logit_bias keyed by token id, min_tokens..."""
    await oai.completions.create(
        model=SERVED_NAME, prompt="hi", max_tokens=8, stop="\n", presence_penalty=0.5,
        frequency_penalty=-0.25, logit_bias={"7": 3.5}, seed=3,
        extra_body={"stop_token_ids": [5], "top_k": 3, "min_p": 0.1,
                    "repetition_penalty": 1.2, "min_tokens": 2,
                    "skip_special_tokens": False, "include_stop_str_in_output": True})
    s = router.received[-1].sampling
    assert (s.stop, s.stop_token_ids, s.top_k, s.seed) == (["\n"], [5], 3, 3)
    assert (s.presence_penalty, s.frequency_penalty, s.min_p, s.repetition_penalty) == (
        0.5, -0.25, 0.1, 1.2)
    assert s.logit_bias == {7: 3.5} and s.min_tokens == 2
    assert not s.skip_special_tokens and s.include_stop_str_in_output
    await oai.chat.completions.create(model=SERVED_NAME, max_tokens=2, stop=["a", "bc"],
                                      messages=[{"role": "user", "content": "hi"}])
    assert router.received[-1].sampling.stop == ["a", "bc"]


@pytest.mark.parametrize(("field", "value"), [
    ("logit_bias", {"x": 1}), ("logit_bias", {"5": 101}), ("presence_penalty", 2.5),
    ("min_p", 1.5), ("repetition_penalty", 0), ("min_tokens", 99), ("stop", [""]),
    ("stop", ["s"] * 65)])
async def test_bad_sampling_values_are_refused(http: httpx.AsyncClient, router: FakeRouter,
                                               field: str, value: object) -> None:
    resp = await http.post("/v1/completions",
                           json={"prompt": "hi", "max_tokens": 4, field: value})
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"].split("[")[0].split(".")[0] in (field, "sampling")
    assert not router.received


async def test_request_spans_carry_the_genai_attributes(http: httpx.AsyncClient,
                                                       router: FakeRouter) -> None:
    _spans.clear()
    resp = await http.post("/v1/chat/completions", json={
        "model": SERVED_NAME, "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 3, "temperature": 0, "top_p": 0.9})
    assert resp.status_code == 200, resp.text
    (span,) = [s for s in _spans.get_finished_spans()
               if s.name == "gateway /v1/chat/completions"]
    attrs = dict(span.attributes or {})
    assert attrs["gen_ai.operation.name"] == "chat"
    assert attrs["gen_ai.provider.name"] == "cpd"
    assert attrs["gen_ai.request.model"] == SERVED_NAME
    assert attrs["gen_ai.request.max_tokens"] == 3
    assert attrs["gen_ai.request.temperature"] == 0 and attrs["gen_ai.request.top_p"] == 0.9
    assert attrs["gen_ai.response.id"] == resp.headers["x-request-id"]
    assert list(attrs["gen_ai.response.finish_reasons"]) == ["length"]
    usage = resp.json()["usage"]
    assert attrs["gen_ai.usage.input_tokens"] == usage["prompt_tokens"]
    assert attrs["gen_ai.usage.output_tokens"] == usage["completion_tokens"] == 3


async def test_cache_salt_and_priority_reach_the_router(http: httpx.AsyncClient,
                                                        router: FakeRouter) -> None:
    resp = await http.post("/v1/completions", json={
        "prompt": "hi", "max_tokens": 1, "cache_salt": "user-7", "priority": 5})
    assert resp.status_code == 200, resp.text
    req = router.received[-1]
    # vLLM serves lower priority values first; the router's admission, higher ones.
    assert req.cache_salt == "user-7" and req.priority == -5 and req.tenant == "default"


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
async def test_return_token_ids_whole_and_streamed(http: httpx.AsyncClient,
                                                   router: FakeRouter, model: ServedModel,
                                                   path: str) -> None:
    """vLLM's ``return_token_ids``: each choice's generated ids (a stream's chunk its new
    ones, the id whose bytes end mid-character included though it has no text yet) and
    the prompt's ids (a stream's first chunk with choices)."""
    body: dict[str, Any] = {"max_tokens": 5, "return_token_ids": True, "temperature": 0}
    if path == "/v1/completions":
        body["prompt"] = "hi"
    else:
        body["messages"] = [{"role": "user", "content": "hi"}]
    chat = path == "/v1/chat/completions"

    def prompt_ids(body: dict) -> list[int] | None:
        # vLLM's places: the top level for Chat, each choice for Completions.
        return (body if chat else body["choices"][0]).get("prompt_token_ids")

    resp = await http.post(path, json=body)
    assert resp.status_code == 200, resp.text
    reply = resp.json()
    sent = wire.unpack_tokens(router.received[-1].tokens or b"").tolist()
    assert prompt_ids(reply) == sent  # what the router was sent, the prompt's ids
    assert "prompt_token_ids" not in (reply["choices"][0] if chat else reply)
    if not chat:
        assert sent == model.encode("hi")
    assert reply["choices"][0]["token_ids"] == [FIRST_TOKEN + i for i in range(5)]
    async with http.stream("POST", path, json={**body, "stream": True}) as r:
        events = await _sse_events(r)
    chunks = [e for e in events if e != "[DONE]" and e["choices"]]
    assert prompt_ids(chunks[0]) == sent
    assert all(prompt_ids(c) is None for c in chunks[1:])
    ids = [t for c in chunks for t in c["choices"][0].get("token_ids", [])]
    assert ids == [FIRST_TOKEN + i for i in range(5)]
    plain = (await http.post(path, json={**body, "return_token_ids": False})).json()
    assert prompt_ids(plain) is None and "token_ids" not in plain["choices"][0]


async def test_a_client_request_id_names_the_request(http: httpx.AsyncClient,
                                                     router: FakeRouter) -> None:
    resp = await http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1},
                           headers={"X-Request-Id": "agent-7_turn-3"})
    assert resp.status_code == 200, resp.text
    assert resp.headers["x-request-id"] == "agent-7_turn-3"
    assert router.received[-1].request_id == "agent-7_turn-3"
    assert resp.json()["id"] == "cmpl-agent-7_turn-3"
    for bad in ("", "a" * 65, "has space", "dots.not.allowed"):
        resp = await http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1},
                               headers={"X-Request-Id": bad})
        assert resp.status_code == 400, bad
        assert resp.json()["error"]["param"] == "x-request-id"


async def test_cpd_resume_reaches_the_router(http: httpx.AsyncClient,
                                             router: FakeRouter) -> None:
    """A stream retried on another gateway: what the client has reaches the router as
    the request's resume (the router regenerates it and sends what follows)."""
    resp = await http.post("/v1/completions", headers={"X-Request-Id": "r1"}, json={
        "prompt": "hi", "max_tokens": 4, "temperature": 0,
        "cpd_resume": {"token_ids": [100, 101], "text_chars": 9}})
    assert resp.status_code == 200, resp.text
    req = router.received[-1]
    assert req.request_id == "r1"
    assert wire.unpack_tokens(req.resume_tokens).tolist() == [100, 101]
    assert req.resume_text_chars == 9
    assert router.received[-1].resume_tokens  # and a request without it has none:
    await http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1})
    assert router.received[-1].resume_tokens == b""
    for bad, param in (({"token_ids": [1], "text_chars": -1}, "cpd_resume"),
                       ({"token_ids": [-1]}, "cpd_resume"),
                       ({"token_ids": [1], "extra": 1}, "cpd_resume")):
        resp = await http.post("/v1/completions", json={
            "prompt": "hi", "max_tokens": 4, "cpd_resume": bad})
        assert resp.status_code == 400, bad
        assert resp.json()["error"]["param"].startswith(param), resp.json()
    resp = await http.post("/v1/completions", json={
        "prompt": "hi", "max_tokens": 4, "n": 2, "cpd_resume": {"token_ids": [1]}})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "cpd_resume"
    # What the router would refuse is refused here, before other streams are ended: a
    # request that cannot be regenerated, or more tokens than it may have.
    sent = len(router.received)
    for body in ({"temperature": 0.8}, {"temperature": 0, "max_tokens": 1}):
        resp = await http.post("/v1/completions", json={
            "prompt": "hi", "max_tokens": 4, **body, "cpd_resume": {"token_ids": [1, 2]}})
        assert resp.status_code == 400, body
    assert len(router.received) == sent


# ------------------------------------------------------------------------ errors


@pytest.mark.parametrize(("error", "exc_type", "status"), [
    (Overloaded("admission queue full"), openai.RateLimitError, 429),
    (Unavailable("no decode node"), openai.InternalServerError, 503),
    (CpdError("deadline passed", code=ErrorCode.DEADLINE_EXCEEDED),
     openai.InternalServerError, 504),
    (PromptTooLong("prompt of 9000 tokens"), openai.BadRequestError, 400),
    (UnknownNamespace("no such namespace"), openai.NotFoundError, 404),
    (CpdError("bug", code=ErrorCode.INTERNAL), openai.InternalServerError, 500),
])
@pytest.mark.parametrize("stream", [False, True])
async def test_router_errors_map_to_http(oai: openai.AsyncOpenAI, router: FakeRouter,
                                         error: CpdError, exc_type: type[Exception],
                                         status: int, stream: bool) -> None:
    router.error = error
    with pytest.raises(exc_type) as err:
        await oai.completions.create(model=SERVED_NAME, prompt="hi", max_tokens=2,
                                     stream=stream)
    api_error = err.value
    assert isinstance(api_error, openai.APIStatusError)
    assert api_error.status_code == status
    body = api_error.body
    assert isinstance(body, dict) and body["code"] == error.code.value
    assert body["message"] == error.message and "type" in body and "param" in body
    if status == 429:
        assert body["type"] == "rate_limit_error"
        assert api_error.response.headers["retry-after"] == "1"


async def test_no_router_is_503(oai: openai.AsyncOpenAI) -> None:
    with pytest.raises(openai.InternalServerError) as err:
        await oai.completions.create(model=SERVED_NAME, prompt="hi", max_tokens=2)
    assert err.value.status_code == 503
    assert err.value.body["code"] == "no_responders"  # type: ignore[index]


async def test_unknown_model_is_404(oai: openai.AsyncOpenAI, router: FakeRouter) -> None:
    with pytest.raises(openai.NotFoundError) as err:
        await oai.chat.completions.create(model="gpt-4o",
                                          messages=[{"role": "user", "content": "hi"}])
    body = err.value.body
    assert isinstance(body, dict) and "gpt-4o" in body.pop("message")
    assert body == {"type": "invalid_request_error", "code": "model_not_found",
                    "param": "model"}
    assert not router.received  # refused at the door


@pytest.mark.parametrize(("path", "body", "param", "status"), [
    ("/v1/completions", {"prompt": "hi", "max_tokens": -1}, "max_tokens", 400),
    ("/v1/completions", {"prompt": "hi", "max_tokens": "5"}, "max_tokens", 400),
    ("/v1/completions", {"prompt": "hi", "max_tokens": True}, "max_tokens", 400),
    ("/v1/completions", {"prompt": "hi", "temperature": "hot"}, "temperature", 400),
    ("/v1/completions", {"prompt": "hi", "temperature": -0.5}, "temperature", 400),
    ("/v1/completions", {"prompt": "hi", "top_p": 0}, "top_p", 400),
    ("/v1/completions", {"prompt": 5}, "prompt", 400),
    ("/v1/completions", {"prompt": ""}, "prompt", 400),
    ("/v1/completions", {"prompt": ["a", "b"]}, "prompt", 400),
    ("/v1/completions", {"max_tokens": 3}, None, 400),
    ("/v1/completions", {"prompt": "hi", "n": 0}, "n", 400),
    ("/v1/completions", {"prompt": "hi", "n": 65}, "n", 400),
    ("/v1/completions", {"prompt": "hi", "best_of": 2, "n": 3}, "best_of", 400),
    ("/v1/completions", {"prompt": "hi", "best_of": 3, "stream": True}, "best_of", 400),
    ("/v1/completions", {"prompt": "hi", "echo": True, "logprobs": 1}, "echo", 400),
    ("/v1/completions", {"prompt": "hi", "logprobs": 21}, "logprobs", 400),
    ("/v1/completions", {"prompt": "hi", "model": "other"}, "model", 404),
    ("/v1/chat/completions", {"messages": []}, "messages", 400),
    ("/v1/chat/completions", {"messages": "hi"}, "messages", 400),
    ("/v1/chat/completions", {"messages": [{"role": "tool", "content": "x"}]},
     "messages[0].role", 400),
    ("/v1/chat/completions",
     {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
     "messages[0].content", 400),
    ("/v1/chat/completions",
     {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]},
     "tools", 400),
])
async def test_bad_bodies_get_openai_errors(http: httpx.AsyncClient, router: FakeRouter,
                                            path: str, body: dict[str, Any],
                                            param: str | None, status: int) -> None:
    resp = await http.post(path, json=body)
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "code", "param"}
    assert error["param"] == param and error["type"] == "invalid_request_error"
    assert error["code"] in ("invalid_request", "model_not_found")
    assert not router.received


async def test_invalid_json_and_unknown_paths(http: httpx.AsyncClient) -> None:
    resp = await http.post("/v1/completions", content=b"{not json",
                           headers={"content-type": "application/json"})
    assert resp.status_code == 400 and resp.json()["error"]["code"] == "invalid_request"
    resp = await http.get("/v1/engines")
    assert resp.status_code == 404 and resp.json()["error"]["code"] == "not_found"


async def test_unknown_fields_are_ignored(http: httpx.AsyncClient, router: FakeRouter) -> None:
    resp = await http.post("/v1/completions", json={
        "model": SERVED_NAME, "prompt": "hi", "max_tokens": 1, "user": "u1",
        "tenant": "someone-else", "cache_salt": "s", "metadata": {"a": 1}})
    assert resp.status_code == 200, resp.text
    assert resp.headers["x-request-id"] == router.received[-1].request_id
    # Tenants come from credentials, never from the body; the salt splits the tenant's
    # own cache further (vLLM's cache_salt).
    assert router.received[-1].tenant == "default" and router.received[-1].cache_salt == "s"


async def test_error_after_the_stream_started(oai: openai.AsyncOpenAI, http: httpx.AsyncClient,
                                              router: FakeRouter) -> None:
    router.fail_after = 2
    stream = await oai.completions.create(model=SERVED_NAME, prompt="hi", max_tokens=6,
                                          stream=True)
    texts = []
    with pytest.raises(openai.APIError) as err:
        async for chunk in stream:
            texts.append(chunk.choices[0].text)
    assert texts == list(PIECES[:2])
    assert err.value.body["code"] == "unavailable"  # type: ignore[index]
    body = {"model": SERVED_NAME, "prompt": "hi", "max_tokens": 6, "stream": True}
    async with http.stream("POST", "/v1/completions", json=body) as resp:
        assert resp.status_code == 200
        events = await _sse_events(resp)
    assert events[-2]["error"]["code"] == "unavailable" and events[-1] == "[DONE]"


async def test_client_disconnect_stops_the_stream(http: httpx.AsyncClient,
                                                  gateway: GatewayService,
                                                  router: FakeRouter) -> None:
    router.token_delay_s = 0.2
    subs_before = len(gateway.bus.nc._subs)  # the gateway's NATS subscriptions
    body = {"model": SERVED_NAME, "prompt": "hi", "max_tokens": 6, "stream": True}
    async with http.stream("POST", "/v1/completions", json=body) as resp:
        async for line in resp.aiter_lines():
            if line.startswith("data: "):
                break  # one chunk, then hang up
    deadline = time.monotonic() + 5
    while len(gateway.bus.nc._subs) > subs_before and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    # The reply inbox is gone long before the router ends its stream.
    assert len(gateway.bus.nc._subs) == subs_before
    assert not router.finished.is_set()


# ----------------------------------------------------------------- process, metrics


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def test_gateway_process_serves_metrics(router: FakeRouter, nats_server: NatsServer,
                                              model_cache: Path, tmp_path: Path) -> None:
    port = _free_port()
    env = {**os.environ, "CPD_NATS__SERVERS": nats_server.url,
           "CPD_MODEL__CACHE_DIR": str(model_cache), "CPD_GATEWAY__PORT": str(port),
           "CPD_NATS__DRAIN_TIMEOUT_S": "2"}
    log_path = tmp_path / "gateway.log"
    with log_path.open("w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "services.gateway"], env=env,
                                cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        async with httpx.AsyncClient(base_url=base, timeout=20) as http:
            deadline = time.monotonic() + 45
            while True:
                assert proc.poll() is None, log_path.read_text()
                assert time.monotonic() < deadline, log_path.read_text()
                try:
                    if (await http.get("/health")).status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                await asyncio.sleep(0.2)
            body = {"model": "cpd-tiny", "prompt": "hi", "max_tokens": 3}
            assert (await http.post("/v1/completions", json=body)).status_code == 200
            async with http.stream("POST", "/v1/completions",
                                   json={**body, "stream": True}) as resp:
                await _sse_events(resp)
            assert (await http.post("/v1/completions",
                                    json={**body, "model": "x"})).status_code == 404
            metrics = (await http.get("/metrics")).text
    finally:
        proc.send_signal(signal.SIGTERM)
        code = await asyncio.to_thread(proc.wait, 30)
    assert code == 0, log_path.read_text()
    assert "gateway.listening" in log_path.read_text()
    samples = {line.partition("{")[0]: line for line in metrics.splitlines()
               if line.startswith("cpd_gateway_")}
    for name in ("cpd_gateway_requests_total", "cpd_gateway_rejected_requests_total",
                 "cpd_gateway_time_to_first_token_seconds_bucket",
                 "cpd_gateway_time_per_output_token_seconds_bucket",
                 "cpd_gateway_e2e_request_latency_seconds_bucket",
                 "cpd_gateway_prompt_tokens_total", "cpd_gateway_generation_tokens_total"):
        assert name in samples, name
    gateway_lines = [line for line in metrics.splitlines() if line.startswith("cpd_gateway_")]
    for label in ('status="200"', 'status="404"', 'code="model_not_found"', 'tier="gpu"',
                  'tier="dram"', 'tier="computed"', 'path="cold"'):
        assert any(label in line for line in gateway_lines), label


@pytest.mark.parametrize(("scores", "n", "kept"), [
    ([[-1.0, -1.0], [-0.5], [-3.0]], 2, [1, 0]),
    ([[-1.0], [-0.5, -0.5], [-2.0]], 2, [0, 1]),  # a tie: the lower index first
    ([[-0.1], [-0.2], [-0.3]], 1, [0]),
    ([[], [-0.1]], 2, [0, 1]),  # no tokens: log probability 0, the best there is
])
def test_best_of_ranks_by_cumulative_log_probability(scores: list[list[float]], n: int,
                                                     kept: list[int]) -> None:
    entries = [[wire.TokenLogprob(logprob=lp, rank=1) for lp in choice] for choice in scores]
    assert Ranking(n=n, logprobs=False).best(entries) == kept
