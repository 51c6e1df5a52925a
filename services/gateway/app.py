"""The gateway's HTTP API: OpenAI-compatible completions over the CPD client.

* ``POST /v1/completions`` and ``POST /v1/chat/completions``: one prompt each (chats are
  rendered with the model's template), whole replies or SSE streams. Replies carry an
  extra top-level ``cpd`` field (in a stream: on the chunk with the finish reason) with
  the request id, the route the router took and its timings.
* ``GET /v1/models``; ``POST /tokenize`` and ``POST /detokenize`` (vLLM's); ``GET
  /version``; ``GET /health`` (liveness: the process serves), ``GET /ready`` (NATS
  connected, a router answering, kvindex up, a live prefill-side and decode worker);
  ``GET /metrics`` (Prometheus text of this process); ``GET /openapi.json`` and
  ``GET /docs`` (the schema and its page).

Tenants (:mod:`services.gateway.tenants`): with ``gateway.tenants`` configured, a request
first needs a tenant's API key (401), then passes the tenant's rate limit (429 with
``Retry-After``), body size (413), prompt length and ``max_tokens`` cap (400); it goes to
the router as that tenant's, so its KV blocks stay in the tenant's own namespace.

A request is parsed and checked here, then sent to the router with the gateway's
deadline. A whole reply's errors keep their HTTP status. A streaming reply starts once
its first message arrived or ``gateway.stream_headers_after_s`` passed, whichever is
first, so refusals (bad input, overload) keep their status while a request that waits
gets its headers and a chunk with no choices every ``gateway.sse_keepalive_s`` (proxies
close idle connections; an SSE comment would do for a browser, but clients that strip each
network read before splitting on blank lines, vLLM's benchmark among them, lose a comment's
separator and the data after it, while every OpenAI client skips a chunk without choices,
as it does the final usage chunk); an error after the headers ends the stream with an
``{"error": ...}`` event. A client that disconnects mid-stream stops
the gateway's side of the request; the router finishes it or times it out on its own.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any

import msgspec
from fastapi import FastAPI, Request, Response
from fastapi.responses import StreamingResponse
from opentelemetry import trace
from opentelemetry.semconv._incubating.attributes import gen_ai_attributes as genai
from opentelemetry.trace import Span, SpanKind, Status, StatusCode
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException

import cpd
from cpd.client import Client
from cpd.engines.servedmodel import ServedModel
from cpd.ops import telemetry
from cpd.ops.config import Settings
from cpd.protocol import wire
from cpd.protocol.errors import CpdError, ErrorCode
from cpd.protocol.roles import PREFILL_ROLES
from services.gateway import protocol
from services.gateway.errors import ApiError, http_exception_handler
from services.gateway.metrics import UNAUTHORIZED, UNKNOWN_TENANT, GatewayMetrics, Progress
from services.gateway.ratelimit import RateLimiter, retry_after_header
from services.gateway.tenants import AuthError, Tenant, TenantTable

__all__ = ["create_app"]

HEALTH_TIMEOUT_S = 1.0
"""How long ``/health`` waits for a router's status reply."""

_SSE_DONE = b"data: [DONE]\n\n"
# A request needs a node of each kind to run: a prefill side (warm or cold) and decode.
_NEEDED_ROLES: dict[str, set[str]] = {"prefill": set(PREFILL_ROLES), "decode": {"decode"}}
_SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
_REQUEST_ID_HEADER = "x-request-id"
_OWNER = "cpd"

log = telemetry.get_logger("cpd.gateway")


def create_app(client: Client, model: ServedModel, settings: Settings) -> FastAPI:
    """The gateway's FastAPI application, sending requests through ``client``."""
    gateway = _Gateway(client, model, settings)
    app = FastAPI(title="CPD gateway", version=cpd.__version__,
                  description="OpenAI-compatible API of CPD (docs/architecture.md, "
                              "\"Services\")", redoc_url=None)
    app.add_api_route("/v1/completions", gateway.completions, methods=["POST"])
    app.add_api_route("/v1/chat/completions", gateway.chat_completions, methods=["POST"])
    app.add_api_route("/v1/models", gateway.models, methods=["GET"])
    app.add_api_route("/tokenize", gateway.tokenize, methods=["POST"])
    app.add_api_route("/detokenize", gateway.detokenize, methods=["POST"])
    app.add_api_route("/version", gateway.version, methods=["GET"])
    app.add_api_route("/health", gateway.health, methods=["GET"])
    app.add_api_route("/ready", gateway.ready, methods=["GET"])
    app.add_api_route("/metrics", gateway.prometheus, methods=["GET"])
    app.add_exception_handler(HTTPException, http_exception_handler)
    return app


@dataclass
class _Call:
    """One generation request on its way through the gateway."""

    endpoint: str
    shape: protocol.Shape
    request_id: str
    span: Span
    progress: Progress
    created: int
    stream: bool = False
    include_usage: bool = False

    @property
    def headers(self) -> dict[str, str]:
        return {_REQUEST_ID_HEADER: self.request_id}


class _Gateway:
    """The endpoint handlers and what they share."""

    def __init__(self, client: Client, model: ServedModel, settings: Settings) -> None:
        self.client = client
        self.model = model
        self.served_name = settings.gateway.served_model_name or model.name
        self.timeout_s = settings.gateway.request_timeout_s
        self.stream_headers_after_s = settings.gateway.stream_headers_after_s
        self.sse_keepalive_s = settings.gateway.sse_keepalive_s
        self.started = int(time.time())
        self.tenants = TenantTable.from_settings(settings.gateway)
        self.metrics = GatewayMetrics(tenants=settings.gateway.tenants)
        self.limiter = RateLimiter(self.tenants.limits, time.monotonic)

    # ------------------------------------------------------------------ endpoints

    async def completions(self, request: Request) -> Response:
        """OpenAI's Completions API."""
        return await self._generate(request, protocol.COMPLETION, protocol.CompletionRequest)

    async def chat_completions(self, request: Request) -> Response:
        """OpenAI's Chat Completions API."""
        return await self._generate(request, protocol.CHAT, protocol.ChatRequest)

    async def models(self) -> Response:
        """The one served model."""
        card = {"id": self.served_name, "object": "model", "created": self.started,
                "owned_by": _OWNER, "root": self.model.name,
                "max_model_len": self.model.max_model_len}
        return _json({"object": "list", "data": [card]})

    async def tokenize(self, request: Request) -> Response:
        """The token ids CPD computes for a prompt (``prompt``) or a chat
        (``messages``), as vLLM's ``/tokenize`` answers."""
        return await _answer(self._tokenize(await request.body()))

    async def _tokenize(self, raw: bytes) -> dict[str, Any]:
        body = protocol.decode_tokenize(raw)
        if body.model and body.model != self.served_name:
            raise self._unknown_model(body.model)
        if body.messages is not None:
            text = protocol.chat_prompt(body.chat(), self.model)
        elif body.prompt is not None:
            text = body.prompt
        else:
            raise ApiError.invalid("give a prompt or messages", param="prompt")
        ids = await asyncio.to_thread(self.model.encode, text)
        return {"count": len(ids), "max_model_len": self.model.max_model_len, "tokens": ids}

    async def detokenize(self, request: Request) -> Response:
        """The text of token ids, as vLLM's ``/detokenize`` answers."""
        return await _answer(self._detokenize(await request.body()))

    async def _detokenize(self, raw: bytes) -> dict[str, Any]:
        body = protocol.decode_detokenize(raw)
        if body.model and body.model != self.served_name:
            raise self._unknown_model(body.model)
        if body.tokens and not 0 <= min(body.tokens) <= max(body.tokens) < (
                self.model.vocab_size):
            raise ApiError.invalid(f"token ids must lie in [0, {self.model.vocab_size})",
                                   param="tokens")
        return {"prompt": await asyncio.to_thread(self.model.decode, body.tokens)}

    async def version(self) -> Response:
        """CPD's version."""
        return _json({"version": cpd.__version__})

    async def health(self) -> Response:
        """Liveness: 200 while this process serves HTTP (NATS connected or not: a probe
        that restarted the gateway over a bus outage would not help it), with the bus
        state in the body."""
        return _json({"status": "ok", "nats_connected": self.client.bus.nc.is_connected})

    async def ready(self) -> Response:
        """Readiness: 200 when NATS is connected, a router answers, kvindex is up and
        the router knows a live worker of each kind a request needs (a prefill side and
        a decode node); else 503 with the reason. The body counts the live workers."""
        if not self.client.bus.nc.is_connected:
            return _unhealthy("not connected to NATS")
        try:
            status = await self.client.status(timeout_s=HEALTH_TIMEOUT_S)
        except CpdError as e:
            return _unhealthy(f"no router answered: {e.message}")
        alive = {n.role for n in status.nodes if n.alive}
        missing = [kind for kind, roles in _NEEDED_ROLES.items() if not alive & roles]
        if status.kvindex != "ok":
            return _unhealthy(f"kvindex is {status.kvindex}")
        if missing:
            return _unhealthy(f"no live {' or '.join(missing)} worker")
        return _json({"status": "ready", "workers": sum(n.alive for n in status.nodes)})

    async def prometheus(self) -> Response:
        """This process's metrics in Prometheus text format."""
        return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)

    # ----------------------------------------------------------------- generation

    async def _generate(self, request: Request, shape: protocol.Shape,
                        kind: type[protocol.CompletionRequest] | type[protocol.ChatRequest]
                        ) -> Response:
        progress = Progress(started=time.perf_counter())
        request_id = uuid.uuid4().hex
        endpoint = request.url.path
        call = _Call(endpoint=endpoint, shape=shape, request_id=request_id,
                     progress=progress, created=int(time.time()),
                     span=telemetry.tracer().start_span(
                         f"gateway {endpoint}", kind=SpanKind.SERVER,
                         attributes={"http.route": endpoint, "cpd.request_id": request_id}))
        try:
            # The span is current while the request is published, so its trace context
            # rides to the router and on to the workers.
            with trace.use_span(call.span, end_on_exit=False), \
                    telemetry.bound_request(request_id):
                tenant = self._admit(request)
                raw = await request.body()
                if tenant.max_request_bytes and len(raw) > tenant.max_request_bytes:
                    raise self._too_large(tenant, len(raw))
                body = protocol.decode_body(raw, kind)
                _genai_request(call, body, self.served_name)
                call.stream = bool(body.stream)
                call.include_usage = bool(body.stream_options and
                                          body.stream_options.include_usage)
                messages = self.client.stream_request(
                    await self._wire_request(body, request_id, tenant))
                pending = asyncio.ensure_future(_next(messages))
                if call.stream:
                    # Refusals come at once and keep their status; a request that waits
                    # (queued, or a long cold prefill) gets its headers now.
                    try:
                        await asyncio.wait({pending}, timeout=self.stream_headers_after_s)
                    except asyncio.CancelledError:  # the client left meanwhile
                        pending.cancel()
                        raise
                    if not pending.done():
                        return self._stream(call, pending, messages)
                first = await pending
        except ApiError as e:
            return self._fail(call, e)
        except CpdError as e:
            return self._fail(call, ApiError.from_cpd(e))
        except Exception as e:
            return self._fail(call, _internal(e, call))
        if call.stream:
            return self._stream(call, pending, messages)
        return await self._whole(call, first, messages)

    def _stream(self, call: _Call, first: asyncio.Future[wire.TokenChunk | wire.Final],
                messages: AsyncIterator[wire.TokenChunk | wire.Final]) -> Response:
        return StreamingResponse(self._events(call, first, messages),
                                 media_type="text/event-stream",
                                 headers={**_SSE_HEADERS, **call.headers})

    async def _whole(self, call: _Call, first: wire.TokenChunk | wire.Final,
                     messages: AsyncIterator[wire.TokenChunk | wire.Final]) -> Response:
        """A non-streaming reply: every chunk's text, then the final message's data."""
        texts: list[str] = []
        msg = first
        try:
            while isinstance(msg, wire.TokenChunk):
                call.progress.on_tokens(len(msg.token_ids), time.perf_counter())
                texts.append(msg.text)
                msg = await _next(messages)
        except CpdError as e:
            return self._fail(call, ApiError.from_cpd(e))
        except Exception as e:
            return self._fail(call, _internal(e, call))
        self._succeed(call, msg)
        call.span.end()
        return _json(call.shape.response(request_id=call.request_id, created=call.created,
                                         model=self.served_name, text="".join(texts),
                                         final=msg), headers=call.headers)

    async def _events(self, call: _Call, first: asyncio.Future[wire.TokenChunk | wire.Final],
                      messages: AsyncIterator[wire.TokenChunk | wire.Final]
                      ) -> AsyncIterator[bytes]:
        """The SSE body of a streaming reply: a chunk without choices every
        ``sse_keepalive_s`` while the first message is awaited (module doc), then the
        chunks."""
        shape = call.shape
        ended = False

        def chunk(choices: list[dict[str, Any]], **extra: Any) -> bytes:
            return _sse(shape.chunk(request_id=call.request_id, created=call.created,
                                    model=self.served_name, choices=choices, **extra))

        try:
            try:
                while not first.done():
                    await asyncio.wait({first}, timeout=self.sse_keepalive_s)
                    if not first.done():
                        yield chunk([])
                msg = first.result()
                if opening := shape.opening_choices():
                    yield chunk(opening)
                while isinstance(msg, wire.TokenChunk):
                    call.progress.on_tokens(len(msg.token_ids), time.perf_counter())
                    if msg.text:  # empty while a character's bytes are incomplete
                        yield chunk([shape.delta_choice(msg.text)])
                    msg = await _next(messages)
                yield chunk([shape.delta_choice("", protocol.finish_reason(msg))],
                            cpd=protocol.cpd_extension(call.request_id, msg))
                if call.include_usage:
                    yield chunk([], usage=protocol.usage(msg))
                ended = True
                self._succeed(call, msg)
            except CpdError as e:
                ended = True
                yield _sse(self._record_failure(call, ApiError.from_cpd(e)).body())
            except Exception as e:
                ended = True
                yield _sse(self._record_failure(call, _internal(e, call)).body())
            yield _SSE_DONE
        except (asyncio.CancelledError, GeneratorExit):
            if not ended:
                self.metrics.abandoned(call.endpoint)
                call.span.set_status(Status(StatusCode.ERROR, "client disconnected"))
                log.info("gateway.client_disconnected", request_id=call.request_id,
                         tokens=call.progress.tokens)
            raise
        finally:
            call.span.end()
            first.cancel()  # a client that left while its request waited
            await messages.aclose()  # type: ignore[attr-defined]

    # ---------------------------------------------------------------- requests

    def _admit(self, request: Request) -> Tenant:
        """The request's tenant, once its key, rate and declared size pass."""
        try:
            tenant = self.tenants.authenticate(request.headers.get("authorization"))
        except AuthError:
            self.metrics.tenant_rejected(UNKNOWN_TENANT, UNAUTHORIZED)
            raise
        wait_s = self.limiter.check(tenant.name)
        if wait_s > 0:
            self.metrics.tenant_rejected(tenant.name, "rate_limited")
            raise ApiError(HTTPStatus.TOO_MANY_REQUESTS,
                           f"tenant {tenant.name!r} is over its request rate; retry in "
                           f"{wait_s:.2f} s", code="rate_limit_exceeded",
                           headers={"Retry-After": retry_after_header(wait_s)})
        declared = request.headers.get("content-length", "")
        if (tenant.max_request_bytes and declared.isdigit()
                and int(declared) > tenant.max_request_bytes):
            raise self._too_large(tenant, int(declared))  # refused before reading it
        return tenant

    def _too_large(self, tenant: Tenant, nbytes: int) -> ApiError:
        self.metrics.tenant_rejected(tenant.name, "request_too_large")
        return ApiError(HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
                        f"the request body has {nbytes} bytes; tenant {tenant.name!r} may "
                        f"send at most {tenant.max_request_bytes}",
                        code=ErrorCode.PAYLOAD_TOO_LARGE.value)

    def _tenant_limit(self, tenant: Tenant, reason: str, message: str,
                      param: str) -> ApiError:
        self.metrics.tenant_rejected(tenant.name, reason)
        return ApiError.invalid(message, param=param,
                                code=(ErrorCode.PROMPT_TOO_LONG.value
                                      if reason == "prompt_too_long"
                                      else ErrorCode.INVALID_REQUEST.value))

    def _check_tenant_prompt(self, tenant: Tenant, prompt_tokens: int, param: str) -> None:
        limit = tenant.max_prompt_tokens
        if limit and prompt_tokens > limit:
            raise self._tenant_limit(
                tenant, "prompt_too_long",
                f"the prompt has {prompt_tokens} tokens; tenant {tenant.name!r} may send "
                f"at most {limit}", param)

    def _cap_max_tokens(self, tenant: Tenant, max_tokens: int, explicit: bool) -> int:
        cap = tenant.max_tokens
        if not cap or max_tokens <= cap:
            return max_tokens
        if explicit:
            raise self._tenant_limit(
                tenant, "max_tokens",
                f"max_tokens {max_tokens} exceeds tenant {tenant.name!r}'s cap of {cap}",
                "max_tokens")
        return cap  # a default (not asked for) is clamped, never refused

    async def _wire_request(self, body: protocol.CompletionRequest | protocol.ChatRequest,
                            request_id: str, tenant: Tenant) -> wire.GenerateRequest:
        """Check a parsed body and turn it into the router's request."""
        if body.model and body.model != self.served_name:
            raise self._unknown_model(body.model)
        protocol.refuse_unsupported(body)
        text_or_ids: str | list[int]
        if isinstance(body, protocol.ChatRequest):
            text_or_ids, param = protocol.chat_prompt(body, self.model), "messages"
            requested = (body.max_completion_tokens if body.max_completion_tokens is not None
                         else body.max_tokens)
        else:
            text_or_ids, param = protocol.completion_prompt(body, self.model), "prompt"
            requested = body.max_tokens
        # The one tokenization of the request: the router and the workers take the ids.
        if isinstance(text_or_ids, str) and self.model.surely_too_long(text_or_ids):
            raise ApiError.invalid(
                f"the prompt has {len(text_or_ids)} characters, more than this model's "
                f"context of {self.model.max_model_len} tokens can hold", param=param,
                code=ErrorCode.PROMPT_TOO_LONG.value)
        ids = (text_or_ids if isinstance(text_or_ids, list)
               else await asyncio.to_thread(self.model.encode, text_or_ids))
        self._check_length(len(ids))
        self._check_tenant_prompt(tenant, len(ids), param)
        explicit = requested is not None
        if requested is not None:
            max_tokens = requested
        elif param == "messages" and self.model.max_model_len:
            max_tokens = self.model.max_model_len - len(ids)  # what the context has left,
        else:                                              # as OpenAI and vLLM do
            max_tokens = protocol.DEFAULT_MAX_TOKENS
        max_tokens = self._cap_max_tokens(tenant, max_tokens, explicit)
        given = {"top_p": body.top_p, "top_k": body.top_k, "seed": body.seed,
                 "stop_token_ids": body.stop_token_ids, "ignore_eos": body.ignore_eos,
                 "cache_salt": body.cache_salt,
                 # vLLM serves lower values first; the router's admission, higher ones.
                 "priority": None if body.priority is None else -body.priority}
        if body.user:
            log.info("gateway.request_user", request_id=request_id, user=body.user[:256])
        temperature = (protocol.DEFAULT_TEMPERATURE if body.temperature is None
                       else body.temperature)
        return self.client.request(
            ids, max_tokens=max_tokens, temperature=temperature, model=self.model.name,
            timeout_s=self.timeout_s, request_id=request_id, tenant=tenant.name,
            **{k: v for k, v in given.items() if v is not None})  # type: ignore[arg-type]

    def _check_length(self, prompt_tokens: int) -> None:
        limit = self.model.max_model_len
        if limit and prompt_tokens >= limit:
            raise ApiError.invalid(
                f"the prompt has {prompt_tokens} tokens; this model's context is {limit} "
                "tokens, prompt and completion together", param="prompt",
                code=ErrorCode.PROMPT_TOO_LONG.value)

    # ---------------------------------------------------------------- outcomes

    def _unknown_model(self, name: str) -> ApiError:
        return ApiError(HTTPStatus.NOT_FOUND,
                        f"the model {name!r} does not exist; this server serves "
                        f"{self.served_name!r}", code="model_not_found", param="model")

    def _succeed(self, call: _Call, final: wire.Final) -> None:
        self.metrics.finished(call.endpoint, final, call.progress, time.perf_counter())
        call.span.set_attributes({
            genai.GEN_AI_RESPONSE_ID: call.request_id,
            genai.GEN_AI_RESPONSE_FINISH_REASONS: [protocol.finish_reason(final)],
            genai.GEN_AI_USAGE_INPUT_TOKENS: final.usage.prompt_tokens,
            genai.GEN_AI_USAGE_OUTPUT_TOKENS: final.usage.completion_tokens})
        call.span.set_attribute("cpd.route.path", final.route.path)
        call.span.set_attribute("http.status_code", HTTPStatus.OK)

    def _fail(self, call: _Call, error: ApiError) -> Response:
        self._record_failure(call, error)
        call.span.end()
        return error.response(call.headers)

    def _record_failure(self, call: _Call, error: ApiError) -> ApiError:
        self.metrics.failed(call.endpoint, error.status, error.code)
        call.span.set_attribute("http.status_code", error.status)
        call.span.set_status(Status(StatusCode.ERROR, error.code))
        level = log.warning if error.status >= HTTPStatus.INTERNAL_SERVER_ERROR else log.info
        level("gateway.request_failed", request_id=call.request_id, endpoint=call.endpoint,
              status=error.status, code=error.code, detail=error.message)
        return error


def _genai_request(call: _Call, body: protocol.CompletionRequest | protocol.ChatRequest,
                   model: str) -> None:
    """OpenTelemetry's GenAI attributes of the request on its span."""
    attrs: dict[str, Any] = {
        genai.GEN_AI_OPERATION_NAME: ("chat" if isinstance(body, protocol.ChatRequest)
                                      else "text_completion"),
        genai.GEN_AI_PROVIDER_NAME: _OWNER, genai.GEN_AI_REQUEST_MODEL: model}
    max_tokens = getattr(body, "max_completion_tokens", None) or body.max_tokens
    for key, value in ((genai.GEN_AI_REQUEST_MAX_TOKENS, max_tokens),
                       (genai.GEN_AI_REQUEST_TEMPERATURE, body.temperature),
                       (genai.GEN_AI_REQUEST_TOP_P, body.top_p)):
        if value is not None:
            attrs[key] = value
    call.span.set_attributes(attrs)


async def _answer(reply: Awaitable[dict[str, Any]]) -> Response:
    """The JSON of ``reply``, or the OpenAI-style error it raised."""
    try:
        return _json(await reply)
    except ApiError as e:
        return e.response()
    except CpdError as e:
        return ApiError.from_cpd(e).response()


async def _next(messages: AsyncIterator[wire.TokenChunk | wire.Final]
                ) -> wire.TokenChunk | wire.Final:
    try:
        return await anext(messages)
    except StopAsyncIteration:
        raise CpdError("the reply stream ended without a final message") from None


def _internal(exc: Exception, call: _Call) -> ApiError:
    log.error("gateway.internal_error", request_id=call.request_id, exc_info=exc)
    return ApiError(HTTPStatus.INTERNAL_SERVER_ERROR, f"internal error: {exc!r}",
                    code=ErrorCode.INTERNAL.value)


def _sse(data: dict[str, Any]) -> bytes:
    return b"data: " + msgspec.json.encode(data) + b"\n\n"


def _json(data: dict[str, Any], *, status: int = HTTPStatus.OK,
          headers: dict[str, str] | None = None) -> Response:
    return Response(msgspec.json.encode(data), status_code=status,
                    media_type="application/json", headers=headers)


def _unhealthy(reason: str) -> Response:
    return _json({"status": "unavailable", "reason": reason},
                 status=HTTPStatus.SERVICE_UNAVAILABLE)
