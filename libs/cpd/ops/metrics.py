"""Every metric CPD exports, in one catalogue (docs/architecture.md, "Observability").

Instruments are OpenTelemetry's; processes export them for Prometheus. One convention
holds for every name, so dashboards and alerts written against it keep working:

* one prefix, ``cpd_``, then the service (``gateway``, ``router``, ``worker``,
  ``kvindex``, ``kv`` for the data plane), then the concept;
* the instrument name carries no unit and no ``_total``: the exporter appends the unit
  once (``s`` → ``_seconds``, ``By`` → ``_bytes``) and ``_total`` to counters;
* durations are seconds, sizes bytes; histograms name their buckets here;
* where vLLM exports the same concept, the concept part is vLLM's
  (``time_to_first_token``, ``time_per_output_token``, ``e2e_request_latency``,
  ``prompt_tokens``, ``generation_tokens``, ``request_queue_time``).

``prometheus_name`` gives the exported name; the dashboards' and alerts' test checks
them against a scrape of a running system.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from opentelemetry.metrics import CallbackOptions, Meter, Observation

from cpd.protocol import wire

Kind = Literal["counter", "histogram", "updown", "gauge", "observed_counter"]

# Bucket bounds, seconds. Request latencies run from a warm hit on a short prompt to a
# cold prefill of ~100K tokens queued behind others; token gaps from a fast decode step
# to a stalled one; local steps (a routing decision, an admission wait, one transfer)
# from tens of microseconds up.
LATENCY_BUCKETS_S: tuple[float, ...] = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
                                        5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
TOKEN_GAP_BUCKETS_S: tuple[float, ...] = (0.001, 0.002, 0.005, 0.01, 0.02, 0.035, 0.05,
                                          0.075, 0.1, 0.15, 0.25, 0.5, 1.0)
STEP_BUCKETS_S: tuple[float, ...] = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01,
                                     0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0)

_UNIT_SUFFIX = {"s": "_seconds", "By": "_bytes"}

PROMPT_TIERS = tuple(s.value for s in wire.TokenSource)
"""Where a prompt token's KV came from (the ``tier`` label of the prompt-token counters):
hit ratio per tier = rate(tokens{tier=X}) ÷ rate(tokens)."""

FALLBACK_STAGES = ("prefix", "handoff")
"""Where a planned KV load happens: a prefill's pull of a prefix from a peer, decode's
pull of the blocks its prefill node hands off."""
FALLBACK_REASONS = ("peer_gone", "timeout", "checksum_mismatch", "capability_denied",
                    "block_evicted", "unavailable", "unknown_namespace")
"""The error codes a failed load reports most; each starts at 0 (others appear when
they happen)."""


@dataclass(frozen=True, slots=True)
class MetricSpec:
    """One metric: its instrument name, kind, unit (UCUM), labels and meaning."""

    name: str
    kind: Kind
    description: str
    unit: str = ""
    labels: tuple[str, ...] = ()
    buckets: tuple[float, ...] = ()

    @property
    def prometheus_name(self) -> str:
        """The name Prometheus scrapes (histograms add ``_bucket``/``_sum``/``_count``)."""
        name = self.name + _UNIT_SUFFIX.get(self.unit, "")
        return name + "_total" if self.kind in ("counter", "observed_counter") else name

    def series(self) -> tuple[str, ...]:
        """Every series name this metric exports."""
        base = self.prometheus_name
        if self.kind == "histogram":
            return (f"{base}_bucket", f"{base}_sum", f"{base}_count")
        return (base,)


def _m(name: str, kind: Kind, description: str, unit: str = "",
       labels: Sequence[str] = (), buckets: Sequence[float] = ()) -> MetricSpec:
    return MetricSpec(name, kind, description, unit, tuple(labels), tuple(buckets))


# --------------------------------------------------------------------------- gateway

GATEWAY_REQUESTS = _m(
    "cpd_gateway_requests", "counter",
    "generation requests by endpoint and HTTP status (a stream that failed after it "
    "started counts with its error's status; 499: the client went away)",
    labels=("endpoint", "status"))
GATEWAY_REJECTED = _m(
    "cpd_gateway_rejected_requests", "counter",
    "generation requests answered with an error, by CPD error code",
    labels=("endpoint", "code"))
GATEWAY_TTFT = _m(
    "cpd_gateway_time_to_first_token", "histogram",
    "request arrival to its first generated token, at the gateway", "s",
    ("endpoint",), LATENCY_BUCKETS_S)
GATEWAY_TPOT = _m(
    "cpd_gateway_time_per_output_token", "histogram",
    "mean time per generated token after the first, at the gateway", "s",
    ("endpoint",), TOKEN_GAP_BUCKETS_S)
GATEWAY_E2E = _m(
    "cpd_gateway_e2e_request_latency", "histogram",
    "request arrival to its last message, at the gateway", "s", ("endpoint",),
    LATENCY_BUCKETS_S)
GATEWAY_PROMPT_TOKENS = _m(
    "cpd_gateway_prompt_tokens", "counter",
    "prompt tokens of finished requests by the tier their KV came from (gpu, dram, "
    "remote) or computed, and by route path", "{token}", ("tier", "path"))
GATEWAY_GENERATION_TOKENS = _m(
    "cpd_gateway_generation_tokens", "counter", "generated tokens of finished requests",
    "{token}", ("endpoint",))
GATEWAY_TENANT_REJECTIONS = _m(
    "cpd_gateway_tenant_rejections", "counter",
    "requests refused by the tenant checks, by tenant and reason (unauthorized, "
    "rate_limited, request_too_large, prompt_too_long, max_tokens); tenant 'unknown' "
    "when no valid key was given", labels=("tenant", "reason"))

# ---------------------------------------------------------------------------- router

ROUTER_REQUESTS = _m(
    "cpd_router_requests", "counter", "requests by policy, path and outcome",
    labels=("policy", "path", "outcome"))
ROUTER_REJECTED = _m(
    "cpd_router_rejected", "counter", "requests refused (admission, bad input), by reason",
    labels=("reason",))
ROUTER_FAILOVERS = _m(
    "cpd_router_failovers", "counter", "requests moved to another node")
ROUTER_PROMPT_TOKENS = _m(
    "cpd_router_prompt_tokens", "counter",
    "prompt tokens by where their KV came from (gpu, dram, remote, computed): the hit "
    "ratio per tier", "{token}", ("tier",))
ROUTER_TTFT = _m(
    "cpd_router_time_to_first_token", "histogram", "time to first token at the router",
    "s", ("policy", "path"), LATENCY_BUCKETS_S)
ROUTER_TPOT = _m(
    "cpd_router_time_per_output_token", "histogram",
    "time per generated token after the first, at the router", "s", ("policy", "path"),
    TOKEN_GAP_BUCKETS_S)
ROUTER_ADMISSION_WAIT = _m(
    "cpd_router_admission_wait", "histogram", "wait for an admission slot", "s",
    buckets=STEP_BUCKETS_S)
ROUTER_DECISION = _m(
    "cpd_router_decision_duration", "histogram",
    "hashing + kvindex lookup + policy, per request", "s", ("policy",), STEP_BUCKETS_S)
ROUTER_RESUMED = _m(
    "cpd_router_resumed_requests", "counter",
    "streams resumed here after the router serving them died (the client's resume_tokens)")
ROUTER_CANCELLED = _m(
    "cpd_router_cancelled_requests", "counter",
    "requests ended before their nodes finished generating them, whose nodes were told "
    "to stop: a stop string matched, or the client stopped reading", labels=("reason",))
ROUTER_LOOKUP_MISSES = _m(
    "cpd_router_kvindex_lookup_misses", "counter",
    "routing decisions made without kvindex's answer (past router.lookup_timeout_ms, an "
    "error, or kvindex recovering): the prompt was treated as uncached")
ROUTER_ESTIMATED_QUEUE = _m(
    "cpd_router_estimated_queue_time", "histogram",
    "the chosen node's queue time as the router estimated it, by role (warm prefill, "
    "cold pre-prefill)", "s", ("role",), LATENCY_BUCKETS_S)
ROUTER_IN_FLIGHT = _m(
    "cpd_router_in_flight", "updown", "requests holding an admission slot")
ROUTER_KEEPALIVES = _m(
    "cpd_router_keepalives", "counter", "keep-alives sent on silent client streams")
ROUTER_DECODE_LENT = _m(
    "cpd_router_decode_lent", "counter",
    "requests whose decode stayed on their prefill node because the decode pool was "
    "saturated (router.decode_lend_at): the elastic prefill/decode boundary")
ROUTER_HASH_MEMO = _m(
    "cpd_router_hash_memo_blocks", "counter",
    "prompt blocks whose hash was reused from an earlier prompt or computed",
    labels=("result",))

# ---------------------------------------------------------------------------- worker

WORKER_KV = _m(
    "cpd_worker_kv", "counter",
    "KV bytes by direction: written through to DRAM, loaded from DRAM into the engine "
    "(rate: the seed's KV write/read bandwidth)", "By", ("role", "direction"))
WORKER_KV_LOAD_FALLBACKS = _m(
    "cpd_worker_kv_load_fallbacks", "counter",
    "planned KV loads that were recomputed instead (the silent fallback of other P/D "
    "stacks), by stage (prefix: a prefill's pull from a peer; handoff: decode's pull "
    "from its prefill node) and reason (the error code: peer_gone, checksum_mismatch, "
    "transfer_timeout, capability_denied, block_evicted, unavailable, ...)",
    labels=("role", "stage", "reason"))
WORKER_KV_LOADS_PLANNED = _m(
    "cpd_worker_kv_loads_planned", "counter",
    "requests that arrived with KV to load from a peer, by stage (prefix, handoff): the "
    "base of the fallback share", labels=("role", "stage"))
WORKER_QUEUE = _m(
    "cpd_worker_queue_time", "histogram",
    "time a request waited in this worker's engine before it ran, by role (prefill: the "
    "warm prefill queue; preprefill: the cold pre-prefill queue; decode)", "s", ("role",),
    LATENCY_BUCKETS_S)
WORKER_PHASE = _m(
    "cpd_worker_phase_duration", "histogram",
    "time per request phase on this worker (load, prefill, first_text, pull, decode)", "s",
    ("role", "phase"), LATENCY_BUCKETS_S)
WORKER_DRAM_USED = _m(
    "cpd_worker_dram_used", "gauge", "block arena bytes in use", "By", ("role", "node"))
WORKER_DRAM_CAPACITY = _m(
    "cpd_worker_dram_capacity", "gauge", "block arena bytes in all", "By", ("role", "node"))
WORKER_EVICTIONS = _m(
    "cpd_worker_evictions", "observed_counter", "blocks evicted from the DRAM arena",
    labels=("role", "node"))
WORKER_COPIES_FIRST = _m(
    "cpd_worker_copies_first", "gauge",
    "1 while the DRAM arena evicts blocks with a copy elsewhere first, 0 while its policy "
    "alone decides (a decode arena's dataplane.decode_copies_first)", labels=("role", "node"))
WORKER_DISK_USED = _m(
    "cpd_worker_disk_used", "gauge", "disk tier bytes in use (block slots)", "By",
    ("role", "node"))
WORKER_DISK_CAPACITY = _m(
    "cpd_worker_disk_capacity", "gauge", "disk tier bytes in all", "By", ("role", "node"))
WORKER_DISK_BLOCKS = _m(
    "cpd_worker_disk_blocks", "observed_counter",
    "disk tier blocks by operation: written (behind the arena), read (back into it), "
    "dropped (a torn, altered or unreadable file), evicted", labels=("role", "node", "op"))

# ------------------------------------------------------------------------ data plane

KV_TRANSFER = _m(
    "cpd_kv_transfer", "counter", "KV bytes moved over UCX, by operation", "By", ("op",))
KV_TRANSFERS = _m(
    "cpd_kv_transfers", "counter", "KV transfers by operation and outcome",
    labels=("op", "outcome"))
KV_TRANSFER_DURATION = _m(
    "cpd_kv_transfer_duration", "histogram", "duration of one KV transfer", "s",
    ("op", "outcome"), STEP_BUCKETS_S)
KV_CAPABILITY_DENIED = _m(
    "cpd_kv_capability_denied", "counter",
    "data-plane requests refused for a missing or wrong capability")

# --------------------------------------------------------------------------- kvindex

KVINDEX_EVENTS = _m("cpd_kvindex_events", "counter", "lifecycle events applied")
KVINDEX_LOOKUPS = _m("cpd_kvindex_lookups", "observed_counter", "prefix lookups answered")
KVINDEX_ILLEGAL = _m(
    "cpd_kvindex_illegal_transitions", "counter",
    "events whose lifecycle transition is illegal (ignored)")
KVINDEX_INVALIDATED = _m(
    "cpd_kvindex_invalidated_blocks", "counter",
    "visible blocks made unreadable (failed, evicted, expired)")
KVINDEX_LAST_EVICTED = _m(
    "cpd_kvindex_last_copies_evicted", "observed_counter",
    "blocks evicted from their last copy in the cluster (arenas, disk tiers, engine caches)")
KVINDEX_LOST_MISSES = _m(
    "cpd_kvindex_lost_block_misses", "observed_counter",
    "blocks that lookups asked for right past their match and that the cluster had lost "
    "(evicted from every copy): recomputed because the pool was short")
KVINDEX_LEASE_EXPIRATIONS = _m(
    "cpd_kvindex_lease_expirations", "counter",
    "node leases that expired (a node stopped heart-beating; its blocks were dropped)")
KVINDEX_PENDING_EVENTS = _m(
    "cpd_kvindex_pending_events", "gauge",
    "CPD_KV events published but not yet applied: the stream's tail past the last one "
    "applied, and those delivered and waiting in kvindex's buffer (the index's lag)")
KVINDEX_BLOCKS = _m(
    "cpd_kvindex_blocks", "gauge", "distinct blocks the index holds", labels=("node",))
KVINDEX_LOCATIONS = _m(
    "cpd_kvindex_locations", "gauge",
    "block copies (node, tier) the index holds; ÷ blocks = replicas per block",
    labels=("node",))

# ------------------------------------------------------------------------------- bus

REJECTED_MESSAGES = _m(
    "cpd_rejected_messages", "counter", "bus messages refused as bad input",
    labels=("service", "subject", "reason"))
NATS_PERMISSION_DENIED = _m(
    "cpd_nats_permission_denied", "counter",
    "publishes and subscribes the NATS server refused (the identity lacks the right)",
    labels=("client", "operation"))

CATALOGUE: tuple[MetricSpec, ...] = tuple(
    v for v in dict(globals()).values() if isinstance(v, MetricSpec))
"""Every metric above, in definition order."""


# ------------------------------------------------------------------- instruments


def counter(meter: Meter, spec: MetricSpec,
            initial: Iterable[Mapping[str, str]] = ()) -> Any:
    """The counter of ``spec``, at 0 from the start: without labels, or for each label
    set of ``initial`` (a rate or a ratio over it then never lacks a term)."""
    _expect(spec, "counter")
    c = meter.create_counter(spec.name, unit=spec.unit, description=spec.description)
    _start_at_zero(c, spec, initial)
    return c


def up_down_counter(meter: Meter, spec: MetricSpec,
                    initial: Iterable[Mapping[str, str]] = ()) -> Any:
    """The up-down counter of ``spec`` (exported as a gauge), at 0 from the start."""
    _expect(spec, "updown")
    c = meter.create_up_down_counter(spec.name, unit=spec.unit,
                                     description=spec.description)
    _start_at_zero(c, spec, initial)
    return c


def _start_at_zero(c: Any, spec: MetricSpec, initial: Iterable[Mapping[str, str]]) -> None:
    sets = list(initial)
    for attrs in sets or ([{}] if not spec.labels else []):
        if set(attrs) - set(spec.labels):
            raise ValueError(f"{spec.name} has no label {set(attrs) - set(spec.labels)}")
        c.add(0, dict(attrs))


def histogram(meter: Meter, spec: MetricSpec) -> Any:
    """The histogram of ``spec``, with its buckets."""
    _expect(spec, "histogram")
    return meter.create_histogram(spec.name, unit=spec.unit, description=spec.description,
                                  explicit_bucket_boundaries_advisory=spec.buckets)


Observe = Callable[[CallbackOptions], Iterable[Observation]]


def gauge(meter: Meter, spec: MetricSpec, callback: Observe) -> Any:
    """The observable gauge of ``spec``, read by ``callback`` at export."""
    _expect(spec, "gauge")
    return meter.create_observable_gauge(spec.name, callbacks=[callback], unit=spec.unit,
                                         description=spec.description)


def observed_counter(meter: Meter, spec: MetricSpec, callback: Observe) -> Any:
    """The observable (monotonic) counter of ``spec``, read by ``callback`` at export."""
    _expect(spec, "observed_counter")
    return meter.create_observable_counter(spec.name, callbacks=[callback], unit=spec.unit,
                                           description=spec.description)


def _expect(spec: MetricSpec, kind: Kind) -> None:
    if spec.kind != kind:
        raise TypeError(f"{spec.name} is a {spec.kind}, not a {kind}")
