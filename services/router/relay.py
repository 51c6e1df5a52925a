"""The router's side of one request's stream across tries: who owns the stream now, and
the tokens forwarded to the client.

The prefill node owns a try's stream until its decode node accepts the hand-off; the
decode node says so on the stream itself (``wire.HandoffAccepted``), so the router
watches the liveness of the node that really streams, never a guess from the tokens
seen. A retried try continues the client's stream exactly where the last one stopped,
and so does a request a client resumes here after its router died
(``GenerateRequest.resume_tokens``): the client's tokens count as forwarded.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Awaitable, Callable
from dataclasses import replace
from typing import Any

import msgspec

from cpd.bus import ReplyStream, StreamReader
from cpd.engines.servedmodel import Detokenizer
from cpd.protocol import wire
from cpd.protocol.errors import (
    CpdError,
    ErrorCode,
    RequestTimeout,
    Unavailable,
)
from services.router.choices import ChoiceText
from services.router.nodes import NodeTable
from services.router.outcome import Reports

Cancel = Callable[[list[str], int | None], Awaitable[None]]
"""Tell these nodes to stop generating the current try (or only that choice of it)."""

# How long a request a stop string ended waits for its nodes' reports once cancelled
# (an engine step or two); the client's final goes out regardless.
_REPORTS_AFTER_CANCEL_S = 2.0


def resumed_complete(req: wire.GenerateRequest, resumed: list[int], prompt_tokens: int,
                     eos_token_id: int | None) -> dict[str, Any] | None:
    """The final message's fields for a resumed request that has all ``max_tokens`` of
    its tokens already (only its final message was lost: a NATS restart), how vLLM
    would have ended it; ``None`` while some are left to generate."""
    s = req.sampling
    if len(resumed) < s.max_tokens:
        return None
    last = resumed[-1]
    eos = eos_token_id is not None and last == eos_token_id and not s.ignore_eos
    stop_token = last in s.stop_token_ids
    return {"finish_reason": "stop" if eos or stop_token else "length",
            "stop_reason": last if stop_token else None,
            "usage": wire.Usage(prompt_tokens=prompt_tokens, completion_tokens=len(resumed))}


def fresh_engine_id(req: wire.GenerateRequest) -> wire.GenerateRequest:
    """``req`` under a request id of its own for the engines. Nodes refuse a second
    request of an id they still run, and a client's id may still run there when it comes
    again: the client sent it twice at once, it resumes after its router died (that try
    streams into an inbox nobody reads until it ends), or it retries after a deadline
    whose cancel has not reached the nodes yet. The client's id stays its prefix, so
    logs and traces of both ends still match."""
    return msgspec.structs.replace(req, request_id=f"{req.request_id}~{secrets.token_hex(4)}")


class AttemptFailed(Exception):
    """One try of a request failed; ``nodes`` are the ones to route around."""

    def __init__(self, error: CpdError, nodes: set[str]) -> None:
        super().__init__(error.message)
        self.error = error
        self.nodes = nodes


class Relay:
    """The client's side of a request across tries: forwards each choice's tokens with
    their text and makes a retried stream continue exactly where the last one stopped."""

    def __init__(self, out: ReplyStream, detok: Callable[[], Detokenizer],
                 sampling: wire.SamplingParams | None = None) -> None:
        self.out = out
        s = sampling or wire.SamplingParams()
        self.choices = [ChoiceText(i, detok(), s) for i in range(s.n)]
        self.first_at = 0.0
        self._prefill_node = ""  # the current try's
        self._try_nodes: list[str] = []  # its prefill and decode nodes
        self.decode_node = ""  # the node that accepted the current try's hand-off
        self.reports = Reports()  # the current try's

    @property
    def sent(self) -> int:
        """Tokens the client has, of every choice."""
        return sum(len(c.forwarded) for c in self.choices)

    @property
    def owner(self) -> str:
        """The node streaming the current try: its prefill node until a decode node
        accepts the hand-off."""
        return self.decode_node or self._prefill_node

    def resume(self, ids: list[int], text_chars: int) -> None:
        """The client already has ``ids`` and ``text_chars`` characters of their text
        (one choice) from a router that died (:meth:`ChoiceText.resume`)."""
        self.choices[0].resume(ids, text_chars)

    @property
    def stop_string(self) -> str | None:
        """The stop string that ended the request (of one choice), once one did."""
        return self.choices[0].stop_string if len(self.choices) == 1 else None

    def restart(self, prefill_node: str, decode_node: str = "") -> None:
        """A new try, dispatched to ``prefill_node``, which owns its stream, to hand off
        to ``decode_node``."""
        for c in self.choices:
            c.seen = 0
        self._prefill_node = prefill_node
        self._try_nodes = [n for n in (prefill_node, decode_node) if n]
        self.decode_node = ""
        self.reports = Reports()

    def accepted(self, msg: wire.HandoffAccepted) -> None:
        """The decode node took the hand-off: it owns the rest of the stream."""
        self.decode_node = msg.node

    async def follow(self, reader: StreamReader, nodes: NodeTable, *, check_s: float,
                     idle_s: float, cancel: Cancel) -> wire.Final:
        """Relay the current try's stream until its final message, failing the try when
        the node that owns the stream stops heart-beating (or comes back as a new
        incarnation, which lost the request all the same), or when tokens stop for
        ``idle_s`` once they flowed (a hand-off that never landed). A stop string ends
        it early: the try's nodes are told to ``cancel``, and their reports awaited (of
        several choices, only that choice is cancelled; the others go on)."""
        last = time.monotonic()
        epochs: dict[str, int] = {}
        while True:
            owner = self.owner
            if owner not in epochs:
                epochs[owner] = nodes.epoch(owner)
            try:
                msg = await reader.next(check_s)
            except CpdError as e:  # route around the node it names (a refused hand-off)
                raise AttemptFailed(e, {e.node or owner}) from None
            now = time.monotonic()
            if msg is None:
                if not nodes.alive(owner, now, epochs[owner]):
                    raise AttemptFailed(Unavailable(
                        f"{owner} stopped heart-beating while serving the request"), {owner})
                # A long prefill may be silent for long; once tokens flow, a silence this
                # long means the stream was lost between nodes, even with every node alive.
                if any(c.seen for c in self.choices) and now - last > idle_s:
                    raise AttemptFailed(RequestTimeout(
                        f"no token from {owner} for {idle_s:.0f}s"), {owner})
                continue
            last = now
            match msg:
                case wire.TokenChunk():
                    choice = self._choice(msg.index)
                    if choice.stop_string is not None:
                        continue  # cancelled: nothing after its stop string
                    await self.tokens(msg.token_ids,
                                      ends_with_stop_token=msg.ends_with_stop_token,
                                      logprobs=msg.logprobs, index=msg.index)
                    if self.stop_string is not None:
                        return await self._stopped(reader, cancel, check_s)
                    if choice.stop_string is not None:
                        await cancel([owner], choice.index)
                case wire.HandoffAccepted():
                    self.accepted(msg)
                case wire.PrefillReport() | wire.DecodeReport():
                    self._report(msg)
                case wire.Final():
                    return msg

    def _choice(self, index: int) -> ChoiceText:
        if index >= len(self.choices):
            raise AttemptFailed(CpdError(
                f"tokens of choice {index} for a request of {len(self.choices)}",
                code=ErrorCode.MALFORMED), set())
        return self.choices[index]

    async def _stopped(self, reader: StreamReader, cancel: Cancel, check_s: float
                       ) -> wire.Final:
        """A stop string ended the request: cancel the try's nodes and wait, a short
        while, for their reports (the rest of the stream is dropped)."""
        await cancel(self._try_nodes, None)
        final = wire.Final(request_id=self.out.request_id, seq=0, finish_reason="stop",
                           stop_reason=self.stop_string)
        deadline = time.monotonic() + _REPORTS_AFTER_CANCEL_S
        while (left := deadline - time.monotonic()) > 0:
            try:
                msg = await reader.next(min(left, check_s))
            except CpdError:
                break
            if isinstance(msg, wire.PrefillReport | wire.DecodeReport):
                self._report(msg)
            elif isinstance(msg, wire.Final):
                break
        return final

    def _report(self, msg: wire.PrefillReport | wire.DecodeReport) -> None:
        """Keep a node's report of the current try."""
        if isinstance(msg, wire.PrefillReport):
            self.reports = replace(self.reports, prefill=msg)
        else:
            self.reports = replace(self.reports, decode=msg)

    async def tokens(self, ids: list[int], *, ends_with_stop_token: bool = False,
                     logprobs: list[wire.TokenLogprob] | None = None, index: int = 0
                     ) -> None:
        """Forward what the client does not have yet of choice ``index``'s ``ids`` in
        the current try (and their ``logprobs``, when the request asked)."""
        c = self._choice(index)
        if c.stop_string is not None:
            return  # nothing after a stop string
        start = c.seen
        c.seen += len(ids)
        # A retry regenerates what the client already has: it must be the same tokens.
        overlap = ids[:max(0, len(c.forwarded) - start)]
        if overlap != c.forwarded[start:start + len(overlap)]:
            raise AttemptFailed(CpdError(
                "a retried request diverged from the tokens already sent",
                code=ErrorCode.INTERNAL), set())
        new = ids[len(overlap):]
        if not new:
            return
        if not self.first_at:
            self.first_at = time.monotonic()
        n, text = c.texts(new, ends_with_stop_token=ends_with_stop_token)
        c.forwarded.extend(new[:n])
        await self.out.tokens(new[:n], c.text(text), index=index,
                              logprobs=(logprobs or [])[len(overlap):len(overlap) + n])

    def ends(self, worker: wire.Final) -> list[wire.ChoiceEnd]:
        """How each choice ended for the client, when the request has several (the
        worker's ``worker.choices``, with the router's stop strings)."""
        if len(self.choices) == 1:
            return []
        said = {e.index: e for e in worker.choices}
        return [c.end(said.get(c.index)) for c in self.choices]

    async def final(self, final: wire.Final) -> None:
        """End the client's stream with each choice's text still held back and ``final``
        (the router's, assembled by :func:`services.router.outcome.assemble`)."""
        for c in self.choices:
            if rest := c.rest():
                await self.out.tokens([], rest, index=c.index)
        await self.out.final(finish_reason=final.finish_reason,
                             stop_reason=final.stop_reason, usage=final.usage,
                             timings=final.timings, route=final.route,
                             choices=final.choices)
