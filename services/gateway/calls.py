"""One generation request on its way through the gateway, and how its end is recorded.

A :class:`Call` carries a request's id, span and progress from its arrival to the last
byte of its reply. :class:`Outcomes` records how it ended (the metrics, the span's
attributes and status, the log) the same way whether the reply was whole or streamed.
"""

from __future__ import annotations

import re
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any

from fastapi import Response
from opentelemetry.semconv._incubating.attributes import gen_ai_attributes as genai
from opentelemetry.trace import Span, SpanKind, Status, StatusCode

from cpd.ops import telemetry
from cpd.protocol import wire
from cpd.protocol.errors import CpdError, ErrorCode
from services.gateway import protocol
from services.gateway.bestof import Ranking
from services.gateway.errors import ApiError
from services.gateway.logprobs import Logprobs
from services.gateway.metrics import GatewayMetrics, Progress

OWNER = "cpd"
"""Who serves the model: the ``owned_by`` of model cards, the GenAI provider of spans."""

REQUEST_ID_HEADER = "x-request-id"
"""The header that carries the request id: the client's when it sent a valid one (a
retry after a gateway's death keeps its id), else the gateway's own."""

_REQUEST_ID = re.compile(r"[A-Za-z0-9_-]{1,64}")

log = telemetry.get_logger("cpd.gateway")


@dataclass
class Call:
    """One generation request on its way through the gateway."""

    endpoint: str
    shape: protocol.Shape
    request_id: str
    span: Span
    progress: Progress
    created: int
    stream: bool = False
    include_usage: bool = False
    choices: int = 1  # generated: the request's n (or best_of)
    ranking: Ranking | None = None  # best_of: which choices are returned
    logprobs: list[Logprobs] = field(default_factory=list)  # by choice, when asked
    echo: str = ""  # the prompt's text, sent before the output (Completions' echo)
    # return_token_ids: the prompt's ids (None when not asked), and where a stream gave
    # them already (Shape.add_prompt_ids).
    prompt_ids: list[int] | None = None
    prompt_ids_given: set[int] = field(default_factory=set)
    token_ids: bool = False

    def logprobs_part(self, msg: wire.TokenChunk) -> dict[str, Any] | None:
        """The ``logprobs`` object of ``msg``'s tokens, when the request asked."""
        if not self.logprobs or not msg.token_ids:
            return None
        return self.logprobs[msg.index].part(msg.token_ids, msg.logprobs)

    @classmethod
    def start(cls, endpoint: str, shape: protocol.Shape, client_id: str | None = None
              ) -> Call:
        """A call arriving now at ``endpoint``, its server span open: under the client's
        ``X-Request-Id`` when it is a valid one (letters, digits, ``_`` and ``-``, at
        most 64), else a fresh id."""
        progress = Progress(started=time.perf_counter())
        valid = client_id is not None and _REQUEST_ID.fullmatch(client_id)
        request_id = client_id if valid else uuid.uuid4().hex  # type: ignore[assignment]
        return cls(endpoint=endpoint, shape=shape, request_id=request_id,
                   progress=progress, created=int(time.time()),
                   span=telemetry.tracer().start_span(
                       f"gateway {endpoint}", kind=SpanKind.SERVER,
                       attributes={"http.route": endpoint, "cpd.request_id": request_id}))

    @property
    def headers(self) -> dict[str, str]:
        """The headers every reply to the call carries."""
        return {REQUEST_ID_HEADER: self.request_id}


class Outcomes:
    """Records how calls end: in the gateway's metrics, on their spans and in the log.

    It holds the gateway's one :class:`GatewayMetrics`."""

    def __init__(self, metrics: GatewayMetrics) -> None:
        self.metrics = metrics

    def rejected(self, tenant: str, reason: str) -> None:
        """A request the tenant's key or limits refused before it reached the router."""
        self.metrics.tenant_rejected(tenant, reason)

    def succeed(self, call: Call, final: wire.Final) -> None:
        """A call that got its final message."""
        self.metrics.finished(call.endpoint, final, call.progress, time.perf_counter())
        call.span.set_attributes({
            genai.GEN_AI_RESPONSE_ID: call.request_id,
            genai.GEN_AI_RESPONSE_FINISH_REASONS: [protocol.finish_reason(e)
                                                   for e in final.ends()],
            genai.GEN_AI_USAGE_INPUT_TOKENS: final.usage.prompt_tokens,
            genai.GEN_AI_USAGE_OUTPUT_TOKENS: final.usage.completion_tokens})
        call.span.set_attribute("cpd.route.path", final.route.path)
        call.span.set_attribute("http.status_code", HTTPStatus.OK)

    def fail(self, call: Call, error: ApiError) -> Response:
        """The error reply of a call that failed before its reply began; ends its span."""
        self.record_failure(call, error)
        call.span.end()
        return error.response(call.headers)

    def record_failure(self, call: Call, error: ApiError) -> ApiError:
        """Record ``error`` as the call's outcome, and return it."""
        self.metrics.failed(call.endpoint, error.status, error.code)
        call.span.set_attribute("http.status_code", error.status)
        call.span.set_status(Status(StatusCode.ERROR, error.code))
        level = log.warning if error.status >= HTTPStatus.INTERNAL_SERVER_ERROR else log.info
        level("gateway.request_failed", request_id=call.request_id, endpoint=call.endpoint,
              status=error.status, code=error.code, detail=error.message)
        return error

    def abandon(self, call: Call) -> None:
        """A call whose client disconnected before its reply ended."""
        self.metrics.abandoned(call.endpoint)
        call.span.set_status(Status(StatusCode.ERROR, "client disconnected"))
        log.info("gateway.client_disconnected", request_id=call.request_id,
                 tokens=call.progress.tokens)


def genai_request(call: Call, body: protocol.CompletionRequest | protocol.ChatRequest,
                  model: str) -> None:
    """OpenTelemetry's GenAI attributes of the request on its span."""
    attrs: dict[str, Any] = {
        genai.GEN_AI_OPERATION_NAME: ("chat" if isinstance(body, protocol.ChatRequest)
                                      else "text_completion"),
        genai.GEN_AI_PROVIDER_NAME: OWNER, genai.GEN_AI_REQUEST_MODEL: model}
    max_tokens = getattr(body, "max_completion_tokens", None) or body.max_tokens
    for key, value in ((genai.GEN_AI_REQUEST_MAX_TOKENS, max_tokens),
                       (genai.GEN_AI_REQUEST_TEMPERATURE, body.temperature),
                       (genai.GEN_AI_REQUEST_TOP_P, body.top_p)):
        if value is not None:
            attrs[key] = value
    call.span.set_attributes(attrs)


def internal_error(exc: Exception, call: Call) -> ApiError:
    """The 500 of an unexpected exception while serving ``call``, logged with its trace."""
    log.error("gateway.internal_error", request_id=call.request_id, exc_info=exc)
    return ApiError(HTTPStatus.INTERNAL_SERVER_ERROR, f"internal error: {exc!r}",
                    code=ErrorCode.INTERNAL.value)


async def next_message(messages: AsyncIterator[wire.TokenChunk | wire.Final]
                       ) -> wire.TokenChunk | wire.Final:
    """The next message of a reply stream; a stream that ends before its final message
    is a :class:`CpdError`."""
    try:
        return await anext(messages)
    except StopAsyncIteration:
        raise CpdError("the reply stream ended without a final message") from None
