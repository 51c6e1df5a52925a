"""Open-loop load driver for the paper's experiment (seed article §6, docs/sim.md).

Requests of a workload (:mod:`cpd.sim.workloads`) are released at their arrival times,
whatever the system does (open loop), through the async client with at most
``max_inflight`` (24, as in the paper) on the wire; the rest wait in the client's FIFO,
and that wait counts in TTFT because TTFT is taken from the scheduled arrival. Workload
times are simulated seconds: arrivals are played at ``arrival / time_scale`` of wall
time and every recorded time is converted back, so results read in simulated seconds.

One :class:`Result` per request: TTFT, TPOT and end-to-end times, the route the router
took and the prompt tokens by tier, and the error, if any (``rejected`` when admission
control shed it: shedding never counts as throughput). :func:`report` turns a run into
the figures of one sweep point (``cpd.sim.analysis.summarize`` plus paths, tiers and
per-GPU throughputs) with goodput under the TTFT SLO.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import sys
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field

import msgspec

from cpd.client import Client
from cpd.protocol import wire
from cpd.protocol.errors import CpdError, ErrorCode
from cpd.sim.analysis import RequestRecord, RunSummary, summarize
from cpd.sim.workloads import DEFAULT_VOCAB, WorkloadRequest

# The paper caps in-flight requests at 24 (seed article §6).
DEFAULT_MAX_INFLIGHT = 24
# Deadline of one request in wall seconds (the router enforces it and answers typed).
DEFAULT_REQUEST_TIMEOUT_S = 120.0
# After the last arrival, how long (wall) the driver waits for stragglers.
DEFAULT_DRAIN_TIMEOUT_S = 60.0
UNFINISHED = "unfinished"
# Content ids are remapped per run (:func:`fresh_content`) in this bit range: below the
# id-space bits of the generators (40+) and above any generator's own counter.
_RUN_SHIFT = 32
_RUN_BITS = 8


@dataclass(frozen=True)
class Phases:
    """Ramp, settle, then the measured steady phase (simulated seconds).

    The settle phase runs at the target rate but is not measured: a session workload
    reaches its steady population only by starting that population's sessions, and
    their cold first turns, during the ramp; the cluster works off that backlog here
    (docs/sim.md "Steady arrivals")."""

    ramp_s: float
    steady_s: float
    settle_s: float = 0.0

    @property
    def window(self) -> tuple[float, float]:
        start = self.ramp_s + self.settle_s
        return start, start + self.steady_s

    @property
    def duration_s(self) -> float:
        return self.ramp_s + self.settle_s + self.steady_s


@dataclass
class Result:
    """What the client saw of one request (simulated seconds from the run's start)."""

    request_id: str
    arrival_s: float
    prompt_tokens: int
    sent_s: float | None = None          # left the client queue
    first_token_s: float | None = None
    finish_s: float | None = None
    output_tokens: int = 0
    cached_tokens: int = 0
    path: str = ""
    prefill_node: str = ""
    decode_node: str = ""
    tokens: wire.PromptTokens = field(default_factory=wire.PromptTokens)
    error: str | None = None
    rejected: bool = False               # shed by admission control (overloaded)
    turn: int = 0                        # the session's turn (0: its cold first request)
    # The router's and workers' timings of the final message (wall ms, not simulated).
    timings: dict[str, float] | None = None

    @property
    def client_queue_s(self) -> float | None:
        return None if self.sent_s is None else self.sent_s - self.arrival_s

    def record(self) -> RequestRecord:
        """The analysis record (TTFT from the scheduled arrival)."""
        return RequestRecord(request_id=self.request_id, arrival_s=self.arrival_s,
                             first_token_s=self.first_token_s, finish_s=self.finish_s,
                             output_tokens=self.output_tokens,
                             prompt_tokens=self.prompt_tokens,
                             cached_tokens=self.cached_tokens, error=self.error)


def fresh_content(requests: Iterable[WorkloadRequest], run: int) -> list[WorkloadRequest]:
    """The same workload with content no earlier run has used: run ``run``'s block ids are
    moved to their own id range, so caches warmed by another run never hit (each sweep
    point starts cold, as on a fresh cluster)."""
    if not 0 <= run < (1 << _RUN_BITS):
        raise ValueError(f"run must be in [0, {1 << _RUN_BITS})")
    offset = run << _RUN_SHIFT
    out = []
    for r in requests:
        if any(b & (((1 << _RUN_BITS) - 1) << _RUN_SHIFT) for b in r.block_ids):
            raise ValueError(f"{r.request_id}: content ids already use the run bits")
        out.append(msgspec.structs.replace(r, block_ids=tuple(b | offset for b in r.block_ids)))
    return out


class _Progress:
    """A progress bar on stderr (tqdm when installed, else one rewritten line)."""

    def __init__(self, total: int, label: str, enabled: bool) -> None:
        self.total, self.label, self.enabled = total, label, enabled
        self.done = self.errors = 0
        self._bar = None
        if enabled:
            with contextlib.suppress(ImportError):
                from tqdm import tqdm

                self._bar = tqdm(total=total, desc=label, unit="req", leave=False,
                                 file=sys.stderr, dynamic_ncols=True)

    def update(self, failed: bool, in_flight: int) -> None:
        self.done += 1
        self.errors += failed
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.set_postfix(in_flight=in_flight, errors=self.errors, refresh=False)
            self._bar.update(1)
        elif self.done % 10 == 0 or self.done == self.total:
            print(f"\r{self.label}: {self.done}/{self.total} done, {in_flight} in flight, "
                  f"{self.errors} errors", end="", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        elif self.enabled:
            print(file=sys.stderr)


async def drive(client: Client, requests: Sequence[WorkloadRequest], *,
                time_scale: float = 1.0, max_inflight: int = DEFAULT_MAX_INFLIGHT,
                vocab: int = DEFAULT_VOCAB,
                request_timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S,
                drain_timeout_s: float = DEFAULT_DRAIN_TIMEOUT_S, progress: bool = True,
                label: str = "load") -> list[Result]:
    """Play ``requests`` open loop and return one :class:`Result` per request, in
    arrival order. Requests still running ``drain_timeout_s`` after the last arrival are
    cancelled and recorded as ``unfinished``."""
    if time_scale <= 0 or max_inflight < 1:
        raise ValueError("time_scale must be > 0 and max_inflight >= 1")
    loop = asyncio.get_running_loop()
    slots = asyncio.Semaphore(max_inflight)
    results = [Result(r.request_id, r.arrival_s, r.prompt_len, turn=r.turn) for r in requests]
    bar = _Progress(len(requests), label, progress)
    in_flight = 0
    t0 = loop.time()

    def now_s() -> float:
        return (loop.time() - t0) * time_scale

    async def one(req: WorkloadRequest, res: Result) -> None:
        nonlocal in_flight
        try:
            async with slots:
                res.sent_s = now_s()
                in_flight += 1
                try:
                    await _run_one(client, req, res, now_s, vocab, request_timeout_s)
                finally:
                    in_flight -= 1
        except CpdError as e:
            res.error = e.code.value
            res.rejected = e.code is ErrorCode.OVERLOADED
        except asyncio.CancelledError:
            res.error = UNFINISHED
            raise
        finally:
            bar.update(res.error is not None, in_flight)

    tasks: list[asyncio.Task[None]] = []
    try:
        for req, res in zip(requests, results, strict=True):
            delay = t0 + req.arrival_s / time_scale - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(req, res), name=f"drive-{req.request_id}"))
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=drain_timeout_s)
            for t in pending:
                t.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
    finally:
        for t in tasks:
            t.cancel()
        bar.close()
    return results


async def _run_one(client: Client, req: WorkloadRequest, res: Result,
                   clock: Callable[[], float], vocab: int, timeout_s: float) -> None:
    # Built when it leaves the queue: a 200K-token prompt is 800 KB.
    wreq = client.request([0], max_tokens=req.output_len, ignore_eos=True,
                          timeout_s=timeout_s, request_id=req.request_id)
    wreq.tokens = wire.pack_tokens(req.token_ids(vocab))
    # Closed here, not by the garbage collector: the stream holds a NATS inbox.
    async with contextlib.aclosing(client.stream_request(wreq)) as stream:
        async for msg in stream:
            if isinstance(msg, wire.TokenChunk):
                if msg.token_ids:
                    if res.first_token_s is None:
                        res.first_token_s = clock()
                    res.output_tokens += len(msg.token_ids)
                continue
            r = msg.route
            res.finish_s = clock()
            res.cached_tokens = msg.usage.cached_tokens
            res.path, res.prefill_node, res.decode_node = r.path, r.prefill_node, r.decode_node
            res.tokens = r.tokens
            res.timings = msgspec.structs.asdict(msg.timings)
            return
    res.error = UNFINISHED


def report(results: Sequence[Result], *, target_qps: float, gpus: int, ttft_slo_s: float,
           phases: Phases) -> dict:
    """One sweep point at the workload's ``target_qps``:
    :func:`~cpd.sim.analysis.summarize` over the steady window plus
    request counts, rejections, paths, prompt tokens by tier, client queueing and
    per-GPU prefill (computed prompt tokens) and decode (output tokens) throughput."""
    start, end = phases.window
    span = end - start
    arrived = [r for r in results if start <= r.arrival_s < end]
    # Offered is what arrived in the window: an open-loop workload whose sessions build
    # up (coding agent) arrives below its target early on, and the system can only be
    # asked to keep up with what it was sent. The target stays the x axis.
    summary: RunSummary = summarize([r.record() for r in results],
                                    offered_qps=len(arrived) / span, gpus=gpus,
                                    ttft_slo_s=ttft_slo_s, window=(start, end))
    done = [r for r in results if r.error is None and r.finish_s is not None
            and start <= r.finish_s < end]
    first = [r for r in results if r.error is None and r.first_token_s is not None
             and start <= r.first_token_s < end]
    tiers = {s.value: sum(r.tokens.by_source()[s] for r in arrived if r.error is None)
             for s in wire.TokenSource}
    queued = [q for r in arrived if (q := r.client_queue_s) is not None]
    out = {k: _finite(v) for k, v in asdict(summary).items()}
    out.update({
        "target_qps": target_qps,
        "target_qps_per_gpu": round(target_qps / gpus, 4),
        "offered_qps_per_gpu": round(summary.offered_qps_per_gpu, 4),
        "achieved_qps_per_gpu": round(summary.achieved_qps_per_gpu, 4),
        "goodput_qps_per_gpu": round(summary.goodput_qps_per_gpu, 4),
        "sustainable": summary.sustainable(),
        "rejected": sum(r.rejected for r in arrived),
        "unfinished": sum(r.error == UNFINISHED for r in arrived),
        "errors_by_code": dict(Counter(r.error for r in arrived if r.error)),
        "paths": dict(Counter(r.path for r in arrived if r.error is None)),
        "prompt_tokens_by_tier": tiers,
        "client_queue_p90_s": _finite(_quantile(queued, 0.9)),
        "prefill_tokens_per_s_per_gpu": round(
            sum(r.tokens.computed for r in first) / span / gpus, 1),
        "decode_tokens_per_s_per_gpu": round(
            sum(r.output_tokens for r in done) / span / gpus, 1),
        "by_path": _by_path(arrived),
        "remote_load": _remote_load(arrived),
    })
    return out


def _remote_load(arrived: Sequence[Result]) -> dict:
    """What the data plane delivered: prompt tokens pulled from peers and the load time
    of the requests that pulled them (wall s, from their timings), so that a planner can
    run at the transfer rate this host's data plane achieved (``cpd bench plan
    --fidelity``)."""
    pulled = [r for r in arrived if r.error is None and r.tokens.remote and r.timings
              and r.timings.get("load_ms")]
    return {"tokens": sum(r.tokens.remote for r in pulled),
            "wall_s": round(sum((r.timings or {})["load_ms"] for r in pulled) / 1e3, 4)}


def _by_path(arrived: Sequence[Result]) -> dict[str, dict]:
    """Where TTFT goes, per route path and for sessions' first turns: count, TTFT p50/p90
    (simulated s, client queue included) and the mean of each stage of the final
    message's timings (wall ms; × the time scale for simulated). The p90 of a mixed
    workload is often one group's tail, and this says which."""
    groups: dict[str, list[Result]] = {}
    for r in arrived:
        if r.error is None and r.first_token_s is not None:
            groups.setdefault(r.path or "unknown", []).append(r)
            if r.turn == 0:
                groups.setdefault("first_turn", []).append(r)
    out = {}
    for name, rs in sorted(groups.items()):
        ttft = [r.first_token_s - r.arrival_s for r in rs if r.first_token_s is not None]
        timed = [r.timings for r in rs if r.timings]
        out[name] = {
            "requests": len(rs),
            "ttft_p50_s": _finite(round(_quantile(ttft, 0.5), 4)),
            "ttft_p90_s": _finite(round(_quantile(ttft, 0.9), 4)),
            "mean_prompt_tokens": round(sum(r.prompt_tokens for r in rs) / len(rs)),
            "mean_computed_tokens": round(sum(r.tokens.computed for r in rs) / len(rs)),
            "timings_mean_wall_ms": {k: round(sum(t[k] for t in timed) / len(timed), 1)
                                     for k in (timed[0] if timed else {})},
        }
    return out


def _quantile(xs: Sequence[float], q: float) -> float:
    if not xs:
        return math.nan
    s = sorted(xs)
    return s[min(len(s) - 1, math.ceil(q * len(s)) - 1)]


def _finite(v: object) -> object:
    """JSON has no ∞/NaN: they become null (a run with no first token, an empty window)."""
    if isinstance(v, float):
        return round(v, 4) if math.isfinite(v) else None
    return v
