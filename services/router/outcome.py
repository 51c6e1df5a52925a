"""The client's final message of a request, assembled once, by the router, from what each
process owns: the router's decision and its own clock, the prefill node's report, the
decode node's report and the worker's final message (how the generation ended).

Pure: no I/O, no clock (the router measures; this only puts the parts together).
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec

from cpd.protocol import wire


@dataclass(frozen=True)
class RoutingCost:
    """What one routing decision cost (ms): the kvindex round trip, any single-flight
    wait, and the whole of it (a second lookup and the policy included)."""

    lookup_ms: float
    wait_ms: float
    total_ms: float


@dataclass(frozen=True)
class RouterTimes:
    """What the router measured of a request (ms)."""

    admission_ms: float = 0.0
    decision_ms: float = 0.0  # hashing, lookup and policy, single-flight wait included
    lookup_ms: float = 0.0
    ttft_ms: float = 0.0
    total_ms: float = 0.0


@dataclass(frozen=True)
class Reports:
    """The workers' reports of the try that succeeded (``None``: not received)."""

    prefill: wire.PrefillReport | None = None
    decode: wire.DecodeReport | None = None


def assemble(planned: wire.Route, reports: Reports, worker_final: wire.Final, *,
             prompt_tokens: int, completion_tokens: int, times: RouterTimes,
             failovers: int, choices: list[wire.ChoiceEnd] | None = None) -> wire.Final:
    """The client's final message: the planned route with what the workers report they
    did, the usage the client was served, the timings of every phase and, for a request
    of several, how each choice ended (choice 0's end is the message's own)."""
    route = msgspec.structs.replace(planned, failovers=failovers)
    timings = wire.Timings(admission_ms=times.admission_ms, decision_ms=times.decision_ms,
                           lookup_ms=times.lookup_ms, ttft_ms=times.ttft_ms,
                           total_ms=times.total_ms)
    p, d = reports.prefill, reports.decode
    if p is not None:
        route.prefill_node = p.node
        route.tokens = p.tokens
        route.load_error = p.load_error
        timings.load_ms, timings.prefill_ms = p.load_ms, p.prefill_ms
        timings.prefill_queue_ms = p.queue_ms
    if d is not None:
        route.decode_node = d.node
        route.decode_tokens_pulled = d.tokens_pulled
        route.decode_tokens_computed = d.tokens_computed
        timings.handoff_ms, timings.decode_ms = d.handoff_ms, d.decode_ms
        timings.decode_queue_ms = d.queue_ms
    else:
        route.decode_node = ""  # the prefill node finished the request itself
    cached = route.tokens.reused if p is not None else worker_final.usage.cached_tokens
    first = choices[0] if choices else worker_final
    return wire.Final(request_id=worker_final.request_id, seq=worker_final.seq,
                      finish_reason=first.finish_reason, stop_reason=first.stop_reason,
                      choices=list(choices or []),
                      usage=wire.Usage(prompt_tokens=prompt_tokens,
                                       completion_tokens=completion_tokens,
                                       cached_tokens=cached),
                      timings=timings, route=route)
