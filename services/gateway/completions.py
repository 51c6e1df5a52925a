"""The generation endpoints: ``POST /v1/completions`` and ``POST /v1/chat/completions``.

A request is parsed and checked (:mod:`services.gateway.admission`), then sent to the
router with the gateway's deadline. A whole reply's errors keep their HTTP status; a
streaming reply waits for its first message at most ``gateway.stream_headers_after_s``
before its headers go out (:mod:`services.gateway.streaming`).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator

from fastapi import Request, Response
from opentelemetry import trace

from cpd.client import Client
from cpd.ops import telemetry
from cpd.protocol import subjects, wire
from cpd.protocol.errors import CpdError
from services.gateway import logprobs, protocol
from services.gateway.admission import Admission
from services.gateway.calls import (
    REQUEST_ID_HEADER,
    Call,
    Outcomes,
    genai_request,
    internal_error,
    next_message,
)
from services.gateway.errors import ApiError
from services.gateway.replies import json_response
from services.gateway.streaming import SseStreamer

_Messages = AsyncIterator[wire.TokenChunk | wire.Final]


class CompletionRoutes:
    """The handlers of OpenAI's Completions and Chat Completions APIs."""

    def __init__(self, client: Client, admission: Admission, outcomes: Outcomes,
                 streamer: SseStreamer, stream_headers_after_s: float) -> None:
        self.client = client
        self.admission = admission
        self.outcomes = outcomes
        self.streamer = streamer
        self.served_name = admission.served_name
        self.stream_headers_after_s = stream_headers_after_s

    async def completions(self, request: Request) -> Response:
        """OpenAI's Completions API."""
        return await self._generate(request, protocol.COMPLETION, protocol.CompletionRequest)

    async def chat_completions(self, request: Request) -> Response:
        """OpenAI's Chat Completions API."""
        return await self._generate(request, protocol.CHAT, protocol.ChatRequest)

    async def _generate(self, request: Request, shape: protocol.Shape,
                        kind: type[protocol.CompletionRequest] | type[protocol.ChatRequest]
                        ) -> Response:
        call = Call.start(request.url.path, shape, request.headers.get(REQUEST_ID_HEADER))
        try:
            # The span is current while the request is published, so its trace context
            # rides to the router and on to the workers.
            with trace.use_span(call.span, end_on_exit=False), \
                    telemetry.bound_request(call.request_id):
                messages = await self._send(request, call, kind)
                pending = asyncio.ensure_future(next_message(messages))
                if call.stream:
                    # Refusals come at once and keep their status; a request that waits
                    # (queued, or a long cold prefill) gets its headers now.
                    try:
                        await asyncio.wait({pending}, timeout=self.stream_headers_after_s)
                    except asyncio.CancelledError:  # the client left meanwhile
                        pending.cancel()
                        raise
                    if not pending.done():
                        return self.streamer.response(call, pending, messages)
                first = await pending
        except ApiError as e:
            return self.outcomes.fail(call, e)
        except CpdError as e:
            return self.outcomes.fail(call, ApiError.from_cpd(e))
        except Exception as e:
            return self.outcomes.fail(call, internal_error(e, call))
        if call.stream:
            return self.streamer.response(call, pending, messages)
        return await self._whole(call, first, messages)

    async def _send(self, request: Request, call: Call,
                    kind: type[protocol.CompletionRequest] | type[protocol.ChatRequest]
                    ) -> _Messages:
        """Admit and parse the request, then send it: the router's reply messages."""
        given_id = request.headers.get(REQUEST_ID_HEADER)
        if given_id is not None and given_id != call.request_id:
            raise ApiError.invalid("X-Request-Id must be 1 to 64 letters, digits, '_' or "
                                   "'-'", param=REQUEST_ID_HEADER)
        tenant = self.admission.admit(request)
        raw = await request.body()
        if tenant.max_request_bytes and len(raw) > tenant.max_request_bytes:
            raise self.admission.too_large(tenant, len(raw))
        body = protocol.decode_body(raw, kind)
        genai_request(call, body, self.served_name)
        call.stream = bool(body.stream)
        call.include_usage = bool(body.stream_options and body.stream_options.include_usage)
        req, prompt = await self.admission.wire_request(body, call.request_id, tenant)
        if body.return_token_ids:
            call.token_ids = True
            call.prompt_ids = [int(t) for t in wire.unpack_tokens(req.tokens or b"")]
        model = self.admission.model
        call.choices, call.ranking = req.sampling.n, protocol.ranked(body)
        call.logprobs = logprobs.writers(req.sampling.logprobs, model,
                                         chat=kind is protocol.ChatRequest, n=call.choices)
        if isinstance(body, protocol.CompletionRequest) and body.echo:
            call.echo = protocol.echo_text(prompt, model)
        if body.cpd_resume is not None:  # its earlier streams have no reader any more
            with contextlib.suppress(CpdError):  # at most once: the resume goes on anyway
                await self.client.bus.publish(subjects.GENERATE_SUPERSEDE, wire.SupersedeGenerate(
                    request_id=req.request_id, tenant=req.tenant,
                    resumed_tokens=len(body.cpd_resume.token_ids)))
        return self.client.stream_request(req)

    async def _whole(self, call: Call, first: wire.TokenChunk | wire.Final,
                     messages: _Messages) -> Response:
        """A non-streaming reply: every chunk's text, by choice, then the final
        message's data."""
        texts: list[list[str]] = [[call.echo] for _ in range(call.choices)]
        ids: list[list[int]] = [[] for _ in range(call.choices)]
        entries: list[list[wire.TokenLogprob]] = [[] for _ in range(call.choices)]
        msg = first
        try:
            while isinstance(msg, wire.TokenChunk):
                call.progress.on_tokens(len(msg.token_ids), time.perf_counter())
                texts[msg.index].append(msg.text)
                ids[msg.index] += msg.token_ids
                entries[msg.index] += msg.logprobs
                msg = await next_message(messages)
        except CpdError as e:
            return self.outcomes.fail(call, ApiError.from_cpd(e))
        except Exception as e:
            return self.outcomes.fail(call, internal_error(e, call))
        self.outcomes.succeed(call, msg)
        call.span.end()
        ends = msg.ends()
        order, with_logprobs = [e.index for e in ends], bool(call.logprobs)
        if call.ranking is not None:  # best_of: the best n, best first
            order, with_logprobs = call.ranking.best(entries), call.ranking.logprobs
        choices = [protocol.with_token_ids(
            call.shape.choice(k, "".join(texts[i]), ends[i],
                              call.logprobs[i].part(ids[i], entries[i])
                              if with_logprobs else None), ids[i] if call.token_ids else None)
            for k, i in enumerate(order)]
        reply = call.shape.response(request_id=call.request_id, created=call.created,
                                    model=self.served_name, choices=choices, final=msg)
        if call.prompt_ids is not None:
            call.shape.add_prompt_ids(reply, call.prompt_ids, set())
        return json_response(reply, headers=call.headers)
