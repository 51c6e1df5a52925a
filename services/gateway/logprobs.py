"""Log probabilities in the shapes of OpenAI's two APIs, as vLLM's server writes them.

Each generated token's entry lists the token itself first, then the most likely tokens
at its position (vLLM's order), each as its own text (the token decoded alone). The
Completions API gives ``logprobs`` + 1 of them per token (the token and the top
``logprobs``, without repeats) and the text offset of every token; the Chat API gives
``top_logprobs`` of them and each token's UTF-8 bytes. ``-inf`` is written as -9999.0,
as OpenAI does (JSON has no infinity).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

from cpd.engines.servedmodel import ServedModel
from cpd.protocol import wire
from services.gateway.errors import ApiError

_FLOOR = -9999.0


class Logprobs(ABC):
    """One request's log probabilities, written chunk by chunk (or once, whole)."""

    def __init__(self, model: ServedModel, top: int) -> None:
        self.model = model
        self.top = top

    def _text(self, token: int) -> str:
        return self.model.tokenizer.decode([token], skip_special_tokens=False)

    def _candidates(self, token: int, entry: wire.TokenLogprob) -> list[tuple[int, float]]:
        """The token, then the most likely ones at its position, without repeats."""
        return [(token, entry.logprob), *((t, lp) for t, lp in entry.top if t != token)]

    @abstractmethod
    def part(self, ids: list[int], entries: list[wire.TokenLogprob]) -> dict[str, Any]:
        """The ``logprobs`` object of a choice holding ``ids`` (the next ones)."""


class CompletionLogprobs(Logprobs):
    """The Completions API's ``logprobs``: tokens, their log probabilities, the top
    ones per token and each token's offset in the text (running across chunks)."""

    def __init__(self, model: ServedModel, top: int) -> None:
        super().__init__(model, top)
        self._offset = 0

    def part(self, ids: list[int], entries: list[wire.TokenLogprob]) -> dict[str, Any]:
        tokens = [self._text(t) for t in ids]
        offsets = []
        for text in tokens:
            offsets.append(self._offset)
            self._offset += len(text)
        return {"tokens": tokens,
                "token_logprobs": [max(e.logprob, _FLOOR) for e in entries],
                "top_logprobs": [
                    {self._text(t): max(lp, _FLOOR)
                     for t, lp in self._candidates(token, e)[:self.top + 1]}
                    for token, e in zip(ids, entries, strict=True)],
                "text_offset": offsets}


class ChatLogprobs(Logprobs):
    """The Chat API's ``logprobs``: per token, its text, log probability, bytes and the
    ``top_logprobs`` most likely tokens."""

    def _item(self, token: int, logprob: float) -> dict[str, Any]:
        text = self._text(token)
        return {"token": text, "logprob": max(logprob, _FLOOR),
                "bytes": list(text.encode())}

    def part(self, ids: list[int], entries: list[wire.TokenLogprob]) -> dict[str, Any]:
        return {"content": [
            {**self._item(token, e.logprob),
             "top_logprobs": [self._item(t, lp)
                              for t, lp in self._candidates(token, e)[:self.top]]}
            for token, e in zip(ids, entries, strict=True)]}


def requested(body: Any, *, chat: bool) -> int | None:
    """How many top log probabilities per token a request asks for (``None``: no log
    probabilities at all); a 400 for the Chat API's ``top_logprobs`` without
    ``logprobs``."""
    if not chat:
        return body.logprobs
    if body.logprobs:
        return body.top_logprobs or 0
    if body.top_logprobs:
        raise ApiError.invalid("top_logprobs needs logprobs: true", param="top_logprobs")
    return None


def writers(top: int | None, model: ServedModel, *, chat: bool, n: int = 1
            ) -> list[Logprobs]:
    """The writers of a request's log probabilities, one per choice (``top`` per token,
    the request's ``SamplingParams.logprobs``); none when it asks for none."""
    if top is None:
        return []
    return [(ChatLogprobs if chat else CompletionLogprobs)(model, top) for _ in range(n)]
