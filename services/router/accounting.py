"""The router's account of its requests in one place: the counts ``cpd status`` shows
(``wire.RouterStats``) and the Prometheus instruments, updated together at each step of
a request (admitted, decided, failed over, completed, refused or failed)."""

from __future__ import annotations

from typing import Any

from cpd.ops import metrics, telemetry
from cpd.protocol import wire
from cpd.protocol.errors import ErrorCode

REFUSALS = (ErrorCode.OVERLOADED, ErrorCode.INVALID_REQUEST, ErrorCode.PROMPT_TOO_LONG,
            ErrorCode.UNKNOWN_NAMESPACE)
"""Errors that refuse a request (counted as rejected, not as failed)."""


class RouterAccounts:
    """The counts and instruments of one router replica running ``policy``."""

    def __init__(self, node: str, policy: str, max_inflight: int) -> None:
        self.policy = policy
        self.stats = wire.RouterStats(node=node, policy=policy, max_inflight=max_inflight)
        m = telemetry.meter()
        self._requests = metrics.counter(m, metrics.ROUTER_REQUESTS)
        self._rejected = metrics.counter(m, metrics.ROUTER_REJECTED,
                                         [{"reason": c.value} for c in REFUSALS])
        self._failovers = metrics.counter(m, metrics.ROUTER_FAILOVERS)
        self._tokens = metrics.counter(m, metrics.ROUTER_PROMPT_TOKENS,
                                       [{"tier": t} for t in metrics.PROMPT_TIERS])
        self._ttft = metrics.histogram(m, metrics.ROUTER_TTFT)
        self._tpot = metrics.histogram(m, metrics.ROUTER_TPOT)
        self._admission = metrics.histogram(m, metrics.ROUTER_ADMISSION_WAIT)
        self._decision = metrics.histogram(m, metrics.ROUTER_DECISION)
        self._lookup_misses = metrics.counter(m, metrics.ROUTER_LOOKUP_MISSES)
        self._decode_lent = metrics.counter(m, metrics.ROUTER_DECODE_LENT)
        self._resumed = metrics.counter(m, metrics.ROUTER_RESUMED)
        self._cancelled = metrics.counter(m, metrics.ROUTER_CANCELLED)
        for reason in wire.CancelReason:  # every reason's series from the start, at 0
            self._cancelled.add(0, {"reason": reason.value})
        self._queue = metrics.histogram(m, metrics.ROUTER_ESTIMATED_QUEUE)
        self._in_flight = metrics.up_down_counter(m, metrics.ROUTER_IN_FLIGHT)
        self._keepalives = metrics.counter(m, metrics.ROUTER_KEEPALIVES)
        self._hash_memo = metrics.counter(m, metrics.ROUTER_HASH_MEMO,
                                          [{"result": r} for r in ("reused", "computed")])

    def admitted(self, waited_s: float) -> None:
        """A request got its admission slot after ``waited_s``."""
        self.stats.admitted += 1
        self._in_flight.add(1)
        self._admission.record(waited_s)

    def resumed(self) -> None:
        """An admitted request resumes a stream whose router died."""
        self.stats.resumed += 1
        self._resumed.add(1)

    def released(self) -> None:
        """An admitted request let go of its slot."""
        self._in_flight.add(-1)

    def decided(self, seconds: float, plan_role: str, queue_ms: float, *,
                first_try: bool, lookup_missed: bool, decode_lent: bool = False) -> None:
        """A routing decision took ``seconds`` (hashing and lookup included), with or
        without kvindex's answer, keeping the decode on the prefill node or not; the
        first try's plan estimated ``queue_ms`` of queueing on a ``plan_role`` node."""
        self._decision.record(seconds, {"policy": self.policy})
        if lookup_missed:
            self.stats.lookup_misses += 1
            self._lookup_misses.add(1)
        if decode_lent:
            self.stats.decode_lent += 1
            self._decode_lent.add(1)
        if first_try:
            self._queue.record(queue_ms / 1000, {"role": plan_role})

    def hashed(self, reused: int, computed: int) -> None:
        """Blocks whose hashes the memo reused, and blocks chained anew."""
        if reused:
            self._hash_memo.add(reused, {"result": "reused"})
        if computed:
            self._hash_memo.add(computed, {"result": "computed"})

    def failover(self) -> None:
        """A try failed and the request runs again elsewhere."""
        self.stats.failovers += 1
        self._failovers.add(1)

    def keepalive(self) -> None:
        """A keep-alive went to a silent client stream."""
        self._keepalives.add(1)

    def ended_badly(self, code: ErrorCode | None) -> None:
        """A request ended with an error: a refusal (``REFUSALS``) or a failure."""
        if code in REFUSALS:
            self.stats.rejected += 1
            self._rejected.add(1, {"reason": code.value})  # type: ignore[union-attr]
        else:
            self.stats.failed += 1
            self._requests.add(1, {"policy": self.policy, "outcome": "error"})

    def completed(self, final: wire.Final, path: str, *, ttft_s: float | None,
                  tpot_s: float | None) -> None:
        """A request finished; its route says where its prompt tokens came from."""
        r = final.route
        s = self.stats
        s.completed += 1
        if r.load_error is not None:
            s.load_failures += 1
        s.prompt_tokens += final.usage.prompt_tokens
        s.tokens.add(r.tokens)
        s.paths[path] = s.paths.get(path, 0) + 1
        attrs = {"policy": self.policy, "path": path}
        self._requests.add(1, {**attrs, "outcome": "ok"})
        for source, count in r.tokens.by_source().items():
            self._tokens.add(count, {"tier": source.value})
        if ttft_s is not None:
            self._ttft.record(ttft_s, attrs)
        if tpot_s is not None:
            self._tpot.record(tpot_s, attrs)

    def finished(self, final: wire.Final, planned_path: str, log: Any, *, first_at: float,
                 sent: int, now: float) -> None:
        """Count and log a request's assembled ``final`` (its first token at
        ``first_at`` and ``sent`` tokens by ``now``, monotonic)."""
        r, ttft_ms = final.route, final.timings.ttft_ms
        if r.load_error is not None:
            log.warning("router.load_failed", node=r.prefill_node,
                        peer=r.load_error.peer, error=r.load_error.code)
        path = r.path or planned_path
        self.completed(final, path, ttft_s=ttft_ms / 1000 if first_at else None,
                       tpot_s=(now - first_at) / (sent - 1) if sent > 1 and first_at else None)
        log.info("router.request_done", path=path, reason=r.reason, why=r.describe(),
                 prefill=r.prefill_node, decode=r.decode_node,
                 prompt_tokens=final.usage.prompt_tokens, cached=final.usage.cached_tokens,
                 ttft_ms=round(ttft_ms, 1), failovers=r.failovers)

    def cancelled(self, reason: wire.CancelReason) -> None:
        """A request ended before its nodes finished generating it."""
        self.stats.cancelled[reason.value] = self.stats.cancelled.get(reason.value, 0) + 1
        self._cancelled.add(1, {"reason": reason.value})
