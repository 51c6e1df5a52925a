"""The prefill handler of pre-prefill and prefill workers.

Pull the planned prefix blocks from peers, pin what will be loaded, give every new full
block an arena slot (write-through), run the engine for the first token, send it to the
client (and the next ones, sampled on this engine, while the tokens end inside a
character, so the client's first text needs no hand-off), seal the new blocks (their
event's ack is not on the client's path), then hand the request to its decode node with
the blocks pinned under a lease until decode acks the pull (or the lease runs out).
"""

from __future__ import annotations

import asyncio
import contextlib
import time

import numpy as np
from nats.aio.msg import Msg

from cpd.bus import ReplyStream, Request, Service
from cpd.engines import EngineRequest, EngineStep
from cpd.kvstore import BlockEntry
from cpd.protocol import deadlines, subjects, wire
from cpd.protocol.errors import CpdError, ErrorCode, InvalidRequest
from services.worker.core import WorkerCore
from services.worker.requests import (
    check_ids,
    ended_on_stop,
    first_text,
    first_token,
    next_token,
    wants_text,
)

# How long a hand-off waits for kvindex's record of the blocks it hands over to be
# stored (decode verifies the bytes it pulls against it); past that decode waits on its
# own, and recomputes what is not recorded.
_SEALED_WAIT_S = 0.5


class DecodeUnavailable(CpdError):
    """No decode node accepted the hand-off."""

    code = ErrorCode.UNAVAILABLE
    retryable = True


class PrefillHandler:
    """Serves ``PrefillRequest``s on ``subjects.run(role, node)`` for a prefill-side
    ``role`` and releases hand-off leases on the node's pull-ack subject."""

    def __init__(self, core: WorkerCore, role: str) -> None:
        self.core = core
        self.role = role
        self._service: Service | None = None

    async def attach(self, service: Service) -> None:
        """Register the endpoint and the pull-ack subscription on ``service``."""
        self._service = service
        core = self.core
        await service.bus.nc.subscribe(subjects.pull_ack(core.node_id), cb=self._on_pull_ack)
        await service.add_endpoint("prefill", subjects.run(self.role, core.node_id),
                                   self.on_request, expect=wire.PrefillRequest)

    async def on_request(self, req: wire.PrefillRequest, r: Request) -> wire.Accepted | None:
        """A dispatcher that names a stream inbox (the router) gets ``Accepted`` at once,
        or a typed refusal it can route around; the stream follows on that inbox. A
        direct caller without one gets the stream on its own request's inbox."""
        core = self.core
        check_ids(reply_to=req.reply_to or r.reply_to, decode_node=req.decode_node)
        if not (req.reply_to or r.reply_to):
            raise InvalidRequest("prefill request without a reply inbox")
        req.deadline_unix_ms = deadlines.local_deadline_ms(req.deadline_unix_ms,
                                                           req.budget_ms, deadlines.now_ms())
        core.admit(len(req.tokens) // wire.TOKEN_DTYPE.itemsize, req.sampling.max_tokens,
                   req.deadline_unix_ms)
        core.claim("prefill", req.request_id)
        if not req.reply_to:
            req.reply_to = r.reply_to
            await self._stream(req)
            return None
        core.spawn(self._stream(req), f"prefill-{req.request_id}", background=False)
        return wire.Accepted(request_id=req.request_id, node=core.node_id)

    async def _stream(self, req: wire.PrefillRequest) -> None:
        out = ReplyStream(self.core.bus, req.reply_to, req.request_id)
        try:
            with self.core.keepalives.watching(out):
                await self._prefill(req, out)
        except BaseException as e:
            self.core.count_stream_rejection(subjects.run(self.role, self.core.node_id), e)
            await out.error(e)
            if not isinstance(e, Exception):
                raise
        finally:
            self.core.running.discard(("prefill", req.request_id))

    async def _prefill(self, req: wire.PrefillRequest, out: ReplyStream) -> None:
        core = self.core
        t0 = time.perf_counter()
        tokens = wire.unpack_tokens(req.tokens)  # a numpy view: no per-token objects
        core.check_vocab(tokens)
        hashes = wire.split_hashes(req.block_hashes)
        if len(hashes) != len(tokens) // core.block_size:
            raise InvalidRequest(f"{len(hashes)} block hashes for {len(tokens)} tokens")
        # New tokens as the router planned them (cached ones cost next to nothing): the
        # router prices the held prefill as it priced the request.
        pending = req.planned_new_tokens or len(tokens)
        with core.load.holding(pending, len(tokens) - pending) as held:
            have, (remote, disk), load_error = await self._gather_prefix(req, hashes)
            t_load = held.engine_start = time.perf_counter()
            submitted = time.monotonic()
            step, fresh = await self._run(req, tokens, hashes, have)
        t_done = time.perf_counter()
        # Several choices each start from the prompt on the decode node: the prefill
        # computed their shared KV, its own token is no choice's.
        several = req.sampling.n > 1
        generated: list[int] = []
        last = step
        try:
            if not several:
                generated, logprobs, last = await self._first_text(req, tokens, step)
                await out.tokens(generated, ends_with_stop_token=ended_on_stop(last),
                                 logprobs=logprobs)
        finally:  # after the first tokens left: the client never waits for the event's ack
            if fresh:
                await core.kv.seal([(h, core.kv.store.slot_bytes) for h in fresh])
        queued = core.queued(submitted, step)
        phases = {"load": t_load - t0, "prefill": t_done - t_load}
        if last is not step:  # runs of their own for the next tokens
            phases["first_text"] = time.perf_counter() - t_done
        core.record(self.role, phases, queued=queued, written=len(fresh),
                    loaded=step.loaded_blocks)
        await out.report(wire.PrefillReport, node=core.node_id,
                         tokens=self._sources(step, remote, disk, len(tokens)),
                         load_error=load_error, load_ms=(t_load - t0) * 1e3,
                         prefill_ms=(t_done - t_load) * 1e3, queue_ms=queued * 1e3)
        stopped = ended_on_stop(last) and not several
        cancelled = req.request_id in core.cancelled  # e.g. a stop string in the token
        if stopped or (len(generated) >= req.sampling.max_tokens and not several) or cancelled:
            await out.final(finish_reason=("abort" if cancelled and (several or
                                                                  not last.finished)
                                           else last.finish_reason or "length"),
                            stop_reason=last.stop_token if stopped else None,
                            usage=wire.Usage(prompt_tokens=len(tokens),
                                             completion_tokens=len(generated),
                                             cached_tokens=step.cached_tokens))
            return
        await self._handoff(req, hashes, generated, out)

    async def _first_text(self, req: wire.PrefillRequest, tokens: np.ndarray,
                          step: EngineStep
                          ) -> tuple[list[int], list[wire.TokenLogprob], EngineStep]:
        """While the tokens so far end inside a character, sample the next one on this
        engine (its GPU cache holds the prompt): the client's first text does not wait
        for the hand-off (:func:`~services.worker.requests.wants_text`). An engine that
        ends a run at whole text did so in ``step``'s run; another samples each next
        token in a run of its own. The tokens go out together once their text is whole:
        a token with no text sent alone would only cost the relay's hops beside this
        engine's next step. The tokens from ``step``'s on, their log probabilities, and
        the last run's step."""
        core = self.core
        generated = list(step.token_ids)
        detok = core.parts.model.detokenizer()
        detok.push(generated)
        limit = core.settings.worker.first_text_tokens
        last, logprobs = step, list(step.logprobs)
        while (wants_text(detok.incomplete, len(generated), ended_on_stop(last), limit,
                          req.sampling) and req.request_id not in core.cancelled):
            prompt, sampling, forced = next_token(req.sampling, tokens, generated)
            last = await self._first_token(EngineRequest(
                request_id=req.request_id, tokens=prompt, sampling=sampling,
                forced_output=forced, cache_salt=core.salt(req.namespace)))
            token = last.token_ids[0]
            generated.append(token)
            logprobs += last.logprobs[:1]
            detok.push([token])
        return generated, logprobs, last

    def _sources(self, step: EngineStep, remote: int, disk: int, prompt_tokens: int
                 ) -> wire.PromptTokens:
        """Where the prompt's KV came from: the engine's own cache, blocks loaded from
        the arena (pulled from peers first, for ``remote`` of them, and read back from
        this node's disk tier, for ``disk``) and computed."""
        bs = self.core.block_size
        # Pulled or read blocks the engine already held in its own cache were not
        # loaded: their shares are at most what was loaded (never a negative DRAM count).
        remote = min(remote, step.loaded_blocks)
        disk = min(disk, step.loaded_blocks - remote)
        return wire.PromptTokens(gpu=step.gpu_blocks * bs,
                                 dram=(step.loaded_blocks - remote - disk) * bs,
                                 disk=disk * bs, remote=remote * bs,
                                 computed=prompt_tokens - step.cached_tokens)

    async def _gather_prefix(self, req: wire.PrefillRequest, hashes: list[bytes]
                             ) -> tuple[list[BlockEntry], tuple[int, int],
                                        wire.LoadError | None]:
        """The sealed local blocks the engine will load, in chain order from block 0,
        after pulling the planned remote runs; how many of them came from peers and
        from this node's disk tier; and, when a planned pull failed, which and why (the
        rest is recomputed, and the final's route says so)."""
        loader = self.core.loader
        node = self.core.node_id
        remote = disk = 0
        failure: wire.LoadError | None = None
        if any(src.node != node and src.num_blocks for src in req.sources):
            loader.planned("prefix")
        for src in sorted(req.sources, key=lambda x: x.first_block):
            want = hashes[src.first_block:src.first_block + src.num_blocks]
            if src.node == node:  # own blocks, read back first if on the disk tier
                disk += await self.core.kv.promote(want, req.namespace)
            if src.node == node or not want:
                continue
            got, failure = await loader.pull(
                "prefix", src.node, want, namespace=req.namespace, capability=src.capability,
                request_id=req.request_id)
            remote += got
            if failure is not None:  # recompute from here
                break
        have = loader.sealed_prefix(hashes)
        return have, (min(remote, len(have)), min(disk, len(have))), failure

    async def _run(self, req: wire.PrefillRequest, tokens: np.ndarray, hashes: list[bytes],
                   have: list[BlockEntry]) -> tuple[EngineStep, list[bytes]]:
        """One engine run for the first token: the loaded prefix pinned, the new full
        blocks written through to fresh slots (failed on error; the caller seals them,
        returned, once the first token is out)."""
        core = self.core
        kv, store = core.kv, core.kv.store
        # Pinned before new slots are allocated: allocation may evict, never these.
        async with core.pinned("load", req.request_id, have):
            new_refs = [wire.BlockRef(h, hashes[i - 1] if i else b"", core.block_size)
                        for i, h in enumerate(hashes) if h not in store]
            entries = await kv.allocate(req.namespace, new_refs) if new_refs else []
            slot_of = {e.hash: e.slot for e in entries if e is not None}
            fresh = list(slot_of)
            if fresh:
                await kv.begin_write(fresh)
            core.loader.audit_load(req.namespace, have)
            # Sampling on while the text is incomplete, in this run where the engine can
            # end it at whole text: a next token then costs a step, not a new run.
            whole = (core.engine.stops_at_whole_text and core.parts.model.has_tokenizer
                     and req.sampling.n == 1)
            s = req.sampling.choice(0)
            try:
                step = await self._first_token(EngineRequest(
                    request_id=req.request_id, tokens=tokens,
                    sampling=(first_text(s, core.settings.worker.first_text_tokens)
                              if whole else first_token(s)),
                    load_slots=[e.slot for e in have],
                    load_checksums=[e.checksum for e in have],
                    save_slots=[slot_of.get(h, -1) for h in hashes],
                    cache_salt=core.salt(req.namespace), until_whole_text=whole))
            except BaseException:
                if fresh:
                    await kv.fail(fresh, "prefill failed")
                raise
        if step.failed_blocks:
            await core.drop_corrupt([e.hash for e in have])
        return step, fresh

    async def _first_token(self, ereq: EngineRequest) -> EngineStep:
        """The engine's last step for ``ereq``, with every token the run produced (its
        first, or its first up to whole text) and their log probabilities."""
        step = EngineStep()
        ids: list[int] = []
        logprobs: list[wire.TokenLogprob] = []
        with self.core.load.running():
            async for part in self.core.engine.generate(ereq):
                ids += part.token_ids
                logprobs += part.logprobs
                step = part if part.finished else step
        step.token_ids, step.logprobs = ids, logprobs
        if not step.token_ids:
            self.core.check_not_cancelled(ereq.request_id)  # aborted: typed, not a bug
            raise CpdError("engine produced no token", code=ErrorCode.INTERNAL)
        return step

    async def _handoff(self, req: wire.PrefillRequest, hashes: list[bytes],
                       generated: list[int], out: ReplyStream) -> None:
        """Pin the request's blocks and give it to its decode node, which owns the rest
        of the stream once it accepts (after the ``generated`` tokens, or every choice
        from the prompt when there are none)."""
        core = self.core
        with contextlib.suppress(TimeoutError, CpdError):
            async with asyncio.timeout(_SEALED_WAIT_S):
                await core.kv.flush()
        held = [e.hash for e in core.loader.sealed_prefix(hashes)]
        lease = core.pin_for_handoff(req.request_id, held)
        dreq = wire.DecodeRequest(
            request_id=req.request_id, reply_to=req.reply_to, tokens=req.tokens,
            first_token=generated[0] if generated else None, next_tokens=generated[1:],
            sampling=req.sampling, namespace=req.namespace,
            block_hashes=b"".join(held), source_node=core.node_id, lease_id=lease,
            deadline_unix_ms=req.deadline_unix_ms, seq_start=out.seq, trace=req.trace,
            budget_ms=deadlines.budget_ms(req.deadline_unix_ms, deadlines.now_ms()),
            capability=core.keyring.issue(req.namespace))
        try:
            await core.bus.request(subjects.run("decode", req.decode_node), dreq,
                                   expect=wire.Accepted,
                                   timeout=core.settings.worker.handoff_timeout_s)
        except CpdError as e:
            core.kv.unpin(lease)
            raise DecodeUnavailable(f"decode node {req.decode_node} did not take the "
                                    f"request: {e.message}", node=req.decode_node) from e
        out.hand_over()  # decode owns the rest of the stream

    async def _on_pull_ack(self, msg: Msg) -> None:
        assert self._service is not None
        ack = self._service.decode_or_reject(msg, wire.PullAck)
        if ack is not None:
            self.core.kv.unpin(ack.lease_id)
