"""OpenAI's Completions and Chat Completions APIs as the gateway speaks them.

* Request bodies are msgspec structs: unknown fields are ignored (OpenAI clients send
  fields of their own), known ones are type-checked; ``null`` means "not given".
* Features CPD does not have (several choices, tools...) are refused with a 400 naming
  the field, rather than silently ignored: a client asking for them would otherwise get
  a different answer than asked.
* :class:`Shape` builds the JSON of replies and stream chunks of each API, plus the
  ``cpd`` extension (route and timings of the request) that clients ignore.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Annotated, Any, TypeVar

import msgspec

from cpd.engines.servedmodel import ServedModel
from cpd.protocol import wire
from services.gateway import logprobs
from services.gateway.bestof import Ranking
from services.gateway.errors import ApiError, field_of

DEFAULT_MAX_TOKENS = 16
"""Completions API default when ``max_tokens`` is absent (OpenAI's)."""

DEFAULT_TEMPERATURE = 1.0
"""OpenAI's default; clients that want greedy output send ``temperature=0``."""

# Chat roles CPD renders, and the template role each maps to ("developer" is OpenAI's
# newer name for "system").
_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}

_FINISH_REASONS = frozenset({"stop", "length"})

_Body = TypeVar("_Body", bound=msgspec.Struct)


class StreamOptions(msgspec.Struct, kw_only=True):
    include_usage: bool | None = None


class Resume(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """``cpd_resume``: the token ids and the characters of text a client already has of
    its one choice (docs/reliability.md, "Gateway death")."""

    token_ids: list[wire.TokenId]
    text_chars: Annotated[int, msgspec.Meta(ge=0)] = 0


class _Common(msgspec.Struct, kw_only=True):
    """Fields both APIs share."""

    model: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: wire.Int64 | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    n: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    # vLLM's extras, which CPD implements.
    top_k: wire.TopK | None = None
    stop_token_ids: list[wire.TokenId] | None = None
    ignore_eos: bool | None = None
    # Into the request's cache namespace: requests with different salts share no KV.
    cache_salt: str | None = None
    # vLLM's meaning: lower values are served first (the router's admission queue).
    # Within int64 once negated for the router.
    priority: Annotated[int, msgspec.Meta(ge=-(1 << 63) + 1, le=(1 << 63) - 1)] | None = None
    # OpenAI's end-user id: logged with the request, nothing else.
    user: str | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    skip_special_tokens: bool | None = None
    include_stop_str_in_output: bool | None = None
    truncate_prompt_tokens: int | None = None
    # vLLM's: each choice carries its generated token ids (a stream's, each chunk's new
    # ones), and the reply the prompt's (a stream's first chunk).
    return_token_ids: bool | None = None
    # CPD's: the retry of a stream whose gateway died, with the same X-Request-Id: what
    # the client already has, which the router regenerates and does not send again.
    cpd_resume: Resume | None = None


class CompletionRequest(_Common, kw_only=True):
    """Body of ``POST /v1/completions``."""

    # A string, token ids, or a list holding one of those (several prompts are refused).
    prompt: str | list[Any]
    max_tokens: int | None = None
    echo: bool | None = None
    best_of: int | None = None
    logprobs: int | None = None
    suffix: str | None = None


class ContentPart(msgspec.Struct, kw_only=True):
    type: str
    text: str | None = None


class ChatMessage(msgspec.Struct, kw_only=True):
    role: str
    content: str | list[ContentPart] | None = None


class ChatRequest(_Common, kw_only=True):
    """Body of ``POST /v1/chat/completions``."""

    messages: list[ChatMessage]
    max_tokens: int | None = None
    # OpenAI's newer name for max_tokens; it wins when both are given.
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    response_format: dict[str, Any] | None = None


def decode_body(raw: bytes, kind: type[CompletionRequest] | type[ChatRequest]
                ) -> CompletionRequest | ChatRequest:
    """Parse a request body; bad JSON or a wrongly typed field is a 400 naming it."""
    return _decode(raw, kind)


def _decode(raw: bytes, kind: type[_Body]) -> _Body:
    try:
        return msgspec.json.decode(raw, type=kind)
    except msgspec.ValidationError as e:
        raise ApiError.invalid(f"invalid request body: {e}", param=field_of(str(e))) from None
    except msgspec.DecodeError as e:
        raise ApiError.invalid(f"request body is not valid JSON: {e}") from None


def refuse_unsupported(body: CompletionRequest | ChatRequest) -> None:
    """Raise a 400 for the first requested feature CPD does not implement."""
    if body.truncate_prompt_tokens is not None:
        raise ApiError.invalid("truncate_prompt_tokens is not supported",
                               param="truncate_prompt_tokens")
    if body.cpd_resume is not None and (body.n or 1) > 1:
        raise ApiError.invalid("a request of several choices cannot resume",
                               param="cpd_resume")
    if body.n is not None and not 1 <= body.n <= wire.MAX_CHOICES:
        raise ApiError.invalid(f"n must be between 1 and {wire.MAX_CHOICES}", param="n")
    if isinstance(body, CompletionRequest):
        if body.echo and body.logprobs is not None:
            raise ApiError.invalid("echo with logprobs (the prompt's log probabilities) "
                                   "is not supported", param="echo")
        if body.best_of is not None and not (body.n or 1) <= body.best_of <= wire.MAX_CHOICES:
            raise ApiError.invalid(f"best_of must be at least n and at most "
                                   f"{wire.MAX_CHOICES}", param="best_of")
        if (body.best_of or 1) > 1 and body.stream:
            raise ApiError.invalid("best_of cannot be streamed: the best choices are "
                                   "known at their end", param="best_of")
        if body.suffix:
            raise ApiError.invalid("suffix is not supported", param="suffix")
        return
    if body.tools:
        raise ApiError.invalid("tools are not supported", param="tools")
    if body.response_format and body.response_format.get("type", "text") != "text":
        raise ApiError.invalid("only the text response_format is supported",
                               param="response_format")


class TokenizeRequest(msgspec.Struct, kw_only=True):
    """Body of ``POST /tokenize``: a prompt, or chat messages rendered as a chat is."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None

    def chat(self) -> ChatRequest:
        """The messages as a chat request (what the chat template renders)."""
        return ChatRequest(messages=self.messages or [])


class DetokenizeRequest(msgspec.Struct, kw_only=True):
    """Body of ``POST /detokenize``."""

    tokens: list[int]
    model: str | None = None


def decode_tokenize(raw: bytes) -> TokenizeRequest:
    """Parse a ``/tokenize`` body (400 naming a bad field)."""
    return _decode(raw, TokenizeRequest)


def decode_detokenize(raw: bytes) -> DetokenizeRequest:
    """Parse a ``/detokenize`` body (400 naming a bad field)."""
    return _decode(raw, DetokenizeRequest)


def sampling_options(body: CompletionRequest | ChatRequest) -> dict[str, Any]:
    """The request's sampling settings it gives, as :meth:`cpd.client.Client.request`
    takes them (``stop`` as a list, ``logit_bias`` keyed by token id)."""
    given: dict[str, Any] = {
        name: getattr(body, name) for name in (
            "top_p", "top_k", "seed", "stop_token_ids", "ignore_eos", "min_p",
            "repetition_penalty", "presence_penalty", "frequency_penalty", "min_tokens",
            "include_stop_str_in_output", "skip_special_tokens", "n")}
    given["logprobs"] = logprobs.requested(body, chat=isinstance(body, ChatRequest))
    if ranked(body) is not None:  # every choice's log probabilities rank them
        given["n"] = body.best_of  # type: ignore[union-attr]
        given["logprobs"] = given["logprobs"] or 0
    if body.stop:
        given["stop"] = [body.stop] if isinstance(body.stop, str) else body.stop
    if body.logit_bias:
        try:
            given["logit_bias"] = {int(k): v for k, v in body.logit_bias.items()}
        except ValueError:
            raise ApiError.invalid("logit_bias keys must be token ids",
                                   param="logit_bias") from None
    return {k: v for k, v in given.items() if v is not None}


def ranked(body: CompletionRequest | ChatRequest) -> Ranking | None:
    """The request's ``best_of`` ranking, when it generates more choices than it returns."""
    if not isinstance(body, CompletionRequest) or (body.best_of or 1) <= (body.n or 1):
        return None
    return Ranking(n=body.n or 1, logprobs=body.logprobs is not None)


def completion_prompt(body: CompletionRequest, model: ServedModel) -> str | list[int]:
    """The one prompt of a completions request: text, or token ids checked against the
    model's vocabulary."""
    prompt: Any = body.prompt
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        if not prompt:
            raise ApiError.invalid("prompt must not be empty", param="prompt")
        return prompt
    if not prompt:
        raise ApiError.invalid("prompt must not be empty", param="prompt")
    if not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        raise ApiError.invalid(
            "prompt must be a string or a list of token ids; several prompts in one "
            "request are not supported (send one request per prompt)", param="prompt")
    if not model.vocab_size:
        return prompt  # a model folder without a vocabulary size: the engine checks
    bad = next((t for t in prompt if not 0 <= t < model.vocab_size), None)
    if bad is not None:
        raise ApiError.invalid(f"token id {bad} is outside the vocabulary "
                               f"(0..{model.vocab_size - 1})", param="prompt")
    return prompt


def echo_text(prompt: str | list[int], model: ServedModel) -> str:
    """The prompt's text (:func:`completion_prompt`'s), as ``echo`` sends it back before
    the output."""
    return prompt if isinstance(prompt, str) else model.tokenizer.decode(
        prompt, skip_special_tokens=False)


def chat_prompt(body: ChatRequest, model: ServedModel) -> str:
    """The prompt text of a chat, rendered with the model's chat template."""
    if not body.messages:
        raise ApiError.invalid("messages must not be empty", param="messages")
    turns: list[dict[str, str]] = []
    for i, message in enumerate(body.messages):
        role = _ROLES.get(message.role)
        if role is None:
            raise ApiError.invalid(
                f"role {message.role!r} is not supported (use one of {sorted(_ROLES)})",
                param=f"messages[{i}].role")
        turns.append({"role": role, "content": _text_of(message, i)})
    return model.render_chat(turns)


def _text_of(message: ChatMessage, index: int) -> str:
    if message.content is None or isinstance(message.content, str):
        return message.content or ""
    texts = []
    for part in message.content:
        if part.type != "text":
            raise ApiError.invalid(f"content of type {part.type!r} is not supported; only "
                                   "text", param=f"messages[{index}].content")
        texts.append(part.text or "")
    return "\n".join(texts)  # as vLLM joins the text parts a template gets as one string


def stop_reason(end: wire.ChoiceEnd) -> int | str | None:
    """vLLM's ``stop_reason``: the stop string or stop token id that ended the choice."""
    return end.stop_reason if finish_reason(end) == "stop" else None


def finish_reason(end: wire.ChoiceEnd) -> str:
    """OpenAI's finish reason for CPD's: ``length`` at the token limit, else ``stop``."""
    return end.finish_reason if end.finish_reason in _FINISH_REASONS else "stop"


def usage(final: wire.Final) -> dict[str, Any]:
    """OpenAI's usage object (cached prompt tokens in ``prompt_tokens_details``)."""
    u = final.usage
    return {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens,
            "total_tokens": u.prompt_tokens + u.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": u.cached_tokens}}


def cpd_extension(request_id: str, final: wire.Final) -> dict[str, Any]:
    """What CPD did for the request: its id, route and timings (an extra top-level field)."""
    return {"request_id": request_id, "route": msgspec.to_builtins(final.route),
            "timings": msgspec.to_builtins(final.timings)}


@dataclass(frozen=True)
class Shape(ABC):
    """The reply shapes of one API; subclasses fill in the choice objects."""

    object: str
    chunk_object: str
    id_prefix: str

    def response(self, *, request_id: str, created: int, model: str,
                 choices: list[dict[str, Any]], final: wire.Final) -> dict[str, Any]:
        """The whole reply of a non-streaming request (its ``choices`` built by
        :meth:`choice`)."""
        return {"id": self.id_prefix + request_id, "object": self.object,
                "created": created, "model": model, "choices": choices,
                "usage": usage(final), "cpd": cpd_extension(request_id, final)}

    def chunk(self, *, request_id: str, created: int, model: str,
              choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        """One stream chunk around ``choices`` (and extra top-level fields)."""
        return {"id": self.id_prefix + request_id, "object": self.chunk_object,
                "created": created, "model": model, "choices": choices, **extra}

    @abstractmethod
    def choice(self, index: int, text: str, end: wire.ChoiceEnd | None,
               logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
        """Choice ``index`` of a whole reply, which ended as ``end`` says."""

    def opening_choices(self, n: int) -> list[dict[str, Any]]:
        """Choices of a chunk sent before any text (none by default)."""
        return []

    def add_prompt_ids(self, body: dict[str, Any], ids: list[int], given: set[int]) -> None:
        """``return_token_ids``: the prompt's ids where vLLM puts them, once per reply:
        at the top level (Chat: a stream's first chunk with choices). ``given`` holds
        where they went already (-1: the top level)."""
        if -1 not in given and body["choices"]:
            body["prompt_token_ids"] = ids
            given.add(-1)

    @abstractmethod
    def delta_choice(self, index: int, text: str, end: wire.ChoiceEnd | None = None,
                     logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
        """Choice ``index`` of a stream chunk: new text, or its finish and stop reasons
        at its ``end``."""


def _reasons(end: wire.ChoiceEnd | None) -> tuple[str | None, int | str | None]:
    return (finish_reason(end), stop_reason(end)) if end is not None else (None, None)


def with_token_ids(choice: dict[str, Any], ids: list[int] | None) -> dict[str, Any]:
    """``choice`` with its ``token_ids`` (``return_token_ids``) when ``ids`` is given."""
    if ids is not None:
        choice["token_ids"] = ids
    return choice


class CompletionShape(Shape):
    def choice(self, index: int, text: str, end: wire.ChoiceEnd | None,
               logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
        finish, stop = _reasons(end)
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish,
                "stop_reason": stop}

    def delta_choice(self, index: int, text: str, end: wire.ChoiceEnd | None = None,
                     logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
        return self.choice(index, text, end, logprobs)

    def add_prompt_ids(self, body: dict[str, Any], ids: list[int], given: set[int]) -> None:
        """Completions: on each choice, as vLLM does (a stream's: on each choice index's
        first chunk)."""
        for choice in body["choices"]:
            if choice["index"] not in given:
                choice["prompt_token_ids"] = ids
                given.add(choice["index"])


class ChatShape(Shape):
    def choice(self, index: int, text: str, end: wire.ChoiceEnd | None,
               logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
        finish, stop = _reasons(end)
        return {"index": index, "message": {"role": "assistant", "content": text},
                "logprobs": logprobs, "finish_reason": finish, "stop_reason": stop}

    def opening_choices(self, n: int) -> list[dict[str, Any]]:
        # OpenAI's first chat chunk names the role and carries no text yet.
        return [{"index": i, "delta": {"role": "assistant", "content": ""},
                 "logprobs": None, "finish_reason": None} for i in range(n)]

    def delta_choice(self, index: int, text: str, end: wire.ChoiceEnd | None = None,
                     logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
        finish, stop = _reasons(end)
        delta = {"content": text} if text else {}
        return {"index": index, "delta": delta, "logprobs": logprobs,
                "finish_reason": finish, "stop_reason": stop}


COMPLETION = CompletionShape(object="text_completion", chunk_object="text_completion",
                             id_prefix="cmpl-")
CHAT = ChatShape(object="chat.completion", chunk_object="chat.completion.chunk",
                 id_prefix="chatcmpl-")
