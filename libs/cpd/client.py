"""The async Python client of CPD: requests go to the router on ``cpd.v1.generate`` and
the reply streams back (docs/architecture.md, "Services", "Subjects").

    async with await Client.connect("nats://127.0.0.1:4222") as cpd:
        async for chunk in cpd.stream("def fib(n):", max_tokens=32):
            print(chunk.text, end="")
        done = await cpd.generate([1, 2, 3], max_tokens=8)   # token ids work too
        print(done.token_ids, done.route.path, done.timings.ttft_ms)

Failures are typed :mod:`cpd.protocol.errors` exceptions with a ``retryable`` flag (for example
:class:`~cpd.protocol.errors.Overloaded` when admission control refuses the request, or
:class:`~cpd.protocol.errors.RouterGone` when the router serving a stream stopped sending even its
keep-alives).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncGenerator, Mapping, Sequence
from types import TracebackType

import msgspec

from cpd.bus import Bus
from cpd.ops.config import RouterSettings, Settings, load_settings
from cpd.protocol import subjects, wire
from cpd.protocol.errors import InvalidRequest, NoResponders, RouterGone, StreamGap

# Past the request's own deadline, how long the client waits for the router's typed
# deadline error before giving up on its own.
_GRACE_S = 5.0
# Before resuming a lost stream: lets NATS notice a dead router's subscription.
_RESUME_PAUSE_S = 0.2
# Lost streams a deterministic request is resumed after, by default.
RESUME_ATTEMPTS = 2


class Choice(msgspec.Struct, kw_only=True):
    """One choice of a finished request (``SamplingParams.n`` of them)."""

    index: int
    token_ids: list[int]
    text: str
    finish_reason: str
    stop_reason: int | str | None = None
    logprobs: list[wire.TokenLogprob] = msgspec.field(default_factory=list)


class Completion(msgspec.Struct, kw_only=True):
    """A finished request: every generated token, its text and the final message's data
    (of choice 0; every choice in ``choices``)."""

    request_id: str
    token_ids: list[int]
    text: str
    finish_reason: str
    usage: wire.Usage
    timings: wire.Timings
    route: wire.Route
    stop_reason: int | str | None = None
    # Per token, when the request asked for log probabilities.
    logprobs: list[wire.TokenLogprob] = msgspec.field(default_factory=list)
    choices: list[Choice] = msgspec.field(default_factory=list)


class Client:
    """A CPD client over one NATS connection (share it; requests run concurrently)."""

    def __init__(self, bus: Bus, *, default_timeout_s: float = 300.0,
                 owns_bus: bool = False, keepalive_interval_s: float | None = None,
                 keepalive_misses: int | None = None,
                 resume_attempts: int = RESUME_ATTEMPTS) -> None:
        self.bus = bus
        self.resume_attempts = resume_attempts
        self.default_timeout_s = default_timeout_s
        self._owns_bus = owns_bus
        defaults = RouterSettings()
        self.keepalive_interval_s = keepalive_interval_s or defaults.keepalive_interval_s
        self.keepalive_misses = keepalive_misses or defaults.keepalive_misses

    @classmethod
    async def connect(cls, url: str | None = None, *, settings: Settings | None = None,
                      name: str = "cpd-client") -> Client:
        """Connect to NATS (``url``, else ``settings.nats.servers``)."""
        settings = settings or load_settings()
        bus = await Bus.open(settings, name, url=url)
        return cls(bus, default_timeout_s=settings.admission.default_deadline_s,
                   owns_bus=True, keepalive_interval_s=settings.router.keepalive_interval_s,
                   keepalive_misses=settings.router.keepalive_misses)

    async def close(self) -> None:
        if self._owns_bus:
            await self.bus.close()

    async def __aenter__(self) -> Client:
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None,
                        exc: BaseException | None, tb: TracebackType | None) -> None:
        await self.close()

    def request(self, prompt: str | Sequence[int], *, max_tokens: int = 16,
                temperature: float = 0.0, top_p: float = 1.0, top_k: int = -1,
                seed: int | None = None, stop_token_ids: Sequence[int] = (),
                ignore_eos: bool = False, min_p: float = 0.0,
                repetition_penalty: float = 1.0, presence_penalty: float = 0.0,
                frequency_penalty: float = 0.0, min_tokens: int = 0,
                logit_bias: Mapping[int, float] | None = None, stop: Sequence[str] = (),
                include_stop_str_in_output: bool = False, skip_special_tokens: bool = True,
                logprobs: int | None = None, n: int = 1, tenant: str = "default",
                cache_salt: str = "",
                priority: int = 0, model: str = "", timeout_s: float | None = None,
                request_id: str | None = None) -> wire.GenerateRequest:
        """The wire request for a prompt given as text (the router tokenizes it) or as
        token ids; the sampling settings are :class:`~cpd.protocol.wire.SamplingParams`'
        (vLLM's meanings). Raises :class:`~cpd.protocol.errors.InvalidRequest` for bad
        sampling values."""
        try:
            sampling = msgspec.convert(
                {"max_tokens": max_tokens, "temperature": temperature, "top_p": top_p,
                 "top_k": top_k, "seed": seed, "stop_token_ids": list(stop_token_ids),
                 "ignore_eos": ignore_eos, "min_p": min_p,
                 "repetition_penalty": repetition_penalty,
                 "presence_penalty": presence_penalty, "frequency_penalty": frequency_penalty,
                 "min_tokens": min_tokens, "logit_bias": dict(logit_bias or {}),
                 "stop": list(stop), "include_stop_str_in_output": include_stop_str_in_output,
                 "skip_special_tokens": skip_special_tokens, "logprobs": logprobs,
                 "n": n},
                wire.SamplingParams)
        except msgspec.ValidationError as e:
            raise InvalidRequest(f"bad sampling parameters: {e}") from None
        timeout_s = timeout_s or self.default_timeout_s
        req = wire.GenerateRequest(
            request_id=request_id or uuid.uuid4().hex, sampling=sampling, model=model,
            tenant=tenant, cache_salt=cache_salt, priority=priority,
            timeout_ms=int(timeout_s * 1000))
        if isinstance(prompt, str):
            req.prompt = prompt
        else:
            try:
                req.tokens = wire.pack_tokens(list(prompt))
            except (ValueError, TypeError, OverflowError) as e:
                raise InvalidRequest(f"bad token ids: {e}") from None
        return req

    async def stream(self, prompt: str | Sequence[int], **options: object
                     ) -> AsyncGenerator[wire.TokenChunk | wire.Final, None]:
        """Yield ``TokenChunk``s as they are generated, then the ``Final`` message.

        Takes the keyword options of :meth:`request`.
        """
        req = self.request(prompt, **options)  # type: ignore[arg-type]
        async for msg in self.stream_request(req):
            yield msg

    async def stream_request(self, req: wire.GenerateRequest, *,
                             resume_attempts: int | None = None
                             ) -> AsyncGenerator[wire.TokenChunk | wire.Final, None]:
        """Stream a prepared :class:`~cpd.protocol.wire.GenerateRequest`.

        A deterministic request (temperature 0, or a seed) whose router dies or loses a
        message mid-stream is sent again, with the same request id and the tokens and
        text it already has, up to ``resume_attempts`` times (default
        :attr:`resume_attempts`): another router replica regenerates them and streams
        only what follows, so the caller sees one stream, nothing repeated. Otherwise,
        or once the attempts are spent, the error is raised:
        :class:`~cpd.protocol.errors.RouterGone` (retryable) when nothing at all comes
        from the router, its keep-alives included, for ``keepalive_misses`` keep-alive
        intervals: it died mid-request (or before it began handling the request) or is
        cut off; and :class:`~cpd.protocol.errors.StreamGap` (retryable) when a message of the
        stream was lost (the keep-alives after it prove it) and does not come within that
        limit. The interval is this client's ``router.keepalive_interval_s`` until the
        router announces its own (every keep-alive does), so a router must send
        keep-alives: every router since they were added does, once a request is valid."""
        attempts = self.resume_attempts if resume_attempts is None else resume_attempts
        s = req.sampling
        if (s.temperature != 0 and s.seed is None) or s.n > 1:
            attempts = 0  # another run would not give the same tokens, or resume them
        end = time.monotonic() + req.timeout_ms / 1000
        ids = [int(i) for i in wire.unpack_tokens(req.resume_tokens or b"")]
        chars = req.resume_text_chars
        for attempt in range(attempts + 1):
            try:
                async with contextlib.aclosing(self._stream_once(req)) as stream:
                    async for msg in stream:
                        if isinstance(msg, wire.TokenChunk):
                            ids.extend(msg.token_ids)
                            chars += len(msg.text)
                        yield msg
                return
            except (RouterGone, StreamGap, NoResponders) as e:
                left = end - time.monotonic()
                # No router at all is a refusal, not a lost stream, until one was lost.
                if (attempt == attempts or left <= 0
                        or (isinstance(e, NoResponders) and attempt == 0)):
                    raise
                await asyncio.sleep(min(_RESUME_PAUSE_S, left))
                req = msgspec.structs.replace(
                    req, resume_tokens=wire.pack_tokens(ids), resume_text_chars=chars,
                    timeout_ms=max(1, int((end - time.monotonic()) * 1000)))

    async def _stream_once(self, req: wire.GenerateRequest
                           ) -> AsyncGenerator[wire.TokenChunk | wire.Final, None]:
        """One try of :meth:`stream_request`: one router's stream."""
        timeout = req.timeout_ms / 1000 + _GRACE_S
        # The router bounds every request by its deadline and watches the nodes, so the
        # client need not guess an idle limit for the work: a long prefill is silent but
        # not dead. The router itself is watched through its keep-alives.
        async with contextlib.aclosing(self.bus.stream(
                subjects.GENERATE, req, timeout=timeout, idle_timeout=timeout,
                silence_limit=self.keepalive_interval_s * self.keepalive_misses,
                keepalive_misses=self.keepalive_misses,
                # A caller that stops reading (an HTTP client gone) ends the request.
                abandoned=(subjects.GENERATE_CANCEL, lambda inbox: wire.CancelGenerate(
                    request_id=req.request_id, reply_to=inbox)))) as stream:
            async for msg in stream:  # keep-alives are consumed by the reader
                if isinstance(msg, wire.TokenChunk | wire.Final):
                    yield msg

    async def generate(self, prompt: str | Sequence[int], **options: object) -> Completion:
        """Run a request to the end and return the whole :class:`Completion`."""
        req = self.request(prompt, **options)  # type: ignore[arg-type]
        parts = [Choice(index=i, token_ids=[], text="", finish_reason="")
                 for i in range(req.sampling.n)]
        texts: list[list[str]] = [[] for _ in parts]
        async for msg in self.stream_request(req):
            if isinstance(msg, wire.TokenChunk):
                c = parts[msg.index]
                c.token_ids.extend(msg.token_ids)
                texts[msg.index].append(msg.text)
                c.logprobs.extend(msg.logprobs)
                continue
            for end in msg.ends():
                c = parts[end.index]
                c.text, c.finish_reason = "".join(texts[end.index]), end.finish_reason
                c.stop_reason = end.stop_reason
            first = parts[0]
            return Completion(request_id=req.request_id, token_ids=first.token_ids,
                              text=first.text, finish_reason=first.finish_reason,
                              stop_reason=first.stop_reason, logprobs=first.logprobs,
                              usage=msg.usage, timings=msg.timings, route=msg.route,
                              choices=parts)
        raise AssertionError("a stream always ends with a final message or an error")

    async def status(self, timeout_s: float = 5.0) -> wire.StatusReply:
        """A router's view of the cluster: nodes, roles, queues, cache use, hit counts."""
        return await self.bus.request(subjects.ROUTER_STATUS, wire.StatusRequest(),
                                      expect=wire.StatusReply, timeout=timeout_s)
