"""The decode handler.

Accept a hand-off, pull the request's blocks from its prefill node (whatever cannot be
pulled is recomputed), ack the pull so the prefill node releases its lease, and stream
the rest of the tokens from the prompt and the prefill's tokens. A hand-off from this
same process (a node hosting both handlers) needs no pull: the blocks are in its own
store.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

import numpy as np

from cpd.bus import ReplyStream, Request, Service
from cpd.engines import EngineRequest, EngineStep
from cpd.protocol import deadlines, subjects, wire
from cpd.protocol.errors import CpdError, InvalidRequest
from cpd.protocol.roles import Role
from services.worker.core import WorkerCore
from services.worker.requests import (
    check_ids,
    choice_id,
    choice_runs,
    continuation,
    ended_on_stop,
)


class DecodeHandler:
    """Serves ``DecodeRequest``s on ``subjects.run("decode", node)``."""

    def __init__(self, core: WorkerCore) -> None:
        self.core = core
        self.subject = subjects.run(Role.DECODE, core.node_id)

    async def attach(self, service: Service) -> None:
        """Register the endpoint on ``service``."""
        await service.add_endpoint("decode", self.subject, self.on_request,
                                   expect=wire.DecodeRequest)

    async def on_request(self, req: wire.DecodeRequest, _: Request) -> wire.Accepted:
        """Check and accept a hand-off; the stream continues from ``req.seq_start``."""
        core = self.core
        check_ids(reply_to=req.reply_to, source_node=req.source_node)
        tokens = wire.unpack_tokens(req.tokens)
        core.check_vocab(tokens)
        n = req.sampling.n
        if (n > 1) != (req.first_token is None):
            raise InvalidRequest("a hand-off carries a first token exactly when its "
                                 "request has one choice")
        if req.next_tokens and req.first_token is None:
            raise InvalidRequest("a hand-off's next tokens follow a first token")
        generated = req.generated()
        if generated and not 0 <= max(generated) < core.vocab_size:
            raise InvalidRequest(f"generated token {max(generated)} is outside the "
                                 f"vocabulary of {core.vocab_size}")
        hashes = wire.split_hashes(req.block_hashes)
        remaining = req.sampling.max_tokens - len(generated)
        if remaining < 1:
            raise InvalidRequest("a hand-off needs at least one more token to generate")
        core.check_not_cancelled(req.request_id)
        req.deadline_unix_ms = deadlines.local_deadline_ms(req.deadline_unix_ms,
                                                           req.budget_ms, deadlines.now_ms())
        core.admit(len(tokens) + len(generated), remaining, req.deadline_unix_ms)
        core.claim("decode", req.request_id)
        if n > 1:
            core.choices[req.request_id] = n
        core.spawn(self._decode(req, tokens, hashes), f"decode-{req.request_id}",
                   background=False)
        return wire.Accepted(request_id=req.request_id, node=core.node_id)

    def _runs(self, req: wire.DecodeRequest, tokens: np.ndarray
              ) -> list[tuple[str, np.ndarray, wire.SamplingParams, tuple[int, ...]]]:
        """The engine runs of a hand-off (id, prompt, sampling, forced output): the
        continuation of the prefill's tokens, or one run per choice."""
        rid = req.request_id
        if req.first_token is None:
            return [(choice_id(rid, i), *run)
                    for i, run in enumerate(choice_runs(req.sampling, tokens))]
        return [(rid, *continuation(req.sampling, tokens, req.generated()))]

    async def _decode(self, req: wire.DecodeRequest, tokens: np.ndarray,
                      hashes: list[bytes]) -> None:
        core = self.core
        out = ReplyStream(core.bus, req.reply_to, req.request_id, seq_start=req.seq_start)
        with core.keepalives.watching(out):
            t0 = time.perf_counter()
            try:
                await out.handoff_accepted(core.node_id)
                await self._pull(req, hashes)
                t_pull = time.perf_counter()
                runs = self._runs(req, tokens)
                have = core.loader.sealed_prefix(hashes[:(len(runs[0][1]) - 1) // core.block_size])
                core.loader.audit_load(req.namespace, have)
                submitted = time.monotonic()
                async with core.pinned("decode", req.request_id, have):
                    ends = await self._generate_all(out, [EngineRequest(
                        request_id=rid, tokens=prompt, sampling=sampling, forced_output=forced,
                        load_slots=[e.slot for e in have],
                        load_checksums=[e.checksum for e in have],
                        cache_salt=core.salt(req.namespace))
                        for rid, prompt, sampling, forced in runs])
                if any(last.failed_blocks for last, _ in ends):
                    await core.drop_corrupt([e.hash for e in have])
                t_end = time.perf_counter()
                queued = core.queued(submitted, ends[0][0])
                loaded = max(last.loaded_blocks for last, _ in ends)
                core.record(Role.DECODE, {"pull": t_pull - t0, "decode": t_end - t_pull},
                            queued=queued, loaded=loaded)
                await out.report(wire.DecodeReport, node=core.node_id,
                                 tokens_pulled=loaded * core.block_size,
                                 tokens_computed=sum(len(prompt) + len(forced) - last.cached_tokens
                                                     for (_, prompt, _, forced), (last, _)
                                                     in zip(runs, ends, strict=True)),
                                 handoff_ms=(t_pull - t0) * 1e3,
                                 decode_ms=(t_end - t_pull) * 1e3, queue_ms=queued * 1e3)
                await self._final(req, out, ends, len(tokens))
            except Exception as e:
                core.log.warning("decode.failed", error=repr(e))
                core.count_stream_rejection(self.subject, e)
                await out.error(e)
            finally:
                core.running.discard(("decode", req.request_id))
                core.choices.pop(req.request_id, None)

    async def _pull(self, req: wire.DecodeRequest, hashes: list[bytes]) -> None:
        """Pull the hand-off's blocks (a failure is a fallback: they are recomputed) and
        ack, so the prefill node releases its lease. Their bytes must be what the prefill
        node sealed as kvindex recorded it, looked up while they travel."""
        core = self.core
        ok = True
        core.kv.handoff()
        if hashes and req.source_node != core.node_id:
            core.loader.planned("handoff")
            _, failure = await core.loader.pull(
                "handoff", req.source_node, hashes, namespace=req.namespace,
                capability=req.capability, request_id=req.request_id)
            ok = failure is None
        with contextlib.suppress(CpdError):
            await core.bus.publish(subjects.pull_ack(req.source_node), wire.PullAck(
                request_id=req.request_id, lease_id=req.lease_id, ok=ok))

    async def _generate_all(self, out: ReplyStream, runs: list[EngineRequest]
                            ) -> list[tuple[EngineStep, int]]:
        """Run the engine runs of a hand-off side by side, each streaming as its choice;
        the last step and generated token count of each."""
        # Reported at once: decode is chosen by load, the next router must see it.
        with self.core.load.running(report=True):
            return list(await asyncio.gather(*(self._generate(out, run, i)
                                               for i, run in enumerate(runs))))

    async def _generate(self, out: ReplyStream, ereq: EngineRequest, index: int
                        ) -> tuple[EngineStep, int]:
        """Stream one engine run's tokens (as choice ``index`` of several) in chunks of
        ``worker.stream_interval``; its last step and how many tokens it generated."""
        interval = self.core.settings.worker.stream_interval
        generated = 0
        last = EngineStep()
        pending: list[int] = []
        logprobs: list[wire.TokenLogprob] = []
        async for step in self.core.engine.generate(ereq):
            if step.token_ids:
                generated += len(step.token_ids)
                pending += step.token_ids
                logprobs += step.logprobs
                stopped = ended_on_stop(step)
                if len(pending) >= interval or stopped:
                    await out.tokens(pending, ends_with_stop_token=stopped,
                                     logprobs=logprobs, index=index)
                    pending, logprobs = [], []
            last = step
        if pending:
            await out.tokens(pending, logprobs=logprobs, index=index)
        return last, generated

    async def _final(self, req: wire.DecodeRequest, out: ReplyStream,
                     ends: list[tuple[EngineStep, int]], prompt_tokens: int) -> None:
        """The final message: how each run ended (by choice, when several), and the
        tokens generated (the prefill's included)."""
        before = len(req.generated())
        choices = [wire.ChoiceEnd(index=i, finish_reason=last.finish_reason or "length",
                                  stop_reason=last.stop_token,
                                  completion_tokens=generated + before)
                   for i, (last, generated) in enumerate(ends)]
        await out.final(finish_reason=choices[0].finish_reason,
                        stop_reason=choices[0].stop_reason,
                        choices=choices if req.first_token is None else [],
                        usage=wire.Usage(prompt_tokens=prompt_tokens, completion_tokens=sum(
                            c.completion_tokens for c in choices)))
