"""A streaming client of CPD's OpenAI-compatible API that survives the death of the
gateway it streams from (docs/reliability.md, "Gateway death").

It names its request (``X-Request-Id``) and asks for the generated token ids
(``return_token_ids``). When a stream breaks before its end (the connection drops, or
the body ends without ``[DONE]``), it sends the request again, under the same id, to the
next gateway, with what it already has (``cpd_resume``): the router regenerates that and
streams only what follows, so the text is whole and nothing is repeated. A gateway that
cannot be reached is skipped the same way. Resuming needs a reproducible request of one
choice (``temperature`` 0, or a ``seed``), as the router's own resume does; a request
that is not reproducible is only sent again while nothing of it has arrived.

An error the gateway reports (an HTTP error status, or an ``error`` event in the stream)
is the request's answer and raises :class:`ApiError`; it is not retried, except 502 and
503 before the stream starts (that gateway is stopping, or reaches no router), which
go to the next gateway like a broken stream.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx
import msgspec

REQUEST_ID_HEADER = "X-Request-Id"
# Statuses another gateway may answer otherwise: this one is stopping or reaches no router.
_TRY_ELSEWHERE = frozenset({502, 503})


class ApiError(Exception):
    """The gateway answered with an error: its HTTP status (None for an error event in a
    stream already under way) and OpenAI's error object."""

    def __init__(self, status: int | None, error: dict[str, Any]) -> None:
        super().__init__(f"{status}: {error.get('message', '')}")
        self.status = status
        self.error = error

    @property
    def code(self) -> str | None:
        """CPD's error code (``cpd.protocol.errors.ErrorCode`` values), when given."""
        return self.error.get("code")


class StreamLost(Exception):
    """The stream broke on every gateway tried, or broke once output had arrived for a
    request that cannot resume; ``result`` holds what arrived."""

    def __init__(self, message: str, result: StreamResult) -> None:
        super().__init__(message)
        self.result = result


@dataclass
class StreamResult:
    """One streamed choice, assembled across the gateways it went through."""

    request_id: str
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    usage: dict[str, Any] | None = None
    cpd: dict[str, Any] | None = None   # the gateway's ``cpd`` field: route and timings
    gateways: list[str] = field(default_factory=list)  # each try's, in order

    @property
    def resumes(self) -> int:
        """Tries after the first (a gateway lost, skipped or resumed on)."""
        return max(0, len(self.gateways) - 1)


class _Broken(Exception):
    """This try's stream ended before its end."""


async def stream(http: httpx.AsyncClient, gateways: Sequence[str], path: str,
                 body: dict[str, Any], *, request_id: str | None = None,
                 attempts: int = 3,
                 on_chunk: Callable[[StreamResult], None] | None = None) -> StreamResult:
    """Stream ``body`` (a Completions or Chat Completions request of one choice) to
    ``path`` on the first of ``gateways`` (base URLs), moving to the next one in turn
    each time a stream breaks, at most ``attempts`` tries in all; ``on_chunk`` sees the
    result so far after each chunk."""
    if not gateways:
        raise ValueError("no gateway to send to")
    if (body.get("n") or 1) != 1:
        raise ValueError("only a request of one choice can be streamed and resumed")
    result = StreamResult(request_id=request_id or uuid.uuid4().hex)
    reproducible = body.get("temperature") == 0 or body.get("seed") is not None
    last: Exception | None = None
    for attempt in range(attempts):
        if result.token_ids and not reproducible:
            raise StreamLost("the stream broke and the request is not reproducible "
                             "(temperature 0 or a seed): it cannot resume", result)
        base = gateways[attempt % len(gateways)]
        result.gateways.append(base)
        sent = {**body, "stream": True, "return_token_ids": True}
        if result.token_ids:
            sent["cpd_resume"] = {"token_ids": result.token_ids,
                                  "text_chars": len(result.text)}
        try:
            await _one_try(http, base + path, sent, result, on_chunk)
            return result
        except (httpx.TransportError, _Broken) as e:
            last = e
    raise StreamLost(f"the stream broke on {attempts} tries: {last!r}", result)


async def _one_try(http: httpx.AsyncClient, url: str, body: dict[str, Any],
                   result: StreamResult,
                   on_chunk: Callable[[StreamResult], None] | None) -> None:
    async with http.stream("POST", url, json=body,
                           headers={REQUEST_ID_HEADER: result.request_id}) as resp:
        if resp.status_code in _TRY_ELSEWHERE:  # a gateway stopping, or without routers
            raise _Broken(f"HTTP {resp.status_code}")
        if resp.status_code != 200:
            raw = await resp.aread()
            raise ApiError(resp.status_code, _error_of(raw))
        async for line in resp.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[len("data: "):]
            if data == "[DONE]":
                if result.finish_reason is None:
                    raise _Broken("[DONE] before the choice's end")
                return
            try:
                chunk = msgspec.json.decode(data)
            except msgspec.DecodeError:  # cut off mid-event
                raise _Broken("a torn event") from None
            _take(chunk, result)
            if on_chunk is not None:
                on_chunk(result)
    raise _Broken("the stream ended without [DONE]")


def _take(chunk: dict[str, Any], result: StreamResult) -> None:
    if "error" in chunk:
        raise ApiError(None, chunk["error"])
    if chunk.get("usage"):
        result.usage = chunk["usage"]
    if chunk.get("cpd"):
        result.cpd = chunk["cpd"]
    for choice in chunk.get("choices") or []:
        delta = choice.get("delta")
        text = (delta or {}).get("content") if delta is not None else choice.get("text")
        result.text += text or ""
        result.token_ids += choice.get("token_ids") or []
        if choice.get("finish_reason"):
            result.finish_reason = choice["finish_reason"]


def _error_of(raw: bytes) -> dict[str, Any]:
    try:
        error = msgspec.json.decode(raw).get("error")
    except (msgspec.DecodeError, AttributeError):
        error = None
    return error if isinstance(error, dict) else {"message": raw[:500].decode(errors="replace")}
