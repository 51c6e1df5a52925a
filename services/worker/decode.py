"""The decode handler.

Accept a hand-off, pull the request's blocks from its prefill node (whatever cannot be
pulled is recomputed), ack the pull so the prefill node releases its lease, and stream
the rest of the tokens from prompt + first token. A hand-off from this same process (a
node hosting both handlers) needs no pull: the blocks are in its own store.
"""

from __future__ import annotations

import contextlib
import time

import numpy as np

from cpd.bus import ReplyStream, Request, Service
from cpd.engines import EngineRequest, EngineStep
from cpd.protocol import subjects, wire
from cpd.protocol.errors import CpdError, InvalidRequest
from cpd.protocol.roles import Role
from services.worker.core import WorkerCore
from services.worker.requests import check_ids, continuation


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
        if not 0 <= req.first_token < core.vocab_size:
            raise InvalidRequest(f"first token {req.first_token} is outside the vocabulary "
                                 f"of {core.vocab_size}")
        hashes = wire.split_hashes(req.block_hashes)
        remaining = req.sampling.max_tokens - 1
        if remaining < 1:
            raise InvalidRequest("a hand-off needs at least one more token to generate")
        core.check_not_cancelled(req.request_id)
        core.admit(len(tokens) + 1, remaining, req.deadline_unix_ms)
        core.claim("decode", req.request_id)
        core.spawn(self._decode(req, tokens, hashes), f"decode-{req.request_id}",
                   background=False)
        return wire.Accepted(request_id=req.request_id, node=core.node_id)

    async def _decode(self, req: wire.DecodeRequest, tokens: np.ndarray,
                      hashes: list[bytes]) -> None:
        core = self.core
        out = ReplyStream(core.bus, req.reply_to, req.request_id, seq_start=req.seq_start)
        t0 = time.perf_counter()
        try:
            await out.handoff_accepted(core.node_id)
            await self._pull(req, hashes)
            t_pull = time.perf_counter()
            prompt, sampling, forced = continuation(req.sampling, tokens, req.first_token)
            have = core.loader.sealed_prefix(hashes[:(len(prompt) - 1) // core.block_size])
            core.loader.audit_load(req.namespace, have)
            submitted = time.monotonic()
            async with core.pinned("decode", req.request_id, have):
                last, generated = await self._generate(out, EngineRequest(
                    request_id=req.request_id, tokens=prompt, sampling=sampling,
                    forced_output=forced, load_slots=[e.slot for e in have],
                    load_checksums=[e.checksum for e in have],
                    cache_salt=core.salt(req.namespace)))
            if last.failed_blocks:
                await core.drop_corrupt([e.hash for e in have])
            t_end = time.perf_counter()
            queued = core.queued(submitted, last)
            core.record(Role.DECODE, {"pull": t_pull - t0, "decode": t_end - t_pull},
                        queued=queued, loaded=last.loaded_blocks)
            await self._final(req, out, last, generated + 1, len(tokens),
                              handoff_ms=(t_pull - t0) * 1e3, decode_ms=(t_end - t_pull) * 1e3,
                              queue_ms=queued * 1e3)
        except Exception as e:
            core.log.warning("decode.failed", error=repr(e))
            core.count_stream_rejection(self.subject, e)
            await out.error(e)
        finally:
            core.running.discard(("decode", req.request_id))

    async def _pull(self, req: wire.DecodeRequest, hashes: list[bytes]) -> None:
        """Pull the hand-off's blocks (a failure is a fallback: they are recomputed) and
        ack, so the prefill node releases its lease."""
        core = self.core
        ok = True
        if hashes and req.source_node != core.node_id:
            core.loader.planned("handoff")
            _, failure = await core.loader.pull("handoff", req.source_node, hashes,
                                                namespace=req.namespace,
                                                capability=req.capability)
            ok = failure is None
        with contextlib.suppress(CpdError):
            await core.bus.publish(subjects.pull_ack(req.source_node), wire.PullAck(
                request_id=req.request_id, lease_id=req.lease_id, ok=ok))

    async def _generate(self, out: ReplyStream, ereq: EngineRequest) -> tuple[EngineStep, int]:
        """Stream the engine's tokens in chunks of ``worker.stream_interval``; the last
        step and how many tokens were generated."""
        core = self.core
        interval = core.settings.worker.stream_interval
        generated = 0
        last = EngineStep()
        pending: list[int] = []
        logprobs: list[wire.TokenLogprob] = []
        # Reported at once: decode is chosen by load, the next router must see it.
        with core.load.running(report=True):
            async for step in core.engine.generate(ereq):
                if step.token_ids:
                    generated += len(step.token_ids)
                    pending += step.token_ids
                    logprobs += step.logprobs
                    stopped = step.finished and step.finish_reason == "stop"
                    if len(pending) >= interval or stopped:
                        await out.tokens(pending, ends_with_stop_token=stopped,
                                         logprobs=logprobs)
                        pending, logprobs = [], []
                last = step
            if pending:
                await out.tokens(pending, logprobs=logprobs)
        return last, generated

    async def _final(self, req: wire.DecodeRequest, out: ReplyStream, last: EngineStep,
                     generated: int, prompt_tokens: int, *, handoff_ms: float,
                     decode_ms: float, queue_ms: float) -> None:
        await out.report(wire.DecodeReport, node=self.core.node_id,
                         tokens_pulled=last.loaded_blocks * self.core.block_size,
                         tokens_computed=prompt_tokens + 1 - last.cached_tokens,
                         handoff_ms=handoff_ms, decode_ms=decode_ms, queue_ms=queue_ms)
        await out.final(finish_reason=last.finish_reason or "length",
                        stop_reason=last.stop_token,
                        usage=wire.Usage(prompt_tokens=prompt_tokens,
                                         completion_tokens=generated))
