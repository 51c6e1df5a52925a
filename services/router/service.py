"""The router process (docs/architecture.md, "Services", "Routing", "Failure handling"): the
client-facing ``cpd.v1.generate`` API.

Per request: validate and tokenize, wait for an admission slot (or refuse with a typed,
retryable ``overloaded``), hash the prompt's blocks (a memo reuses the hashes of a
prefix hashed for an earlier prompt, such as a chat's previous turn), ask kvindex how much
of it is cached (a slow, failing or recovering kvindex is a miss), let the pure policy
pick the prefill and decode nodes, dispatch, and relay the workers' stream to the client.

The router stays on the stream for its whole life because it owns the guarantees a
client relies on: every request ends in a final message or a typed error before its
deadline; a node that stops heart-beating mid-request is routed around (the request
is re-run elsewhere while nothing, or only reproducible greedy output, reached the
client); admission slots are held exactly as long as requests run.

Apart from this module: ``relay`` (a stream across tries, its owner), ``choices`` and
``stops`` (each choice's text, its stop strings), ``outcome`` (the final message, from
the workers' reports), ``accounting``, ``policy``, ``plans``, ``hits`` and
``breaker`` (the pure decision), ``configured`` (the policy from the settings), ``nodes``,
``admission``, ``tenancy`` (whose tenant a request runs under), ``waiters`` (single-flight
wake-ups), ``discovery`` (the workers heard before requests are taken), ``prompts``
(a request's token ids, checked), ``cost`` and ``queueing`` (the cost model).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from dataclasses import replace

import msgspec
import numpy as np
from nats.aio.msg import Msg

from cpd.bus import BAD_INPUT, KeepAlives, ReplyStream, Request, Service, StreamReader, run_service
from cpd.bus.local import LocalHub
from cpd.engines.profile import engine_profile
from cpd.engines.servedmodel import ServedModel
from cpd.ops import telemetry
from cpd.ops.config import Settings
from cpd.protocol import deadlines, subjects, wire
from cpd.protocol.errors import CpdError, DeadlineExceeded, InvalidRequest
from cpd.protocol.hashing import BlockHasher, Namespace
from cpd.protocol.resume import resumed_tokens
from services.router import discovery
from services.router.accounting import REFUSALS, RouterAccounts
from services.router.admission import Admission
from services.router.cancels import Cancels, cancel_nodes
from services.router.configured import make_policy
from services.router.hits import Hits
from services.router.kvhealth import KvIndexHealth
from services.router.nodes import NodeTable
from services.router.outcome import RouterTimes, RoutingCost, assemble
from services.router.policy import Decision, NoCapacity, Wait
from services.router.prompts import prompt_tokens
from services.router.relay import (
    AttemptFailed,
    Relay,
    fresh_engine_id,
    resumed_complete,
)
from services.router.tenancy import tenant_for
from services.router.waiters import PrefixWaiters

# A single-flight waiter is woken by kvindex's visibility events; it also looks itself
# this often, in case an event was lost (core NATS delivers at most once).
_SINGLE_FLIGHT_LOOK_S = 1.0


class RouterService(Service):
    """One router replica; replicas share the ``router`` queue group."""

    name = "router"

    def __init__(self, settings: Settings, *, nats_url: str | None = None,
                 model: ServedModel | None = None, hub: LocalHub | None = None) -> None:
        super().__init__(settings, nats_url=nats_url, hub=hub)
        self.cfg = settings.router
        self.admission = Admission(settings.admission.max_inflight,
                                   settings.admission.max_queue)
        self.nodes = NodeTable()
        self.waiters = PrefixWaiters()
        self.accounts = RouterAccounts(self.node_id, self.cfg.policy,
                                       settings.admission.max_inflight)
        self.kvindex = KvIndexHealth(self.cfg.kvindex_down_after_misses,
                                     self.cfg.kvindex_max_lag_events)
        self._model = model
        self.keepalives = KeepAlives(
            self.cfg.keepalive_interval_s, sent=self.accounts.keepalive, log=self.log,
            reader_check_s=self.cfg.reader_check_interval_s,
            reader_misses=self.cfg.reader_check_misses,
            reader_gone=lambda out: self.cancels.reader_gone(out.request_id, out.reply_to))
        # A multi-turn prompt's previous turn is hashed once (per replica, exact).
        self.hash_memo = BlockHasher(self.cfg.hash_memo_bytes)
        self.cancels = Cancels()  # requests their clients may cancel

    @property
    def stats(self) -> wire.RouterStats:
        """This replica's counts (``cpd status``)."""
        return self.accounts.stats

    # ------------------------------------------------------------------ lifecycle

    async def setup(self) -> None:
        profile = engine_profile(self.settings)
        self.model = self._model or await asyncio.to_thread(profile.served_model)
        self.block_size = self.settings.cache.block_size
        self.nodes.namespace = self.model.namespace.id
        self.policy = make_policy(self.settings, profile)
        nc = self.bus.nc
        await nc.subscribe(subjects.HEARTBEAT_ALL, cb=self._on_heartbeat)
        await nc.subscribe(subjects.LOAD_ALL, cb=self._on_load)
        await nc.subscribe(subjects.KV_VISIBLE, cb=self._on_visible)
        await nc.subscribe(subjects.KV_INVALIDATE, cb=self._on_invalidated)
        for subject in (subjects.GENERATE_CANCEL, subjects.GENERATE_SUPERSEDE):
            await nc.subscribe(subject, cb=self._on_cancel)
        await discovery.await_workers(self.nodes, self.settings.node.heartbeat_interval_s)
        await self.add_endpoint("generate", subjects.GENERATE, self._on_generate,
                                expect=wire.GenerateRequest, queue=subjects.QUEUE_ROUTER)
        await self.add_endpoint("status", subjects.ROUTER_STATUS, self._on_status,
                                expect=wire.StatusRequest, queue=subjects.QUEUE_ROUTER)
        self.spawn(discovery.forget_dead(self.nodes, self.settings.node.lease_ttl_s,
                                         lambda: self.stopping), "node-gc")
        self.spawn(self.keepalives.run(lambda: self.stopping), "keepalives")
        self.log.info("router.ready", policy=self.cfg.policy, model=self.model.name,
                      namespace=self.model.namespace.id)

    # --------------------------------------------------------------- node table

    async def _on_heartbeat(self, msg: Msg) -> None:
        hb = self.decode_from_sender(msg, wire.Heartbeat)
        if hb is not None:
            self.nodes.heartbeat(hb, time.monotonic())

    async def _on_load(self, msg: Msg) -> None:
        report = self.decode_from_sender(msg, wire.LoadReport)
        if report is not None:
            self.nodes.load_report(report, time.monotonic())

    async def _on_visible(self, msg: Msg) -> None:
        ev = self.decode_or_reject(msg, wire.BlocksVisible)
        if ev is not None and len(self.waiters):
            self.waiters.visible(ev)

    async def _on_invalidated(self, msg: Msg) -> None:
        ev = self.decode_or_reject(msg, wire.BlocksInvalidated)
        if ev is not None and len(self.waiters):
            self.waiters.invalidated(ev)

    async def _on_cancel(self, msg: Msg) -> None:
        req = self.decode_or_reject(msg, wire.SupersedeGenerate if msg.subject ==
                                    subjects.GENERATE_SUPERSEDE else wire.CancelGenerate)
        if req is not None and (n := self.cancels.cancel(req)):
            self.log.info("router.request_cancelled", request_id=req.request_id, streams=n)

    async def _on_status(self, _: wire.StatusRequest, __: Request) -> wire.StatusReply:
        stats = msgspec.structs.replace(self.stats, in_flight=self.admission.in_flight,
                                        queued=self.admission.queued,
                                        paths=dict(self.stats.paths))
        return wire.StatusReply(router=stats, nodes=self.nodes.status(time.monotonic(),
                                                                 self.policy.prefill),
                                kvindex=self.kvindex.state,
                                namespace=self.model.namespace.id)

    # ------------------------------------------------------------------ requests

    async def _on_generate(self, req: wire.GenerateRequest, r: Request) -> None:
        if not r.reply_to:
            raise InvalidRequest("a generate request needs a reply inbox")
        req.tenant = tenant_for(req, r.reply_to, identities=bool(self.settings.nats.inbox_prefix))
        with (self.keepalives.watching(r.stream(req.request_id)) as out,
              self.cancels.running(req, r.reply_to)):
            try:
                await self._generate(req, out)
            except asyncio.CancelledError:
                if (why := self.cancels.by_client()) is None:
                    raise
                asyncio.current_task().uncancel()  # type: ignore[union-attr]  # handled
                self.accounts.cancelled(why)
            except BaseException as e:
                self.accounts.ended_badly(e.code if isinstance(e, CpdError) else None)
                if isinstance(e, CpdError) and e.code in BAD_INPUT:  # e.g. a torn array
                    self.reject(r.subject, e)
                # The client's doing (bad input, a refusal) at info; a failure at warning.
                refused = isinstance(e, CpdError) and (e.code in BAD_INPUT or e.code in REFUSALS)
                (self.log.info if refused else self.log.warning)(
                    "router.request_failed", error=getattr(e, "code", repr(e)), detail=str(e))
                await out.error(e)
                if not isinstance(e, Exception):
                    raise

    async def _generate(self, req: wire.GenerateRequest, out: ReplyStream) -> None:
        t0 = time.monotonic()
        timeout_s = (req.timeout_ms / 1000 if req.timeout_ms
                     else self.settings.admission.default_deadline_s)
        deadline = t0 + timeout_s
        deadline_unix_ms = int((time.time() + timeout_s) * 1000)
        tokens = await prompt_tokens(self.model, req)
        resumed = resumed_tokens(req, self.model.check_vocab)
        if done := resumed_complete(req, resumed, len(tokens), self.model.eos_token_id):
            return await out.final(**done)  # only its final message was lost: no work
        req = fresh_engine_id(req)
        ns = self._namespace(req)
        # The first keep-alive as soon as the request is valid (a bad one is answered
        # with its error first, as before): it arms the client's watchdog, so a router
        # that dies at any point after this is noticed within keepalive_misses.
        await out.keepalive(int(self.cfg.keepalive_interval_s * 1000))
        async with self.admission.slot(deadline, req.priority) as waited:
            self.accounts.admitted(waited)
            try:
                async with asyncio.timeout(max(0.0, deadline - time.monotonic())):
                    await self._serve(req, tokens, ns, out, t0, waited, deadline_unix_ms,
                                      resumed)
            except TimeoutError:
                raise DeadlineExceeded(
                    f"request did not finish within its {timeout_s:.1f}s deadline") from None
            finally:
                self.accounts.released()

    async def decide(self, req: wire.GenerateRequest) -> Decision:
        """The routing decision for ``req`` without running it: validation, tokenization,
        block hashing, the kvindex lookup and the policy (what ``cpd bench router``
        measures)."""
        tokens = await prompt_tokens(self.model, req)
        ns = self._namespace(req)
        decision, _ = await self._route(req, len(tokens), ns, self._hashes(ns, tokens), set())
        return decision

    def _namespace(self, req: wire.GenerateRequest) -> Namespace:
        return self.model.namespace_for(req.tenant, req.cache_salt)

    def _hashes(self, ns: Namespace, tokens: np.ndarray) -> bytes:
        """The prompt's block hashes (``block_hashes``), through the memo."""
        memo = self.hash_memo
        reused, computed = memo.blocks_reused, memo.blocks_computed
        hashes = memo.hashes(ns, tokens)
        self.accounts.hashed(memo.blocks_reused - reused, memo.blocks_computed - computed)
        return hashes

    async def _lookup(self, ns: Namespace, hashes: bytes, request_id: str) -> Hits:
        """kvindex's answer; a timeout, an error, a recovering or lagging index is a miss."""
        if not hashes:
            return Hits()
        try:
            reply = await self.bus.request(
                subjects.KVINDEX_LOOKUP,
                wire.LookupRequest(request_id=request_id, namespace=ns.id,
                                   block_hashes=hashes),
                expect=wire.LookupReply, timeout=self.cfg.lookup_timeout_ms / 1000)
        except CpdError as e:
            if self.kvindex.missed(e.code):
                self.log.warning("router.kvindex_unavailable", error=e.code.value)
            return Hits(ok=False)
        if self.kvindex.answered(reply) is not wire.KvIndexState.OK:  # recovering, lagging
            return Hits(ok=False)
        return Hits.from_reply(reply)

    def _decide(self, n: int, hits: Hits, exclude: set[str]) -> Decision:
        nodes = self.nodes.live(time.monotonic(), frozenset(exclude))
        return self.policy.decide(n, self.block_size, hits, nodes)

    async def _route(self, req: wire.GenerateRequest, n: int, ns: Namespace,
                     hashes: bytes, exclude: set[str]) -> tuple[Decision, RoutingCost]:
        """Look up, decide, and wait for another node's prefix when single-flight says
        so; returns the decision and what it cost."""
        t = time.perf_counter()
        hits = await self._lookup(ns, hashes, req.request_id)
        lookup_ms = (time.perf_counter() - t) * 1000
        decision = self._decide(n, hits, exclude)
        wait_ms = 0.0
        if decision.wait is not None:
            t_wait = time.perf_counter()
            await self.await_prefix(decision.wait, ns, hashes, req.request_id)
            wait_ms = (time.perf_counter() - t_wait) * 1000
            hits = await self._lookup(ns, hashes, req.request_id)
            again = self._decide(n, hits, exclude)
            # Waiting once is the bargain; a prefix still pending now is not waited for.
            decision = replace(again, wait=None, waited_for=decision.wait.node)
        return decision, RoutingCost(lookup_ms, wait_ms, (time.perf_counter() - t) * 1000)

    async def await_prefix(self, wait: Wait, ns: Namespace, hashes: bytes,
                           request_id: str) -> None:
        """Single-flight: wait until kvindex says the pending node's last awaited block
        is visible, the node drops blocks, a safety look finds it done or no longer
        writing, or the wait the policy allowed is over (:mod:`services.router.waiters`)."""
        hb = wire.HASH_BYTES
        block = hashes[(wait.blocks - 1) * hb:wait.blocks * hb]
        end = time.monotonic() + wait.max_wait_ms / 1000
        woken = self.waiters.add(ns.id, wait.node, block)
        try:
            while (left := end - time.monotonic()) > 0:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(woken.wait(), min(left, _SINGLE_FLIGHT_LOOK_S))
                if woken.is_set():
                    return
                hits = await self._lookup(ns, hashes, request_id)
                if (not hits.ok or hits.dram.get(wait.node, 0) >= wait.blocks
                        or wait.node not in hits.pending):
                    return
        finally:
            self.waiters.discard(ns.id, wait.node, block, woken)

    async def _serve(self, req: wire.GenerateRequest, tokens: np.ndarray, ns: Namespace,
                     out: ReplyStream, t0: float, waited: float,
                     deadline_unix_ms: int, resumed: list[int]) -> None:
        t = time.perf_counter()
        hashes = self._hashes(ns, tokens)
        hash_ms = (time.perf_counter() - t) * 1000
        packed = wire.pack_tokens(tokens)
        relay = Relay(out, functools.partial(
            self.model.detokenizer, skip_special_tokens=req.sampling.skip_special_tokens),
            req.sampling)
        if resumed:
            relay.resume(resumed, req.resume_text_chars)
            self.accounts.resumed()
        deterministic = req.sampling.temperature == 0 or req.sampling.seed is not None
        exclude: set[str] = set()
        failovers = 0
        failed: CpdError | None = None  # the last try's error, once one failed
        for attempt in range(1, self.cfg.max_attempts + 1):
            try:
                decision, cost = await self._route(req, len(tokens), ns, hashes, exclude)
            except NoCapacity:
                if failed is None:
                    raise
                # Every node that could take it has failed this request already: say why
                # the last one did (e.g. overloaded), not that none is up.
                raise failed from None
            self.accounts.decided((hash_ms + cost.total_ms - cost.wait_ms) / 1000,
                                  decision.plan.role, decision.plan.queue_ms,
                                  first_try=attempt == 1,
                                  lookup_missed=decision.lookup_missed,
                                  decode_lent=decision.decode_lent)
            try:
                final = await self._attempt(req, attempt, decision, packed, ns, hashes,
                                            deadline_unix_ms, relay)
            except AttemptFailed as f:
                retry = (attempt < self.cfg.max_attempts and f.error.retryable
                         and (relay.sent == 0 or deterministic))
                self.log.warning("router.attempt_failed", attempt=attempt,
                                 nodes=sorted(f.nodes), error=f.error.code.value,
                                 detail=f.error.message, retry=retry)
                if not retry:
                    raise f.error from None
                exclude |= f.nodes
                failed = f.error
                failovers += 1
                self.accounts.failover()
                continue
            now = time.monotonic()
            times = RouterTimes(
                admission_ms=waited * 1000, decision_ms=hash_ms + cost.total_ms,
                lookup_ms=cost.lookup_ms, total_ms=(now - t0) * 1000,
                ttft_ms=(relay.first_at - t0) * 1000 if relay.first_at else 0.0)
            final = assemble(decision.route(), relay.reports, final,
                             prompt_tokens=len(tokens), completion_tokens=relay.sent,
                             times=times, failovers=failovers, choices=relay.ends(final))
            self.accounts.finished(final, decision.path, self.log, first_at=relay.first_at,
                                   sent=relay.sent, now=now)
            self.policy.observe(final.route)
            await relay.final(final)
            return

    async def _attempt(self, req: wire.GenerateRequest, attempt: int, decision: Decision,
                       packed: bytes, ns: Namespace, hashes: bytes, deadline_unix_ms: int,
                       relay: Relay) -> wire.Final:
        """Dispatch once and relay the stream until its final message."""
        plan = decision.plan
        # Workers keep their streams alive once a message went out: silence after that
        # (a final lost in a NATS restart) fails the try in keepalive_misses intervals.
        reader = StreamReader(self.bus, idle_timeout=self.settings.bus.stream_idle_timeout_s,
                              keepalive_misses=self.cfg.keepalive_misses)
        inbox = await reader.open()
        # Engines key requests by id: a retry must not collide with a leftover try.
        rid = req.request_id if attempt == 1 else f"{req.request_id}~{attempt}"
        try:
            preq = wire.PrefillRequest(
                request_id=rid, reply_to=inbox, tokens=packed, sampling=req.sampling,
                namespace=ns.id, block_hashes=hashes, decode_node=decision.decode_node,
                deadline_unix_ms=deadline_unix_ms, sources=list(plan.sources),
                budget_ms=deadlines.budget_ms(deadline_unix_ms, deadlines.now_ms()),
                planned_new_tokens=plan.computed_tokens,
                trace=telemetry.current_traceparent())
            try:
                await self.bus.request(subjects.run(plan.role, plan.node), preq,
                                       expect=wire.Accepted,
                                       timeout=self.cfg.dispatch_timeout_s)
            except CpdError as e:
                raise AttemptFailed(e, {plan.node}) from None
            self.nodes.dispatched(plan.node, plan.load_ms + plan.compute_ms)
            relay.restart(plan.node, decision.decode_node)
            return await relay.follow(reader, self.nodes,
                                      check_s=self.cfg.liveness_check_interval_s,
                                      idle_s=self.settings.bus.stream_idle_timeout_s,
                                      cancel=lambda nodes, choice: self._cancel(
                                          rid, nodes, wire.CancelReason.STOP_STRING, choice))
        except asyncio.CancelledError:  # the client left (counted above), or the router stops
            await self._cancel(rid, [plan.node, decision.decode_node], None
                               if self.cancels.by_client() else
                               wire.CancelReason.ROUTER_STOPPING)
            raise
        finally:
            await reader.close()

    async def _cancel(self, request_id: str, nodes: list[str],
                      reason: wire.CancelReason | None, choice: int | None = None) -> None:
        """Cancel a try on its ``nodes``: the request (counted by ``reason``, unless it
        was counted where it came from), or one of its choices."""
        if choice is None and reason is not None:
            self.accounts.cancelled(reason)
        await cancel_nodes(self.bus, request_id, nodes, choice)


def serve(settings: Settings) -> None:
    """Run one router process until SIGTERM/SIGINT (``python -m services.router``,
    ``cpd serve router``)."""
    telemetry.setup("router", settings.telemetry)
    run_service(RouterService(settings))
