"""Streaming replies: a generation's messages as OpenAI's SSE chunks, with keep-alives.

A streaming reply starts once its first message arrived or ``gateway.stream_headers_after_s``
passed, whichever is first (:mod:`services.gateway.completions` waits for that), so
refusals (bad input, overload) keep their status while a request that waits gets its
headers and a chunk with no choices every ``gateway.sse_keepalive_s`` (proxies close idle
connections; an SSE comment would do for a browser, but clients that strip each network
read before splitting on blank lines, vLLM's benchmark among them, lose a comment's
separator and the data after it, while every OpenAI client skips a chunk without choices,
as it does the final usage chunk); an error after the headers ends the stream with an
``{"error": ...}`` event. A client that disconnects mid-stream stops the gateway's side of
the request; the router finishes it or times it out on its own.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Response
from fastapi.responses import StreamingResponse

from cpd.protocol import wire
from cpd.protocol.errors import CpdError
from services.gateway import protocol
from services.gateway.calls import Call, Outcomes, internal_error, next_message
from services.gateway.errors import ApiError
from services.gateway.replies import SSE_DONE, sse_event

_SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


class SseStreamer:
    """Writes the SSE replies of streaming calls, recording their outcomes."""

    def __init__(self, outcomes: Outcomes, served_name: str, keepalive_s: float) -> None:
        self.outcomes = outcomes
        self.served_name = served_name
        self.keepalive_s = keepalive_s

    def response(self, call: Call, first: asyncio.Future[wire.TokenChunk | wire.Final],
                 messages: AsyncIterator[wire.TokenChunk | wire.Final]) -> Response:
        """The streaming reply of ``call``, whose first message ``first`` may still be
        awaited; the rest come from ``messages``."""
        return StreamingResponse(self._events(call, first, messages),
                                 media_type="text/event-stream",
                                 headers={**_SSE_HEADERS, **call.headers})

    def _chunk(self, call: Call, choices: list[dict[str, Any]], **extra: Any) -> bytes:
        body = call.shape.chunk(request_id=call.request_id, created=call.created,
                                model=self.served_name, choices=choices, **extra)
        if call.prompt_ids is not None:
            call.shape.add_prompt_ids(body, call.prompt_ids, call.prompt_ids_given)
        return sse_event(body)

    def _delta(self, call: Call, msg: wire.TokenChunk) -> bytes | None:
        """The chunk of ``msg``'s text, log probabilities and (``return_token_ids``)
        token ids; none while a character's bytes are incomplete (no text yet) and
        nothing else is asked."""
        lp = call.logprobs_part(msg)
        if not msg.text and lp is None and not (call.token_ids and msg.token_ids):
            return None
        return self._chunk(call, [protocol.with_token_ids(
            call.shape.delta_choice(msg.index, msg.text, logprobs=lp),
            list(msg.token_ids) if call.token_ids else None)])

    async def _events(self, call: Call, first: asyncio.Future[wire.TokenChunk | wire.Final],
                      messages: AsyncIterator[wire.TokenChunk | wire.Final]
                      ) -> AsyncIterator[bytes]:
        """The SSE body of a streaming reply: a chunk without choices every
        ``keepalive_s`` while the first message is awaited (module doc), then the
        chunks."""
        shape = call.shape
        ended = False
        try:
            try:
                while not first.done():
                    await asyncio.wait({first}, timeout=self.keepalive_s)
                    if not first.done():
                        yield self._chunk(call, [])
                msg = first.result()
                if opening := shape.opening_choices(call.choices):
                    yield self._chunk(call, opening)
                if call.echo:
                    yield self._chunk(call, [shape.delta_choice(i, call.echo)
                                             for i in range(call.choices)])
                while isinstance(msg, wire.TokenChunk):
                    call.progress.on_tokens(len(msg.token_ids), time.perf_counter())
                    if chunk := self._delta(call, msg):
                        yield chunk
                    msg = await next_message(messages)
                *ends, last = msg.ends()
                for end in ends:  # each choice's end in a chunk of its own, as vLLM's
                    yield self._chunk(call, [shape.delta_choice(end.index, "", end)])
                yield self._chunk(call, [shape.delta_choice(last.index, "", last)],
                                  cpd=protocol.cpd_extension(call.request_id, msg))
                if call.include_usage:
                    yield self._chunk(call, [], usage=protocol.usage(msg))
                ended = True
                self.outcomes.succeed(call, msg)
            except CpdError as e:
                ended = True
                yield sse_event(self.outcomes.record_failure(call, ApiError.from_cpd(e)).body())
            except Exception as e:
                ended = True
                yield sse_event(self.outcomes.record_failure(call, internal_error(e, call)).body())
            yield SSE_DONE
        except (asyncio.CancelledError, GeneratorExit):
            if not ended:
                self.outcomes.abandon(call)
            raise
        finally:
            call.span.end()
            first.cancel()  # a client that left while its request waited
            await messages.aclose()  # type: ignore[attr-defined]
