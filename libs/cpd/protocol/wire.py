"""Every message CPD sends over NATS (docs/architecture.md, "Subjects"), as tagged
``msgspec.Struct``s.

Rules, so that old and new processes keep talking:

* Each message carries ``kind`` (its tag) and ``v``, the schema *major* version. A major
  bump is a breaking change; within a major, fields are only ever **appended, with
  defaults** (msgpack maps, so readers ignore fields they do not know).
* :func:`decode` turns bad bytes into :class:`~cpd.protocol.errors.MalformedMessage`, a foreign
  major into :class:`~cpd.protocol.errors.SchemaVersionError` and a kind this build does not know
  into :class:`~cpd.protocol.errors.UnknownKind`, which receivers log and skip.
* Token ids and block hashes travel as packed byte strings (``uint32`` little-endian and
  concatenated 16-byte digests): a 100K-token prompt is one 400 KB field, not 100K ints.
* KV bytes never travel here; the UCX data plane carries them.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from typing import Annotated, Any, Literal, TypeVar

import msgspec
import numpy as np

from cpd.protocol import subjects
from cpd.protocol.errors import MalformedMessage, SchemaVersionError, UnknownKind, WrongKind
from cpd.protocol.roles import Role

SCHEMA_VERSION = 1

HASH_BYTES = 16
"""Width of a block hash on the wire (128 bits; see :mod:`cpd.protocol.hashing`)."""

TOKEN_DTYPE = np.dtype("<u4")

T = TypeVar("T", bound="Message")

NonNegInt = Annotated[int, msgspec.Meta(ge=0)]
NonNegFloat = Annotated[float, msgspec.Meta(ge=0)]
# Integers a request may set freely: within a signed 64-bit word (what engines seed
# their generators with), so no value a client sends can fail encoding later.
Int64 = Annotated[int, msgspec.Meta(ge=-(1 << 63), le=(1 << 63) - 1)]
TokenId = Annotated[int, msgspec.Meta(ge=0, lt=1 << 32)]
TopK = Annotated[int, msgspec.Meta(ge=-1, le=(1 << 31) - 1)]   # -1: off

MAX_STOP_STRINGS = 64
MAX_STOP_CHARS = 1024
MAX_LOGIT_BIAS = 1024
MAX_TOP_LOGPROBS = 20
MAX_CHOICES = 64
"""vLLM's default ``max_logprobs``: the most alternatives a token's log probabilities list."""


DEFAULT_TENANT = "default"
"""The tenant of a request that names none (a local cluster, a bus client)."""


class Tier(enum.StrEnum):
    """Where a cached block lives (docs/architecture.md, "KV tiers and the data plane")."""

    GPU = "gpu"
    DRAM = "dram"
    DISK = "disk"


SERVED_TIERS = frozenset({Tier.DRAM, Tier.DISK})
"""Tiers whose blocks a worker's data plane serves (a disk block is read into the arena
first); the engine's GPU tier is loaded only by its own node."""


class TokenSource(enum.StrEnum):
    """Where the KV of a prompt's tokens came from: the per-source counts of a route, of
    the router's totals and of a benchmark's results (:func:`tokens_by_source`)."""

    GPU = "gpu"            # the engine's own prefix cache
    DRAM = "dram"          # this worker's arena
    DISK = "disk"          # this worker's disk tier, read back into its arena
    REMOTE = "remote"      # a peer's arena (or its disk), over UCX
    COMPUTED = "computed"  # computed by the prefill


REUSED_SOURCES = tuple(s for s in TokenSource if s is not TokenSource.COMPUTED)
"""The sources of tokens not computed (:attr:`PromptTokens.reused`)."""


class PromptTokens(msgspec.Struct, kw_only=True):
    """A prompt's tokens by where their KV came from (:class:`TokenSource`): one request's
    (a route's), or the sum over many (the router's totals, a benchmark's results)."""

    gpu: NonNegInt = 0       # the engine's own prefix cache
    dram: NonNegInt = 0      # the prefill node's arena
    remote: NonNegInt = 0    # a peer's arena (or its disk), over UCX
    computed: NonNegInt = 0  # computed by the prefill
    disk: NonNegInt = 0      # the prefill node's disk tier, read back into its arena

    @property
    def reused(self) -> int:
        """Tokens not computed: from the GPU, local DRAM and disk, and peers."""
        return self.gpu + self.dram + self.disk + self.remote

    def by_source(self) -> dict[TokenSource, int]:
        """The counts by source, every source present."""
        return {TokenSource.GPU: self.gpu, TokenSource.DRAM: self.dram,
                TokenSource.DISK: self.disk, TokenSource.REMOTE: self.remote,
                TokenSource.COMPUTED: self.computed}

    def add(self, other: PromptTokens) -> None:
        """Add ``other``'s counts to these."""
        self.gpu += other.gpu
        self.dram += other.dram
        self.disk += other.disk
        self.remote += other.remote
        self.computed += other.computed


class Message(msgspec.Struct, tag_field="kind", kw_only=True, forbid_unknown_fields=False):
    """Base of every wire message."""

    v: int = SCHEMA_VERSION


# --------------------------------------------------------------------------- client API


class SamplingParams(msgspec.Struct, kw_only=True, omit_defaults=True):
    """Sampling settings, with vLLM's meanings; greedy by default (temperature 0).

    Every field defaults to the value that asks for nothing, and is not sent when it
    has it (most requests set a few fields of many). ``stop`` strings are the
    router's to find in the text it streams (it ends the request there and cancels the
    rest); the engines apply the others.
    """

    max_tokens: Annotated[int, msgspec.Meta(ge=1, le=1_000_000)] = 16
    temperature: Annotated[float, msgspec.Meta(ge=0.0, le=100.0)] = 0.0
    top_p: Annotated[float, msgspec.Meta(gt=0.0, le=1.0)] = 1.0
    top_k: TopK = -1
    seed: Int64 | None = None
    stop_token_ids: list[TokenId] = msgspec.field(default_factory=list)
    ignore_eos: bool = False
    min_p: Annotated[float, msgspec.Meta(ge=0.0, le=1.0)] = 0.0
    repetition_penalty: Annotated[float, msgspec.Meta(gt=0.0, le=100.0)] = 1.0
    presence_penalty: Annotated[float, msgspec.Meta(ge=-2.0, le=2.0)] = 0.0
    frequency_penalty: Annotated[float, msgspec.Meta(ge=-2.0, le=2.0)] = 0.0
    # Generate at least this many tokens before EOS or a stop token may end the request.
    min_tokens: Annotated[int, msgspec.Meta(ge=0, le=1_000_000)] = 0
    logit_bias: Annotated[dict[TokenId, Annotated[float, msgspec.Meta(ge=-100.0, le=100.0)]],
                          msgspec.Meta(max_length=MAX_LOGIT_BIAS)] = msgspec.field(
                              default_factory=dict)
    stop: Annotated[list[Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_STOP_CHARS)]],
                    msgspec.Meta(max_length=MAX_STOP_STRINGS)] = msgspec.field(
                        default_factory=list)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    # Log probabilities of each generated token and of this many most likely ones
    # (``None``: none at all; ``0``: the generated token's only).
    logprobs: Annotated[int, msgspec.Meta(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    # Choices generated from the one prompt (its KV computed and moved once): each is
    # a run of its own, with ``seed + index`` when seeded, as vLLM's children are.
    n: Annotated[int, msgspec.Meta(ge=1, le=MAX_CHOICES)] = 1

    def __post_init__(self) -> None:
        if self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) exceeds max_tokens "
                             f"({self.max_tokens})")

    @property
    def needs_output_history(self) -> bool:
        """Whether sampling a token depends on the tokens generated before it (not just
        the prompt's KV): penalties on the output and a seeded random stream."""
        return bool(self.presence_penalty or self.frequency_penalty
                    or (self.temperature > 0 and self.seed is not None))

    def choice(self, index: int) -> SamplingParams:
        """The sampling of choice ``index`` of ``n``: one sequence, and ``seed + index``
        when seeded (vLLM's parallel sampling)."""
        seed = None if self.seed is None else self.seed + index
        return msgspec.structs.replace(self, n=1, seed=seed)


class GenerateRequest(Message, tag="generate", kw_only=True):
    """A client's request on ``cpd.v1.generate``; replies stream to the message's inbox."""

    request_id: str
    # Exactly one of prompt (text, tokenized by the router) and tokens (packed uint32).
    prompt: str | None = None
    tokens: bytes | None = None
    sampling: SamplingParams = msgspec.field(default_factory=SamplingParams)
    model: str = ""
    tenant: str = DEFAULT_TENANT
    cache_salt: str = ""
    priority: Int64 = 0
    # 0 = the router's default deadline; bounded (~35 years) so deadlines derived from it
    # stay within the uint64 milliseconds of the messages the router sends on.
    timeout_ms: Annotated[int, msgspec.Meta(ge=0, le=1 << 40)] = 0
    # A retry of a stream whose router died (same request_id): the tokens (packed uint32)
    # and the characters of text the client already has. The router regenerates them
    # (deterministic sampling only) and sends only what follows.
    resume_tokens: bytes = b""
    resume_text_chars: NonNegInt = 0


class TokenLogprob(msgspec.Struct, array_like=True):
    """One generated token's log probability, its rank in the model's distribution and
    the most likely tokens there (``SamplingParams.logprobs`` of them, best first), as
    vLLM computes them: from the model's raw logits, before any sampling setting."""

    logprob: float
    rank: NonNegInt
    top: list[tuple[int, float]] = msgspec.field(default_factory=list)


class TokenChunk(Message, tag="token", kw_only=True):
    """Some generated tokens; ``seq`` counts every message of one reply stream from 0."""

    request_id: str
    seq: NonNegInt
    token_ids: list[int]
    text: str = ""
    # > 0: not tokens but the router's keep-alive on a silent stream (no ids, no text):
    # "I am alive; expect a message at least every ``keepalive_ms``". Clients skip it,
    # and fail the stream typed when that many intervals pass without any message
    # (router.keepalive_misses; docs/architecture.md, "Failure handling"). Older clients see an
    # empty chunk.
    keepalive_ms: NonNegInt = 0
    # The last id is the EOS or ``stop_token_ids`` entry that ended the request: as in
    # vLLM, it counts as generated but its text is left out (unless the request has
    # ``include_stop_str_in_output``).
    ends_with_stop_token: bool = False
    # One per id when the request asked for log probabilities (``SamplingParams.logprobs``).
    logprobs: list[TokenLogprob] = msgspec.field(default_factory=list)
    # The choice these tokens belong to (``SamplingParams.n``).
    index: NonNegInt = 0


class CancelGenerate(Message, tag="cancel_generate", kw_only=True):
    """Client → every router (``cpd.v1.generate.cancel``): the client stopped reading the
    stream of ``request_id`` before its end (its HTTP client left, it was cancelled).
    The router serving it, and only for the same ``reply_to`` (the stream's inbox, which
    only that client knows), ends it and cancels its nodes' work."""

    request_id: str
    reply_to: str


class SupersedeGenerate(Message, tag="supersede_generate", kw_only=True):
    """Gateway → every router (``cpd.v1.generate.supersede``): a client resumed
    ``request_id`` of ``tenant`` holding ``resumed_tokens`` tokens (its earlier gateway
    died with the stream). Every stream of that id and tenant that began with fewer
    resumed tokens has no reader any more: its router ends it and cancels its nodes'
    work. Only gateways (and an admin) may publish it: it names a tenant."""

    request_id: str
    tenant: str = DEFAULT_TENANT
    resumed_tokens: NonNegInt = 0


class CancelReason(enum.StrEnum):
    """Why a router ended a request before its nodes were done generating it."""

    STOP_STRING = "stop_string"  # a stop string matched: the request is complete
    CLIENT_GONE = "client_gone"  # the client stopped reading (``CancelGenerate``)
    SUPERSEDED = "superseded"    # the client resumed it elsewhere (``SupersedeGenerate``)
    READER_GONE = "reader_gone"  # nothing subscribes to its reply inbox (its gateway died)
    ROUTER_STOPPING = "router_stopping"  # its router stopped first (drain timed out)


class Usage(msgspec.Struct, kw_only=True):
    prompt_tokens: NonNegInt = 0
    completion_tokens: NonNegInt = 0
    cached_tokens: NonNegInt = 0


class Timings(msgspec.Struct, kw_only=True):
    """Milliseconds per phase of one request, as seen by the services."""

    admission_ms: NonNegFloat = 0.0
    # Hashing, the kvindex lookup and the policy, with any single-flight wait: the time
    # from admission to dispatch (of the try that succeeded).
    decision_ms: NonNegFloat = 0.0
    lookup_ms: NonNegFloat = 0.0  # the kvindex round trip alone
    load_ms: NonNegFloat = 0.0
    prefill_ms: NonNegFloat = 0.0
    handoff_ms: NonNegFloat = 0.0
    ttft_ms: NonNegFloat = 0.0
    decode_ms: NonNegFloat = 0.0
    total_ms: NonNegFloat = 0.0
    # Of prefill_ms and decode_ms: waiting in the node's engine before it ran the
    # request (measured on the node: the warm prefill, cold pre-prefill or decode queue).
    prefill_queue_ms: NonNegFloat = 0.0
    decode_queue_ms: NonNegFloat = 0.0


class RouteReason(enum.StrEnum):
    """Why the router sent a request where it did (the figures behind it are fields of
    the :class:`Route`; :meth:`Route.describe` words them for people)."""

    WARM = "warm"                        # enough reusable: the prefill tier
    COLD = "cold"                        # too little reusable: the pre-prefill tier
    KVINDEX_UNAVAILABLE = "kvindex_unavailable"  # no lookup answer: a miss, never a guess
    PREFILL_BUSY = "prefill_busy"        # warm, overflowed to the idle pre-prefill tier
    IDLE_PREPREFILL_HIT = "idle_preprefill_hit"  # warm, on an idle pre-prefill node holding it
    PREPREFILL_BUSY = "preprefill_busy"  # cold, overflowed to the idle prefill tier
    NO_PREPREFILL = "no_preprefill"      # cold, and no pre-prefill node is up
    NO_PREFILL = "no_prefill"            # warm, and no prefill node is up: pre-prefill
    LEAST_COST = "least_cost"            # pd-kv: the cheapest prefill node
    ROUND_ROBIN = "round_robin"          # pd-rr: the next prefill node in turn


class LoadError(msgspec.Struct, frozen=True, kw_only=True):
    """A planned load that did not happen (the prefix was then recomputed)."""

    peer: str
    code: str                 # an ``errors.ErrorCode`` value
    detail: str = ""          # for people only


class PeerLoad(msgspec.Struct, frozen=True, kw_only=True):
    """The router's price for loading a prompt's prefix from a peer's DRAM against
    recomputing it: the figures behind a load taken or declined."""

    peer: str
    tokens: NonNegInt             # what the peer holds past the node's own reuse
    gbps: NonNegFloat             # the bandwidth the load was priced at
    measured: bool                # the pulling node's measurement, not the default
    load_ms: NonNegFloat
    compute_ms: NonNegFloat       # recomputing the same tokens instead
    loaded: bool                  # the load won: the plan pulls from ``peer``


class Route(msgspec.Struct, kw_only=True):
    """What the router decided and what the workers actually did."""

    policy: str = ""
    path: Literal["", "cold", "warm", "overflow"] = ""
    reason: RouteReason | None = None
    prefill_node: str = ""
    decode_node: str = ""
    # The decode stayed on the prefill node (it decodes too) because the decode pool was
    # saturated (router.decode_lend_at): no hand-off transfer.
    decode_lent: bool = False
    # Where the prompt's KV came from: planned by the router, then as the prefill node
    # reported it.
    tokens: PromptTokens = msgspec.field(default_factory=PromptTokens)
    # The router's view when it decided: the most any prefill node could reuse (what it
    # classed warm or cold on), what the chosen plan reuses, the chosen node's estimated
    # TTFT and, on overflow, the busier tier's.
    reusable_tokens: NonNegInt = 0
    planned_reused_tokens: NonNegInt = 0
    est_ttft_ms: NonNegFloat = 0.0
    busy_ttft_ms: NonNegFloat = 0.0
    remote_node: str = ""     # the peer the plan loads from, if any
    # The peer load the chosen plan priced (``loaded``: it pulls from that peer), or
    # else one the prefill tier declined as slower than recomputing: why a cached
    # prefix was recomputed.
    peer_load: PeerLoad | None = None
    waited_for: str = ""      # single-flight: the node whose prefix it waited for
    lookup_missed: bool = False  # decided without kvindex's answer (a miss)
    failovers: NonNegInt = 0
    # The decode node's side of the hand-off: prompt tokens it pulled vs recomputed.
    decode_tokens_pulled: NonNegInt = 0
    decode_tokens_computed: NonNegInt = 0
    # A planned load that failed: the request succeeded on a slower path than planned.
    load_error: LoadError | None = None

    @property
    def reused_tokens(self) -> int:
        """Prompt tokens not computed: from the GPU, local DRAM and disk, and peers."""
        return self.tokens.reused

    def describe(self) -> str:
        """The route in words (logs, ``cpd generate``); derived from the fields, never
        read back."""
        parts = [self._why()] if self.reason is not None else []
        if self.lookup_missed and self.reason is not RouteReason.KVINDEX_UNAVAILABLE:
            parts.append("kvindex unavailable: treated as a miss")
        if self.waited_for:
            parts.append(f"after waiting for {self.waited_for}'s prefix")
        if self.reused_tokens > self.planned_reused_tokens:
            parts.append(f"{self.prefill_node} found {self.reused_tokens} tokens cached, "
                         f"not {self.planned_reused_tokens}")
        if self.failovers:
            parts.append(f"after {self.failovers} failover(s)")
        if (p := self.peer_load) is not None and not p.loaded:
            parts.append(f"loading {p.tokens} tokens from {p.peer} at {p.gbps:.3g} GB/s "
                         f"({p.load_ms:.0f} ms) is slower than recomputing them "
                         f"({p.compute_ms:.0f} ms)")
        if self.load_error is not None:
            parts.append(f"load from {self.load_error.peer} failed "
                         f"({self.load_error.code}), recomputed")
        return "; ".join(parts)

    def _why(self) -> str:
        match self.reason:
            case RouteReason.WARM:
                remote = f" (remote from {self.remote_node})" if self.remote_node else ""
                return f"warm: {self.reusable_tokens} tokens cached{remote}"
            case RouteReason.COLD:
                return f"cold: {self.reusable_tokens} tokens reusable"
            case RouteReason.KVINDEX_UNAVAILABLE:
                return "kvindex unavailable: treated as a miss"
            case RouteReason.PREFILL_BUSY:
                return (f"prefill tier busy: {self.busy_ttft_ms:.0f} ms there vs "
                        f"{self.est_ttft_ms:.0f} ms on pre-prefill")
            case RouteReason.IDLE_PREPREFILL_HIT:
                return (f"warm: {self.reusable_tokens} tokens cached, on idle pre-prefill "
                        f"{self.prefill_node}, which holds {self.planned_reused_tokens}")
            case RouteReason.PREPREFILL_BUSY:
                return (f"cold: {self.reusable_tokens} tokens reusable; pre-prefill busy "
                        f"({self.busy_ttft_ms:.0f} ms)")
            case RouteReason.NO_PREPREFILL:
                return f"cold: {self.reusable_tokens} tokens reusable; no pre-prefill node"
            case RouteReason.NO_PREFILL:
                return (f"warm: {self.reusable_tokens} tokens cached; no prefill node, "
                        f"on pre-prefill {self.prefill_node}")
            case RouteReason.LEAST_COST:
                return f"least cost: {self.tokens.computed} new tokens"
            case RouteReason.ROUND_ROBIN:
                return "round-robin"
        return ""


class ChoiceEnd(msgspec.Struct, kw_only=True):
    """How one choice of a request ended (``Final.choices``)."""

    index: NonNegInt
    finish_reason: str
    stop_reason: int | str | None = None
    completion_tokens: NonNegInt = 0


class Final(Message, tag="final", kw_only=True):
    """The last message of a successful stream. A worker's says how the generation
    ended (its reports precede it); the router's, to the client, adds the usage,
    timings and route it assembled."""

    request_id: str
    seq: NonNegInt
    finish_reason: str = "stop"
    # vLLM's: what stopped a ``stop`` finish, the stop string or the stop token id
    # (``None`` for EOS, and for any other finish).
    stop_reason: int | str | None = None
    usage: Usage = msgspec.field(default_factory=Usage)
    timings: Timings = msgspec.field(default_factory=Timings)
    route: Route = msgspec.field(default_factory=Route)
    # How each choice ended, by index, when the request has several
    # (``SamplingParams.n`` > 1); ``finish_reason`` and ``stop_reason`` are choice 0's.
    choices: list[ChoiceEnd] = msgspec.field(default_factory=list)

    def ends(self) -> list[ChoiceEnd]:
        """How each choice ended, by index (one, unless the request asked for ``n``)."""
        return self.choices or [ChoiceEnd(index=0, finish_reason=self.finish_reason,
                                          stop_reason=self.stop_reason)]


class Error(Message, tag="error", kw_only=True):
    """The last message of a failed stream, or the reply to a bad request."""

    request_id: str = ""
    seq: NonNegInt = 0
    code: str
    message: str
    retryable: bool = False
    node: str = ""  # the node the error is about, when not the sender (CpdError.node)


# ------------------------------------------------------------------------------ kvindex


class LookupRequest(Message, tag="lookup", kw_only=True):
    """Longest-prefix lookup of a prompt's chained block hashes."""

    request_id: str = ""
    namespace: str
    block_hashes: bytes  # n * HASH_BYTES
    include_pending: bool = True
    # With each DRAM and disk match's sealed checksums (``TierMatch.checksums``). The
    # router does not ask: a puller asks kvindex itself (``ChecksumsRequest``) while the
    # bytes travel, and a lookup stays cheap. Kept for routers that still ask.
    checksums: bool = False


class ChecksumsRequest(Message, tag="checksums", kw_only=True):
    """A puller → kvindex (``cpd.v1.kvindex.checksums``): the checksums ``node`` sealed
    for the leading ``block_hashes`` it holds VISIBLE in a tier its data plane serves
    (DRAM, or its disk tier). A prefill node loading a prefix from ``node``, or a decode
    node pulling a hand-off, checks the bytes it pulled against them, never against the
    peer's own word. Only checksums: no capability, and only the node asked about."""

    request_id: str = ""
    namespace: str
    node: str
    block_hashes: bytes  # n * HASH_BYTES


class ChecksumsReply(Message, tag="checksums_reply", kw_only=True):
    """kvindex's record for a ``ChecksumsRequest``: the checksums of the leading blocks
    it has (packed, ``pack_checksums``; fewer than asked while events are on their way)."""

    request_id: str = ""
    checksums: bytes = b""


class TierMatch(msgspec.Struct, array_like=True):
    """``num_blocks`` leading blocks are VISIBLE on ``node`` in ``tier``."""

    node: str
    tier: Tier
    num_blocks: NonNegInt
    # Read capability of this node's blocks of the looked-up namespace (cpd.protocol.capability);
    # empty for tiers the data plane does not serve (GPU).
    capability: bytes = b""
    # The matched blocks' checksums as their writer sealed them at this location, packed
    # (``pack_checksums``), when the lookup asked (DRAM and disk matches).
    checksums: bytes = b""


class PendingMatch(msgspec.Struct, array_like=True):
    """Blocks past the visible prefix that ``node`` is still writing."""

    node: str
    num_blocks: NonNegInt


class LookupReply(Message, tag="lookup_reply", kw_only=True):
    """kvindex's authoritative answer; ``status != "ok"`` must be treated as a miss."""

    request_id: str = ""
    status: Literal["ok", "recovering", "unknown_namespace"] = "ok"
    num_blocks: NonNegInt = 0
    matches: list[TierMatch] = msgspec.field(default_factory=list)
    pending: list[PendingMatch] = msgspec.field(default_factory=list)
    # CPD_KV events kvindex had not applied yet (the stream's tail past what it applied,
    # as of its last event): how far behind the blocks' lifecycle this answer may be.
    lag_events: NonNegInt = 0


class BlockRef(msgspec.Struct, array_like=True):
    """A block and its parent in the hash chain (empty parent for the first block)."""

    hash: bytes
    parent: bytes
    num_tokens: NonNegInt


class BlockSeal(msgspec.Struct, array_like=True):
    hash: bytes
    nbytes: NonNegInt
    checksum: int


class KvEvent(Message, kw_only=True):
    """Base of durable block lifecycle events on ``cpd.v1.kv.events.<node>``.

    ``epoch`` identifies one incarnation of the node (its start time in ms): a restarted
    node starts a new epoch with empty caches. ``seq`` counts the node's events within
    its epoch from 1 (gap detection). ``trace`` is the W3C ``traceparent`` of the request
    that caused the event, kept with the durable record.
    """

    node: str
    seq: NonNegInt
    namespace: str = ""
    tier: Tier = Tier.DRAM
    trace: str = ""
    epoch: NonNegInt = 0


class BlocksAllocated(KvEvent, tag="kv_allocated", kw_only=True):
    blocks: list[BlockRef]


class BlocksWriting(KvEvent, tag="kv_writing", kw_only=True):
    hashes: list[bytes]


class BlocksSealed(KvEvent, tag="kv_sealed", kw_only=True):
    seals: list[BlockSeal]
    # The node's read capability for ``namespace`` (cpd.protocol.capability): kvindex hands it to
    # routers with the location; a peer must present it to pull these blocks.
    capability: bytes = b""


class BlocksEvicted(KvEvent, tag="kv_evicted", kw_only=True):
    hashes: list[bytes]


class BlocksFailed(KvEvent, tag="kv_failed", kw_only=True):
    """The writer gave up on these blocks (cancel, error, bad checksum)."""

    hashes: list[bytes]
    reason: str = ""


class NodeCleared(KvEvent, tag="kv_cleared", kw_only=True):
    """Every block of ``node`` in ``tier`` is gone (restart, vLLM AllBlocksCleared)."""


class LeaseExpired(KvEvent, tag="kv_lease_expired"):
    """Published by kvindex (not the node) into ``CPD_KV`` when ``node``'s lease of
    ``epoch`` expired, so every replica and every replay forgets its blocks alike."""

    reason: str = ""


class GpuBlocksStored(KvEvent, tag="gpu_stored", kw_only=True):
    """vLLM BlockStored, with the token ids kvindex maps onto CPD's own hashes."""

    engine_hashes: list[int | bytes]
    parent_engine_hash: int | bytes | None = None
    tokens: bytes = b""  # packed uint32, len = len(engine_hashes) * engine_block_size
    engine_block_size: NonNegInt = 0
    # The namespace's spec (Namespace.to_spec()), so kvindex can map the blocks from the
    # stream alone: a rebuild without a snapshot replays events before any heartbeat.
    namespace_spec: bytes = b""


class GpuBlocksRemoved(KvEvent, tag="gpu_removed", kw_only=True):
    engine_hashes: list[int | bytes]


class Reannounce(Message, tag="reannounce", kw_only=True):
    """kvindex asks a node to publish its full state again (after a gap or restart)."""

    from_seq: NonNegInt = 0
    reason: str = ""


class BlocksVisible(Message, tag="kv_visible", kw_only=True):
    """kvindex made these blocks VISIBLE at ``node``/``tier`` (routers keep a warm view)."""

    namespace: str
    node: str
    tier: Tier
    block_hashes: bytes

    def __post_init__(self) -> None:
        _check_hash_width(self.block_hashes)


class BlocksInvalidated(Message, tag="kv_invalidated", kw_only=True):
    """These blocks (or all of ``node``'s, when ``block_hashes`` is empty) are gone."""

    namespace: str = ""
    node: str
    tier: Tier | None = None
    block_hashes: bytes = b""
    reason: str = ""

    def __post_init__(self) -> None:
        _check_hash_width(self.block_hashes)


class BlockCopies(Message, tag="kv_copies", kw_only=True):
    """kvindex → one node, on ``cpd.v1.kv.copies.<node>``: which of the node's DRAM blocks
    of ``namespace`` now have another served copy in the cluster (``shared``: a peer's
    DRAM or disk, or this node's own disk) and which became the last one (``last``). An
    arena evicts blocks with a copy elsewhere first, so the cluster's arenas pool their
    capacity instead of holding the same blocks. A block never named is a last copy.
    ``misses``: how many blocks the lookups that replica ``kvindex`` answered asked for
    right past their match and found lost (evicted from every copy in the cluster), its
    running count since it started; a decode arena evicts copies first while these grow
    (cpd.kvstore.copiesgate)."""

    namespace: str
    shared: bytes = b""
    last: bytes = b""
    kvindex: str = ""
    misses: NonNegInt = 0

    def __post_init__(self) -> None:
        _check_hash_width(self.shared)
        _check_hash_width(self.last)


# ------------------------------------------------------------------------ node liveness


class Heartbeat(Message, tag="heartbeat", kw_only=True):
    """Lease renewal and identity of a node; missing heartbeats expire the lease."""

    node: str
    # A worker's Role, or the service kind of kvindex and routers (they hold leases too).
    role: Literal["kvindex", "router", "preprefill", "prefill", "decode"]
    started_unix_ms: NonNegInt
    lease_ttl_ms: Annotated[int, msgspec.Meta(gt=0)]
    ucx_address: bytes = b""
    capacity_blocks: NonNegInt = 0
    namespace: str = ""
    version: str = ""
    # msgpack of the node's base cpd.protocol.hashing.Namespace: lets kvindex hash vLLM's GPU-tier
    # events (token ids) into CPD block hashes for that namespace.
    namespace_spec: bytes = b""
    # A prefill-side node that also serves decode hand-offs (worker.serve_decode): the
    # router may keep a request's decode on it when the decode pool is saturated.
    decodes: bool = False


class PrefillWork(msgspec.Struct, array_like=True):
    """One prefill a worker holds, as the router prices it: the new tokens it computes
    after ``context_tokens`` cached ones, and the ms since it entered the engine (0 while
    its prefix still loads)."""

    new_tokens: NonNegInt
    context_tokens: NonNegInt
    elapsed_ms: NonNegFloat = 0.0


MAX_REPORTED_PREFILLS = 256
"""At most this many :class:`PrefillWork` entries in one load report (oldest first)."""


class LoadReport(Message, tag="load", kw_only=True):
    """A worker's load, every ~100-200 ms and on change."""

    node: str
    role: Role
    queue_depth: NonNegInt = 0
    queued_new_tokens: NonNegInt = 0
    in_flight: NonNegInt = 0
    dram_used_bytes: NonNegInt = 0
    dram_total_bytes: NonNegInt = 0
    kv_bandwidth_gbps: NonNegFloat = 0.0
    # The prefills it holds, oldest first (the router prices them: its queue estimate of
    # the node), and its engine's long_prefill_token_threshold (> 0: prefills share
    # steps, so a short one does not wait out a long one).
    prefills: Annotated[list[PrefillWork], msgspec.Meta(
        max_length=MAX_REPORTED_PREFILLS)] = msgspec.field(default_factory=list)
    prefill_token_cap: NonNegInt = 0
    # Its disk tier: bytes in use and in all, and the read rate it measured (GB/s; 0
    # until it has read, or without a disk tier): the router prices disk loads with it.
    disk_used_bytes: NonNegInt = 0
    disk_total_bytes: NonNegInt = 0
    disk_read_gbps: NonNegFloat = 0.0


# ----------------------------------------------------------------------- worker requests


class LoadSource(msgspec.Struct, kw_only=True):
    """Where a prefill node should load a run of prefix blocks from."""

    node: str
    tier: Tier
    first_block: NonNegInt
    num_blocks: NonNegInt
    capability: bytes = b""  # from kvindex's TierMatch; presented in BlockGet
    # Not read: the puller asks kvindex for the run's recorded checksums itself
    # (``ChecksumsRequest``). Kept, as every field is within a schema major.
    checksums: bytes = b""


class PrefillRequest(Message, tag="prefill", kw_only=True):
    """Router → pre-prefill or prefill node, on ``cpd.v1.<role>.<node>.run``."""

    request_id: str
    reply_to: str
    tokens: bytes
    sampling: SamplingParams
    namespace: str
    block_hashes: bytes
    decode_node: str
    deadline_unix_ms: NonNegInt
    # The time left when sent, ms: the receiver's deadline is its own clock plus this
    # (cpd.protocol.deadlines), so hosts' clocks need not agree. None: the instant alone.
    budget_ms: NonNegInt | None = None
    sources: list[LoadSource] = msgspec.field(default_factory=list)
    # The prompt tokens the router planned to compute (the rest is loaded): the node
    # reports its held prefill at this size, as the router priced it. 0: all of them.
    planned_new_tokens: NonNegInt = 0
    trace: str = ""


class DecodeRequest(Message, tag="decode", kw_only=True):
    """Prefill side → decode node: the sealed blocks to pull and the first token."""

    request_id: str
    reply_to: str
    tokens: bytes
    # The prefill's first token; ``None`` when the request has several choices: each
    # then starts from the prompt on the decode node (the prefill computed the KV).
    first_token: int | None
    sampling: SamplingParams
    namespace: str
    block_hashes: bytes
    source_node: str
    lease_id: str
    deadline_unix_ms: NonNegInt
    budget_ms: NonNegInt | None = None  # as PrefillRequest's
    seq_start: NonNegInt = 1
    trace: str = ""
    capability: bytes = b""  # source_node's read capability for ``namespace``
    # Tokens the prefill side sampled after ``first_token``, before the hand-off (its
    # first tokens ended inside a character: ``worker.first_text_tokens``).
    next_tokens: list[TokenId] = msgspec.field(default_factory=list)

    def generated(self) -> list[int]:
        """The tokens the prefill side sampled, in order (none for several choices)."""
        return [] if self.first_token is None else [self.first_token, *self.next_tokens]


class Accepted(Message, tag="accepted", kw_only=True):
    """A worker took a request it will answer on the request's own reply stream."""

    request_id: str
    node: str = ""


class HandoffAccepted(Message, tag="handoff_accepted", kw_only=True):
    """On a request's stream, from the decode node that accepted its hand-off, before
    anything else it sends: from this message on, ``node`` owns the stream (the router
    watches that node's liveness, not the prefill node's)."""

    request_id: str
    seq: NonNegInt
    node: str


class PrefillReport(Message, tag="prefill_report", kw_only=True):
    """On a request's stream, from its prefill node right after the first token: what
    the node did (the router assembles the client's route and timings from it)."""

    request_id: str
    seq: NonNegInt
    node: str
    tokens: PromptTokens
    # A planned load that failed: the prefix was recomputed from there on.
    load_error: LoadError | None = None
    load_ms: NonNegFloat = 0.0
    prefill_ms: NonNegFloat = 0.0  # the engine's run, its queue_ms included
    queue_ms: NonNegFloat = 0.0


class DecodeReport(Message, tag="decode_report", kw_only=True):
    """On a request's stream, from its decode node right before the final message: the
    hand-off's prompt tokens it pulled and recomputed, and how long each phase took."""

    request_id: str
    seq: NonNegInt
    node: str
    tokens_pulled: NonNegInt = 0
    tokens_computed: NonNegInt = 0
    handoff_ms: NonNegFloat = 0.0
    decode_ms: NonNegFloat = 0.0  # the engine's run, its queue_ms included
    queue_ms: NonNegFloat = 0.0


class ResetCache(Message, tag="reset_cache", kw_only=True):
    """Operator request to a worker: drop its engine's own prefix cache (the GPU tier).
    DRAM blocks stay; kvindex hears of the drop through the engine's KV events."""

    reason: str = ""


class Cancel(Message, tag="cancel", kw_only=True):
    """Router → the nodes of a request's try, on ``subjects.cancel(node)``: stop
    generating ``request_id`` (the router found a stop string, or the client is gone).
    A node aborts it in its engine; a node that has not reached it yet drops it when it
    comes (a hand-off it refuses, a first token it does not hand off). With ``choice``,
    only that choice of a request of several (a stop string in its text)."""

    request_id: str
    choice: NonNegInt | None = None


class PullAck(Message, tag="pull_ack", kw_only=True):
    """Decode → prefill side: the pull of ``lease_id`` is done; unpin the blocks."""

    request_id: str
    lease_id: str
    ok: bool = True


# ------------------------------------------------------------------------ cluster status


class StatusRequest(Message, tag="status", kw_only=True):
    """Ask a router (``cpd.v1.router.status``) for its view of the cluster."""


class NodeStatus(msgspec.Struct, kw_only=True):
    """One worker as the router last heard of it."""

    node: str
    role: Role
    alive: bool
    last_seen_ms: NonNegFloat = 0.0  # ago
    queue_depth: NonNegInt = 0
    queued_new_tokens: NonNegInt = 0
    # The router's price of the prefills the node holds and of what it dispatched there
    # since the node's last load report (ms).
    est_queue_ms: NonNegFloat = 0.0
    in_flight: NonNegInt = 0
    dram_used_bytes: NonNegInt = 0
    dram_total_bytes: NonNegInt = 0
    kv_bandwidth_gbps: NonNegFloat = 0.0
    capacity_blocks: NonNegInt = 0
    disk_used_bytes: NonNegInt = 0
    disk_total_bytes: NonNegInt = 0
    disk_read_gbps: NonNegFloat = 0.0
    decodes: bool = False   # a prefill-side node that also serves decode


class RouterStats(msgspec.Struct, kw_only=True):
    """A router's counters since it started: admission and where prompt tokens came from."""

    node: str = ""
    policy: str = ""
    in_flight: NonNegInt = 0
    queued: NonNegInt = 0
    max_inflight: NonNegInt = 0
    admitted: NonNegInt = 0
    rejected: NonNegInt = 0
    completed: NonNegInt = 0
    failed: NonNegInt = 0
    failovers: NonNegInt = 0
    # Completed requests whose planned load failed on the node (recomputed instead).
    load_failures: NonNegInt = 0
    # Decisions made without kvindex's answer (the prompt treated as uncached).
    lookup_misses: NonNegInt = 0
    decode_lent: NonNegInt = 0   # decodes kept on their prefill node (router.decode_lend_at)
    # Requests taken over from a router that died mid-stream (``resume_tokens``).
    resumed: NonNegInt = 0
    # Requests ended before their nodes finished, by ``CancelReason``.
    cancelled: dict[str, int] = msgspec.field(default_factory=dict)
    prompt_tokens: NonNegInt = 0
    tokens: PromptTokens = msgspec.field(default_factory=PromptTokens)
    paths: dict[str, int] = msgspec.field(default_factory=dict)


class KvIndexState(enum.StrEnum):
    """A router's view of kvindex, from its own lookups (services/router/kvhealth.py)."""

    OK = "ok"
    RECOVERING = "recovering"    # answering, but still rebuilding: its answers are misses
    SLOW = "slow"                # its last lookups missed their deadline, fewer than the limit
    LAGGING = "lagging"          # answering, but over the limit behind the CPD_KV stream
    UNAVAILABLE = "unavailable"  # nobody answers, or too many lookups in a row missed

    @property
    def serving(self) -> bool:
        """Whether requests are served as usual: a slow index makes some lookups misses
        (routed as uncached), which is no reason to take a gateway out of service."""
        return self in (KvIndexState.OK, KvIndexState.SLOW)


class StatusReply(Message, tag="status_reply", kw_only=True):
    router: RouterStats
    nodes: list[NodeStatus] = msgspec.field(default_factory=list)
    kvindex: KvIndexState = KvIndexState.OK
    namespace: str = ""


# ------------------------------------------------------------------ data plane (UCX)
#
# These travel over UCX, not NATS: one header per exchange (length-prefixed msgpack in a
# tagged message), followed by the block bytes as separate tagged messages (cpd.transfer).


class BlockGet(Message, tag="blk_get", kw_only=True):
    """Client → server: send me these sealed blocks (``hashes`` concatenated)."""

    xfer_id: NonNegInt
    hashes: bytes
    namespace: str = ""  # when set, blocks of another namespace count as missing
    timeout_ms: NonNegInt = 0
    # Read capability of ``namespace`` at the serving node (cpd.protocol.capability); a server
    # that enforces capabilities refuses the get without one.
    capability: bytes = b""
    # Blocks per message, in request order, summing to the number of hashes: the client's
    # coalescing layout (cpd.transfer.coalesce_runs). Empty: one message per block. A
    # server that follows it says so in BlockReply.coalesced (older ones ignore it).
    runs: list[NonNegInt] = msgspec.field(default_factory=list)


class BlockPut(Message, tag="blk_put", kw_only=True):
    """Client → server: I want to push these sealed blocks (refs and seals in order)."""

    xfer_id: NonNegInt
    namespace: str
    blocks: list[BlockRef]
    seals: list[BlockSeal]
    timeout_ms: NonNegInt = 0
    capability: bytes = b""  # write capability of ``namespace`` at the serving node


class BlockReply(Message, tag="blk_reply", kw_only=True):
    """Server → client, for one ``xfer_id``.

    For a get: ``ok`` with the refs and seals of the blocks that follow, in request order,
    or an error ``code`` (``block_evicted`` with the ``missing`` hashes). For a put: first
    the go-ahead (``accepted``: one byte per block, 1 = send it, 0 = already held), then
    the final status once the pushed bytes were checked and sealed.
    """

    xfer_id: NonNegInt
    ok: bool = True
    code: str = ""
    message: str = ""
    namespace: str = ""
    blocks: list[BlockRef] = msgspec.field(default_factory=list)
    seals: list[BlockSeal] = msgspec.field(default_factory=list)
    accepted: bytes = b""
    missing: bytes = b""
    # For a get: the blocks follow one message per run of BlockGet.runs (packed back to
    # back), not one message each. Lets a client tell a server that ignored the layout.
    coalesced: bool = False


AnyMessage = (
    GenerateRequest | TokenChunk | Final | Error | CancelGenerate | SupersedeGenerate
    | LookupRequest | LookupReply | ChecksumsRequest | ChecksumsReply
    | BlocksAllocated | BlocksWriting | BlocksSealed | BlocksEvicted | BlocksFailed
    | NodeCleared | LeaseExpired | GpuBlocksStored | GpuBlocksRemoved | Reannounce
    | BlocksVisible | BlocksInvalidated | BlockCopies
    | Heartbeat | LoadReport
    | PrefillRequest | DecodeRequest | Accepted | HandoffAccepted | PrefillReport
    | DecodeReport | ResetCache | PullAck | Cancel
    | StatusRequest | StatusReply
    | BlockGet | BlockPut | BlockReply
)

KINDS: frozenset[str] = frozenset(
    t.__struct_config__.tag for t in AnyMessage.__args__  # type: ignore[attr-defined]
)

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(AnyMessage)


class _Header(msgspec.Struct):
    kind: str = ""
    v: int = -1


_header_decoder = msgspec.msgpack.Decoder(_Header)


def encode(msg: Message) -> bytes:
    """Serialize one message (msgpack)."""
    return _encoder.encode(msg)


def decode(data: bytes | memoryview, expect: type[T] | None = None) -> T:
    """Parse one message, raising a typed :mod:`cpd.protocol.errors` exception on bad input.

    With ``expect`` the message must be of that kind (or a subclass), else
    :class:`~cpd.protocol.errors.WrongKind`.
    """
    try:
        msg = _decoder.decode(data)
    except (msgspec.MsgspecError, RecursionError) as e:  # deep nesting: hostile input
        raise _classify(data, e) from None
    if msg.v != SCHEMA_VERSION:
        raise SchemaVersionError(
            f"{msg.__struct_config__.tag} has schema v{msg.v}; this build speaks v{SCHEMA_VERSION}"
        )
    if expect is not None and not isinstance(msg, expect):
        raise WrongKind(
            f"expected {expect.__struct_config__.tag!r}, got {msg.__struct_config__.tag!r}"
        )
    return msg  # type: ignore[return-value]


def _classify(data: bytes | memoryview, err: Exception) -> Exception:
    try:
        head = _header_decoder.decode(data)
    except (msgspec.MsgspecError, RecursionError):
        return MalformedMessage(f"undecodable message: {err}")
    if head.v not in (-1, SCHEMA_VERSION):
        return SchemaVersionError(
            f"message has schema v{head.v}; this build speaks v{SCHEMA_VERSION}")
    if head.kind and head.kind not in KINDS:
        return UnknownKind(f"unknown message kind {head.kind!r}")
    return MalformedMessage(f"invalid {head.kind or 'message'}: {err}")


# -------------------------------------------------------------------- packed arrays


def pack_tokens(tokens: Any) -> bytes:
    """Token ids (list or array) → packed little-endian uint32 bytes."""
    arr = np.asarray(tokens)
    if arr.ndim != 1:
        raise ValueError("tokens must be one-dimensional")
    if arr.size and (arr.min() < 0 or arr.max() > 0xFFFFFFFF):
        raise ValueError("token ids must fit in uint32")
    return arr.astype(TOKEN_DTYPE, copy=False).tobytes()


def check_sender(subject: str, msg: Heartbeat | LoadReport | KvEvent) -> None:
    """:func:`cpd.protocol.subjects.check_sender` for ``msg``: the node it names, and a
    load report's role, must be ``subject``'s (else ``ForgedSender``)."""
    subjects.check_sender(subject, msg.node, msg.role if isinstance(msg, LoadReport) else "")


def unpack_tokens(data: bytes) -> np.ndarray:
    """Packed uint32 bytes → a read-only numpy array (no copy)."""
    if len(data) % TOKEN_DTYPE.itemsize:
        raise MalformedMessage(f"token array of {len(data)} bytes is not a multiple of 4")
    return np.frombuffer(data, dtype=TOKEN_DTYPE)


def _check_hash_width(data: bytes) -> None:
    """A hash array's length is a whole number of hashes (a message that says otherwise
    fails decoding as malformed, before any handler reads it)."""
    if len(data) % HASH_BYTES:
        raise ValueError(f"hash array of {len(data)} bytes is not a multiple of {HASH_BYTES}")


CHECKSUM_DTYPE = np.dtype("<u8")
CHECKSUM_BYTES = CHECKSUM_DTYPE.itemsize


def pack_checksums(checksums: Iterable[int]) -> bytes:
    """Block checksums (xxh3-64) as little-endian uint64s, in block order."""
    return np.fromiter(checksums, dtype=CHECKSUM_DTYPE).tobytes()


def unpack_checksums(packed: bytes) -> list[int]:
    """The checksums :func:`pack_checksums` packed (a torn array is ``ValueError``)."""
    if len(packed) % CHECKSUM_BYTES:
        raise ValueError(f"{len(packed)} bytes of checksums, not a multiple of "
                         f"{CHECKSUM_BYTES}")
    return np.frombuffer(packed, dtype=CHECKSUM_DTYPE).tolist()


def split_hashes(data: bytes) -> list[bytes]:
    """Concatenated block hashes → a list of ``HASH_BYTES`` digests."""
    try:
        _check_hash_width(data)
    except ValueError as e:
        raise MalformedMessage(str(e)) from None
    return [data[i:i + HASH_BYTES] for i in range(0, len(data), HASH_BYTES)]


def join_hashes(hashes: list[bytes]) -> bytes:
    """A list of block hashes → their concatenation (the wire form)."""
    if any(len(h) != HASH_BYTES for h in hashes):
        raise ValueError(f"every block hash must be {HASH_BYTES} bytes")
    return b"".join(hashes)
