"""Typed settings for every CPD process, loaded from defaults, a TOML file, the
environment and command-line overrides (later sources win).

* File: ``--config PATH`` or ``CPD_CONFIG=PATH``; TOML with one table per section.
* Environment: ``CPD_<SECTION>__<FIELD>`` (e.g. ``CPD_NATS__SERVERS``, ``CPD_CACHE__BLOCK_SIZE``).
* Overrides: ``section.field=value`` strings (the CLI's ``--set``).

Everything is validated at load; a bad value raises :class:`cpd.protocol.errors.ConfigError`
naming the setting and where it came from.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import socket
import tomllib
from collections.abc import Iterable, Mapping
from pathlib import Path
from types import UnionType
from typing import Annotated, Any, Literal, Union, get_args, get_origin

import msgspec

from cpd.ops.cpuset import parse_cpu_list
from cpd.protocol.errors import ConfigError
from cpd.protocol.roles import WORKER_ROLES, Role
from cpd.sim.analysis import DEFAULT_TTFT_SLO_S
from cpd.sim.costmodel import DEFAULT_PRESET, PRESETS

ENV_PREFIX = "CPD_"
_NODE_ID = r"^[A-Za-z0-9_-]{1,64}\Z"

Positive = Annotated[float, msgspec.Meta(gt=0)]
PositiveInt = Annotated[int, msgspec.Meta(gt=0)]
Port = Annotated[int, msgspec.Meta(ge=0, le=65535)]


class _Section(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    pass


class NatsSettings(_Section):
    """How to reach NATS (and, for the embedded default, how to start it)."""

    # Seed URLs of the NATS deployment: one server, or several members of a cluster (the
    # client learns the others from the server and fails over between them). From the
    # environment or ``--set``: comma-separated.
    servers: list[str] = msgspec.field(default_factory=lambda: ["nats://127.0.0.1:4222"])
    user: str = ""
    password: str = ""
    creds_file: str = ""
    connect_timeout_s: Positive = 5.0
    reconnect_wait_s: Positive = 0.5
    # -1: reconnect forever; a serving process should outlive a NATS restart.
    max_reconnect_attempts: int = -1
    drain_timeout_s: Positive = 10.0
    # Embedded server (cpd up / tests): data dir for JetStream, port 0 = pick a free one.
    embedded_port: Port = 4222
    embedded_store_dir: str = "~/.cache/cpd/nats"
    # Least privilege (``cpd up --secure``, ``cpd secure init``; cpd.ops.security): this
    # process's identity. ``password_file`` is read instead of ``password`` when set;
    # ``nkey_seed_file`` holds an nkey user seed (``SU...``) and replaces user/password.
    password_file: str = ""
    nkey_seed_file: str = ""
    # TLS: the CA that signed the server's certificate (turns TLS on), and this client's
    # own certificate and key when the server verifies clients (mutual TLS).
    tls_ca_file: str = ""
    tls_cert_file: str = ""
    tls_key_file: str = ""
    # Request/reply inbox prefix; each identity is only allowed to read under its own.
    # Empty: NATS's default ``_INBOX``.
    inbox_prefix: str = ""
    # Where `cpd up --secure` keeps the generated credentials, CA and certificates.
    secrets_dir: str = "~/.cache/cpd/secrets"


class BusSettings(_Section):
    """Message-size and timing rules of the bus."""

    # The server counts headers too; docs/architecture.md, "Subjects" caps a message at ~900 KiB in
    # all.
    max_message_bytes: Annotated[int, msgspec.Meta(ge=1024, le=64 * 1024 * 1024)] = 900 * 1024
    request_timeout_s: Positive = 5.0
    # Gap allowed between two messages of one streamed reply before the stream is declared dead.
    stream_idle_timeout_s: Positive = 30.0


class ModelSettings(_Section):
    """The model every engine serves; ``preset`` names a locally built model."""

    preset: Literal["tiny", "small"] = "tiny"
    # Where built models live; one sub-folder per preset and build-recipe version.
    cache_dir: str = "~/.cache/cpd/models"
    # Explicit model folder (a real checkpoint); overrides the preset when set.
    path: str = ""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    # The weights' revision in the cache namespace (docs/architecture.md, "Block
    # identity"). Empty: a fingerprint of the folder's weight files, which each node
    # computes from its copy; set it (the same everywhere) where a node has the
    # tokenizer but not the weights, or to name a revision explicitly.
    revision: str = ""


class CacheSettings(_Section):
    """Block identity and the tenant salt (docs/architecture.md, "Block identity")."""

    block_size: Annotated[int, msgspec.Meta(ge=16, le=65536)] = 256
    # Salts this deployment's base namespace: two deployments sharing NATS and kvindex
    # (or a kvindex snapshot) with different salts never match each other's blocks.
    tenant_salt: str = ""
    adapter_id: str = ""


class TelemetrySettings(_Section):
    """Logs, traces and metrics."""

    log_level: Literal["debug", "info", "warning", "error"] = "info"
    log_json: bool = True
    # OTLP/HTTP endpoint for spans; empty keeps spans in-process (still propagated).
    otlp_endpoint: str = ""
    # Prometheus scrape port for this process; 0 disables the exporter.
    prometheus_port: Port = 0


class NodeSettings(_Section):
    """Identity of this process."""

    node_id: Annotated[str, msgspec.Meta(pattern=_NODE_ID)] = ""
    heartbeat_interval_s: Positive = 1.0
    lease_ttl_s: Positive = 5.0


class AdmissionSettings(_Section):
    """Router admission control (docs/architecture.md, "Routing")."""

    max_inflight: PositiveInt = 24
    max_queue: Annotated[int, msgspec.Meta(ge=0)] = 64
    default_deadline_s: Positive = 300.0


class RouterSettings(_Section):
    """The router: routing policy, its cost seeds, lookups and failover (docs/architecture.md,
    "Routing")."""

    # cpd: cache-aware tiers; pd-kv: KV-aware cost like Dynamo/llm-d; pd-rr: round-robin.
    policy: Literal["cpd", "pd-kv", "pd-rr"] = "cpd"
    # A kvindex answer later than this counts as a miss (never wait on a slow index).
    lookup_timeout_ms: Annotated[float, msgspec.Meta(gt=0)] = 100.0
    # kvindex counts as unavailable (status, readiness) after this many lookups in a row
    # missed their deadline; fewer is "slow". No responders is unavailable at once.
    kvindex_down_after_misses: Annotated[int, msgspec.Meta(ge=1)] = 3
    # An answer from kvindex more CPD_KV events behind than this is used as a miss.
    kvindex_max_lag_events: Annotated[int, msgspec.Meta(ge=0)] = 10_000
    # Reuse below this share of the prompt, or below this many tokens, makes it cold.
    cold_reuse_ratio: Annotated[float, msgspec.Meta(ge=0.0, le=1.0)] = 0.5
    min_reuse_tokens: Annotated[int, msgspec.Meta(ge=0)] = 256
    # Work moves across tiers only when that finishes sooner by more than this.
    overflow_margin_ms: Annotated[float, msgspec.Meta(ge=0)] = 100.0
    # A warm request whose prefix an idle pre-prefill node holds itself (in its engine's
    # cache or its DRAM) is served there when that is sooner than on any prefill node:
    # no transfer, and that tier had nothing to do.
    warm_on_idle_preprefill: bool = True
    # The elastic prefill/decode boundary (services/router/elastic.py): once the least
    # loaded decode node holds this many requests, a request whose prefill node also
    # decodes (worker.serve_decode) and holds fewer keeps its decode there. 0: never.
    decode_lend_at: Annotated[int, msgspec.Meta(ge=0)] = 0
    # Transfer bandwidth assumed until a worker reports a measured one (GB/s).
    default_bandwidth_gbps: Positive = 1.0
    # A node loading from its own DRAM into its engine (GB/s).
    host_bandwidth_gbps: Positive = 8.0
    # A node reading blocks from its disk tier (dataplane.disk_dir) into its arena (GB/s),
    # until it reports a measured read rate: a prefix held only on disk is loaded when
    # that beats recomputing it.
    disk_bandwidth_gbps: Positive = 2.0
    # Fixed cost of one peer transfer besides its bytes (ms): the request and reply
    # header round trip, the slot bookkeeping and the lifecycle events (2-7 ms measured
    # per pull on a two-core host; docs/architecture.md, "Routing").
    transfer_fixed_ms: Annotated[float, msgspec.Meta(ge=0)] = 5.0
    single_flight: bool = True
    max_single_flight_wait_ms: Annotated[float, msgspec.Meta(ge=0)] = 30_000.0
    # A KV source (peer) whose planned load failed (gone, timed out, refusing, serving
    # bytes other than sealed) is not planned again for this long, doubled on each failure
    # in a row up to a minute; then one request tries it (services/router/breaker.py).
    source_breaker_s: Positive = 2.0
    # Prefill cost seeds (ms): fixed + per token + per token x context (docs/architecture.md,
    # "Routing").
    prefill_fixed_ms: Annotated[float, msgspec.Meta(ge=0)] = 5.0
    prefill_per_token_ms: Annotated[float, msgspec.Meta(ge=0)] = 0.25
    prefill_per_token_ctx_ms: Annotated[float, msgspec.Meta(ge=0)] = 1e-6
    # Tries of one request across nodes: a refused dispatch or a node lost mid-stream
    # moves the request to another node while nothing (or only reproducible greedy
    # output) was sent to the client.
    max_attempts: Annotated[int, msgspec.Meta(ge=1, le=10)] = 3
    # How long a worker has to accept a dispatched request.
    dispatch_timeout_s: Positive = 5.0
    # How often a streaming request checks that its prefill and decode nodes are alive.
    liveness_check_interval_s: Positive = 0.25
    # A client stream silent this long gets a keep-alive (an empty TokenChunk), so a
    # client notices a dead router long before its deadline (docs/reliability.md).
    keepalive_interval_s: Positive = 1.0
    # A client fails a stream with a typed, retryable RouterGone after this many
    # keep-alive intervals without any message from its router.
    keepalive_misses: Annotated[int, msgspec.Meta(ge=1, le=100)] = 3
    # Every this many seconds a client stream's keep-alive goes out as a request, so that
    # NATS says when nothing subscribes to its inbox any more (its gateway or client
    # died without a word); after reader_check_misses such answers in a row the router
    # ends the request and its nodes' work. Two checks apart outlast a client's NATS
    # reconnect, during which its inbox is briefly without a subscriber. 0: never.
    reader_check_interval_s: Annotated[float, msgspec.Meta(ge=0)] = 5.0
    reader_check_misses: Annotated[int, msgspec.Meta(ge=1, le=100)] = 2
    # Bytes of recent prompts (token ids and block hashes) the router keeps to reuse
    # their block hashes when a later prompt starts with them (multi-turn chat, coding
    # agents); 64 MiB holds ~130 prompts of 128K tokens. 0 hashes every prompt afresh.
    hash_memo_bytes: Annotated[int, msgspec.Meta(ge=0)] = 64 * 2**20


class TenantSettings(_Section):
    """One tenant of the gateway (``[gateway.tenants.<name>]``): its API keys and limits.

    The tenant's name goes into every request (``GenerateRequest.tenant``), so its KV
    blocks live in a namespace of its own (docs/architecture.md, "Block identity"). A limit
of 0 means "none".
    """

    # SHA-256 hex digests of the tenant's API keys (``cpd.ops.config.api_key_digest``), never
    # the keys themselves: a leaked config file leaks no key.
    api_key_sha256: list[str] = msgspec.field(default_factory=list)
    # Prompt tokens of one request (on top of the model's own limit).
    max_prompt_tokens: Annotated[int, msgspec.Meta(ge=0)] = 0
    # Bytes of one HTTP request body.
    max_request_bytes: Annotated[int, msgspec.Meta(ge=0)] = 0
    # Cap of max_tokens: a larger explicit value is refused, a default is clamped.
    max_tokens: Annotated[int, msgspec.Meta(ge=0)] = 0
    # Token bucket: sustained requests per second and how many may come at once.
    rate_per_s: Annotated[float, msgspec.Meta(ge=0)] = 0.0
    burst: Annotated[int, msgspec.Meta(ge=1)] = 1

    def __post_init__(self) -> None:
        for digest in self.api_key_sha256:
            if not _SHA256_HEX.match(digest):
                raise ValueError(f"api_key_sha256 entry {digest[:8]!r}... is not a "
                                 "64-digit lowercase SHA-256 hex digest")


_SHA256_HEX = re.compile(r"^[0-9a-f]{64}\Z")
_TENANT_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}\Z")


def api_key_digest(key: str) -> str:
    """The SHA-256 hex digest of an API key, as ``api_key_sha256`` stores it."""
    return hashlib.sha256(key.encode()).hexdigest()


class GatewaySettings(_Section):
    """The OpenAI-compatible HTTP gateway."""

    host: str = "127.0.0.1"
    port: Port = 8000
    # The model name clients use; empty: "cpd-<model.preset>".
    served_model_name: str = ""
    # Deadline of one HTTP request when the body sets none.
    request_timeout_s: Positive = 300.0
    # A streamed reply whose first message has not come after stream_headers_after_s
    # gets its headers then (an error before it keeps its HTTP status), and a chunk with
    # no choices every sse_keepalive_s until it comes: a cold 100K-token prompt queued for
    # minutes must not outlast a proxy's idle timeout.
    stream_headers_after_s: Annotated[float, msgspec.Meta(ge=0.0)] = 0.5
    sse_keepalive_s: Positive = 10.0
    # A prompt of at most this many characters is tokenized on the event loop (a
    # 1K-token prompt takes about a millisecond, as much as a hop to a thread and back);
    # a longer one on a thread, so the loop goes on relaying other streams' tokens
    # meanwhile. 0: always on a thread.
    tokenize_inline_chars: Annotated[int, msgspec.Meta(ge=0)] = 8192
    # API keys and per-tenant limits. Empty: no authentication, every request is the
    # "default" tenant's (a local cluster); set, every request needs a tenant's key
    # (``Authorization: Bearer <key>``).
    tenants: dict[str, TenantSettings] = msgspec.field(default_factory=dict)

    def __post_init__(self) -> None:
        owner: dict[str, str] = {}
        for name, tenant in self.tenants.items():
            if not _TENANT_NAME.match(name):
                raise ValueError(f"gateway.tenants: bad tenant name {name!r} "
                                 "(letters, digits, _ . -; at most 64)")
            for digest in tenant.api_key_sha256:
                if digest in owner:
                    raise ValueError(f"gateway.tenants: one API key belongs to both "
                                     f"{owner[digest]!r} and {name!r}")
                owner[digest] = name


class FrontendSettings(_Section):
    """The front-end process (``services.frontend``): the gateway and the router in one
    process, which reach each other without NATS."""

    # Host a kvindex replica there too: the router's lookups then stay in the process.
    # Off where the index runs apart (its own replicas on other machines).
    kvindex: bool = True


class KvIndexSettings(_Section):
    """kvindex: durability and lease enforcement (docs/architecture.md, "Lifecycle and
    visibility")."""

    # Snapshots bound replay time after a crash; one file per replica.
    snapshot_dir: str = "~/.cache/cpd/kvindex"
    snapshot_interval_s: Positive = 30.0
    lease_sweep_interval_s: Positive = 0.25
    # Retention of the CPD_KV stream; older events are covered by snapshots/re-announce.
    stream_max_age_s: Positive = 24 * 3600.0
    stream_max_bytes: Annotated[int, msgspec.Meta(ge=1 << 20)] = 8 << 30
    # Copies JetStream keeps of the CPD_KV stream: 1 on one server; 3 on a NATS cluster
    # of three or more, so that losing one server loses no block event (JetStream needs
    # a majority of the replicas up to accept a write). Applied to an existing stream too.
    stream_replicas: Annotated[int, msgspec.Meta(ge=1, le=5)] = 1
    # Longest chain one lookup may ask about (~2M tokens at 256 tokens per block).
    max_lookup_blocks: PositiveInt = 8192
    # Idle heartbeat of the CPD_KV consumer. nats-py recreates an ordered consumer (from
    # the last applied event) after two missed heartbeats; a NATS restart loses the
    # consumer, so this bounds how long kvindex goes without events (nats-py's default
    # of 5 s meant 10-20 s of a stale index after a restart; docs/reliability.md).
    consumer_heartbeat_s: Annotated[float, msgspec.Meta(ge=0.1, le=30.0)] = 1.0
    # How often kvindex checks that CPD_KV is the stream it has been reading (not one
    # recreated since, whose events start again at 1; the index is then rebuilt).
    stream_check_interval_s: Positive = 5.0


EvictionName = Literal["lru", "tinylfu"]
"""The block arena's eviction policies (``dataplane.eviction``; cpd.kvstore.eviction)."""

DecodeCopiesFirst = Literal["always", "never", "adaptive"]
"""``dataplane.decode_copies_first``: a decode arena evicts copies first always, never, or
unless a try shows that lookups do not miss what it would lose (cpd.kvstore.copiesgate)."""


class DataPlaneSettings(_Section):
    """Host-DRAM block store and UCX transfers between workers (docs/architecture.md, "KV tiers and
    the data plane")."""

    # Preallocated block arena of this worker (host DRAM); its slots are reused forever.
    arena_bytes: Annotated[int, msgspec.Meta(ge=1 << 16)] = 1 << 30
    # Which sealed, unpinned, childless block the arena evicts first (cpd.kvstore.eviction):
    # "tinylfu" is LRU with frequency admission, which keeps part of a cyclic revisit of
    # more sessions than fit (LRU keeps none) and a hot set through a one-off scan;
    # "lru" is least recently used (docs/architecture.md, "KV tiers and the data plane").
    eviction: EvictionName = "tinylfu"
    # Whether a decode worker's arena, like a prefill-side worker's, evicts blocks with a
    # copy elsewhere before its policy's victims. "always": the cluster's arenas pool
    # their capacity fully (more of a working set larger than the arenas is reused);
    # "never": a decode arena keeps its sessions' earlier turns by its policy, so their
    # next hand-offs pull less, which pays where the pool holds the working set anyway;
    # "adaptive": copies first, tried off while lookups ask for almost none of the blocks
    # the cluster lost and back on once they ask for more than one per hand-off
    # (cpd.kvstore.copiesgate, docs/plan.md "Decode arenas").
    decode_copies_first: DecodeCopiesFirst = "adaptive"
    # Bytes of one cache block (one arena slot). 0 derives it from the model:
    # layers × (K, V) × cache.block_size × KV heads × head dim × dtype size.
    block_bytes: Annotated[int, msgspec.Meta(ge=0)] = 0
    # The listener accepts on every interface; peers reach it at advertise_host:listen_port
    # (what goes into the heartbeat). Port 0 lets the OS pick.
    advertise_host: str = "127.0.0.1"
    # Network interface (e.g. the cluster network's NIC) whose IPv4 address is advertised
    # instead of advertise_host; UCX's TCP transport then uses that interface alone
    # unless ucx_net_devices says otherwise.
    advertise_interface: str = ""
    listen_port: Port = 0
    # Transfers in flight at once: as a client (all peers together) and as a server.
    max_concurrent_transfers: PositiveInt = 8
    max_server_transfers: PositiveInt = 16
    # Largest batch of one exchange; bounds the preallocated header buffers.
    max_blocks_per_transfer: Annotated[int, msgspec.Meta(ge=1, le=65536)] = 1024
    # This worker's gets ask for consecutive blocks whose landing slot is smaller than this
    # to travel as one UCX message per run (copied through staging buffers on both sides):
    # each message costs tens of µs of Python per side, more than copying a small block.
    # Larger blocks keep a zero-copy message each. 0: one message per block, as builds
    # before coalescing do (a peer of such a build fails coalesced gets: MalformedMessage).
    coalesce_below_bytes: Annotated[int, msgspec.Meta(ge=0, le=1 << 30)] = 256 << 10
    # Largest coalesced message; sizes the staging buffers, preallocated per permit (client:
    # 2 × max_concurrent_transfers, server: max_server_transfers), pages mapped on first
    # use. A server refuses (InvalidRequest) runs larger than its own, all of them at 0,
    # so keep it equal on every worker. 0 also turns this worker's own coalescing off.
    coalesce_message_bytes: Annotated[int, msgspec.Meta(ge=0, le=1 << 30)] = 4 << 20
    # Deadline of one transfer when the caller gives none; a paused peer is only ever
    # detected by it.
    transfer_timeout_s: Positive = 10.0
    # One connection handshake; attempts repeat until the transfer's deadline.
    connect_timeout_s: Positive = 2.0
    # Workers dial each peer they may pull from connect_ahead_delay_s after its first
    # heartbeat, one peer at a time, one handshake each, so a first warm request does not
    # pay the handshake (docs/architecture.md, "KV tiers and the data plane"); a dial that
    # fails is left to the transfer that needs it.
    connect_ahead: bool = True
    connect_ahead_delay_s: Annotated[float, msgspec.Meta(ge=0.0)] = 0.25
    # How long aborting an endpoint may wait for UCX to tear it down.
    abort_wait_s: Positive = 0.1
    # Default lease of blocks pinned for a pull (until the puller acks or it expires).
    pin_ttl_s: Positive = 60.0
    lease_sweep_interval_s: Positive = 1.0
    # UCX transports; tcp is mandatory (connection manager, cross-host). posix shared memory
    # is the fastest same-host path that keeps peer-failure detection (docs/benchmarks/transfer.md).
    ucx_tls: str = "tcp,posix"
    # UCX_NET_DEVICES: the NICs (e.g. "eth1", "mlx5_0:1" for RDMA) UCX may use; empty:
    # advertise_interface when set, else every device UCX finds.
    ucx_net_devices: str = ""
    # posix/sysv only advertise peer-failure handling when asked; without it UCX silently
    # drops them from error-handling endpoints and falls back to TCP loopback.
    ucx_shm_error_handling: bool = True
    # ucxx defaults rendezvous staging buffers to CUDA memory; the arena is host memory.
    ucx_rndv_frag_mem_type: Literal["host", "cuda"] = "host"
    # "blocking": UCX progresses on the event loop (cpd.transfer re-arms it correctly and
    # lets idle connections sleep); fastest and the only mode whose peer-failure tests are
    # stable here. "thread": UCX in its own thread, but reconnects after a peer died
    # mid-transfer can stall (docs/benchmarks/transfer.md).
    ucx_progress_mode: Literal["blocking", "thread", "thread-polling", "polling"] = "blocking"
    # Measured-bandwidth estimate (EWMA); transfers smaller than the minimum measure latency.
    bandwidth_ewma_alpha: Annotated[float, msgspec.Meta(gt=0.0, le=1.0)] = 0.2
    bandwidth_min_bytes: Annotated[int, msgspec.Meta(ge=0)] = 1 << 20
    # With no transfer measured for this long the estimate is unknown again (the router
    # prices loads at its default until the next transfer measures); 0: never.
    bandwidth_max_age_s: Annotated[float, msgspec.Meta(ge=0.0)] = 60.0
    # Port peers are told to connect to (in the heartbeat) when it differs from the
    # listener's, e.g. behind a forwarder; 0: the listener's own port.
    advertise_port: Port = 0
    # Local disk tier below the arena (cpd.kvstore.disk): every sealed block is written
    # behind to a file under <disk_dir>/<node id>, read back into the arena when a reader
    # needs it, and announced again after a restart. Empty: no disk tier.
    disk_dir: str = ""
    # The tier's capacity; it evicts by dataplane.eviction like the arena.
    disk_bytes: Annotated[int, msgspec.Meta(ge=0)] = 16 << 30
    # fsync each block file before naming it: blocks survive a power loss, at a cost per
    # write. Without it a crash of the machine may lose recent blocks, never serve them torn.
    disk_fsync: bool = False

    def __post_init__(self) -> None:
        if "tcp" not in [t.strip() for t in self.ucx_tls.split(",")]:
            raise ValueError("dataplane.ucx_tls must include tcp")


class WorkerSettings(_Section):
    """Pre-prefill, prefill and decode workers (docs/architecture.md, "Services")."""

    # The block arena is a shared-memory file the engine's KV connector maps too.
    arena_dir: str = "/dev/shm"
    # vLLM-CPU's own paged KV cache (GiB; VLLM_CPU_KVCACHE_SPACE).
    engine_kv_cache_gib: PositiveInt = 1
    load_report_interval_s: Positive = 0.15
    # How long the prefill side waits for a decode node to accept a hand-off.
    handoff_timeout_s: Positive = 5.0
    # A pre-prefill or prefill worker also serves decode hand-offs (its own requests'
    # decode, no transfer), announced in its heartbeats; the router lends it decode
    # work when the decode pool is saturated (router.decode_lend_at).
    serve_decode: bool = False
    # Requests a worker holds (running or queued) before it refuses more as overloaded.
    max_queued_requests: PositiveInt = 64
    # The role `python -m services.worker` runs; `python -m services.preprefill`, `.prefill`
    # and `.decode` run their own.
    role: str = ""
    # vllm: the real engine on the model of [model]; sim: the simulated engine of [sim]
    # (docs/architecture.md, "Engines"), same worker, same data plane, no model files.
    engine: Literal["vllm", "sim"] = "vllm"
    # Folder of the block audit trail (cpd.ops.audit: every block served, pulled, loaded, one
    # JSONL file per node), the fault harness's evidence; empty: off.
    audit_dir: str = ""
    # Decode streams generated tokens in messages of this many (vLLM's stream_interval;
    # the last message may be shorter). 1 sends every token at once; larger values cut
    # the per-token message cost on every hop (decode -> router -> client).
    stream_interval: Annotated[int, msgspec.Meta(ge=1, le=1024)] = 1
    # A prefill node samples up to this many tokens before the hand-off while its tokens
    # end inside a character (byte-level tokens of CJK text, emoji, a small model's
    # first tokens): the client's first text then comes from the prefill engine's next
    # step, not from the decode node after the hand-off. 1: hand off after the first
    # token always. Only for models with a tokenizer (the sim engine has none).
    first_text_tokens: Annotated[int, msgspec.Meta(ge=1, le=16)] = 4
    # vLLM's long_prefill_token_threshold, for either engine: while other requests are
    # running or waiting, no prefill computes more than this many tokens per step, so a
    # long cold prompt leaves step budget for the short warm suffixes behind it (0: off,
    # vLLM's default: a running prefill takes the whole budget until it is done).
    long_prefill_token_threshold: Annotated[int, msgspec.Meta(ge=0)] = 0
    # Which engines load arena KV off the step, for either engine: the request waits for
    # its KV (vLLM's WAITING_FOR_REMOTE_KVS; the sim's KV link) while the batch keeps
    # stepping, instead of the copy stalling the step that first schedules it. "decode":
    # decode workers, whose prompts arrive whole while they decode (as every P/D
    # framework receives KV); "all": prefill tiers too; "none": every load in the step.
    async_kv_load: Literal["none", "decode", "all"] = "decode"
    # Touch every page of the block arena at start, so that no transfer or write-through
    # pays the first-write page faults of fresh shared memory (costs ~1 s per GiB once).
    prefault_arena: bool = True
    # How a vLLM engine runs its model. "uni": in the engine-core process, which waits on
    # a socket while idle; "mp": in a worker process of its own (vLLM-CPU's default), fed
    # through a shared-memory ring whose readers spin for a second after every message
    # (docs/architecture.md, "Engines": several engines on one host stall each other).
    engine_executor: Literal["uni", "mp"] = "uni"
    # OpenMP threads of the engine's model (0: one per CPU in engine_cpus, else per CPU
    # this process may use). `cpd up` sets it per engine from the cores it has.
    engine_threads: Annotated[int, msgspec.Meta(ge=0, le=4096)] = 0
    # CPUs the engine's OpenMP threads are bound to, as "0-3" or "0,2,4" (empty: unbound).
    engine_cpus: str = ""
    # Scheduling niceness of the engine's processes (0: as this process). CPU engines'
    # OpenMP threads spin while they wait; at a lower priority they yield their cores to
    # control work on the same host (kvindex lookups, the router, this worker's NATS and
    # data plane), which otherwise misses its deadlines whenever the engines are busy.
    engine_nice: Annotated[int, msgspec.Meta(ge=0, le=19)] = 10
    # Start on a vLLM other than the minor version CPD's connector is tested against
    # (cpd.engines.vllm.version): its internals may differ, so this is at your own risk.
    allow_untested_vllm: bool = False

    def __post_init__(self) -> None:
        if self.role and self.role not in WORKER_ROLES:
            raise ValueError(f"worker.role {self.role!r} is not one of "
                             f"{', '.join(WORKER_ROLES)}")
        parse_cpu_list(self.engine_cpus)  # a bad list fails at load, not in the engine

    def loads_async(self, role: str) -> bool:
        """Whether a worker of ``role`` loads arena KV off the engine step."""
        return self.async_kv_load == "all" or (self.async_kv_load == "decode"
                                               and role == Role.DECODE)


ENGINE_MANAGED_ARGS = frozenset({
    "model", "tokenizer", "dtype", "block_size", "enable_prefix_caching",
    "kv_transfer_config", "kv_events_config", "distributed_executor_backend",
    "long_prefill_token_threshold", "disable_log_stats", "seed", "kv_cache_dtype",
    "tensor_parallel_size", "pipeline_parallel_size"})
"""vLLM engine arguments CPD sets itself (the model, its KV layout, its ranks and the
connector): ``engine.extra_args`` may not name them."""


class EngineSettings(_Section):
    """How every vLLM engine runs its model: vLLM's engine arguments of the same names
    (docs/architecture.md, "Engines"). The defaults serve the local model on CPU; on GPUs
    raise ``gpu_memory_utilization`` (0.9 is vLLM's own default). ``[engine_preprefill]``,
    ``[engine_prefill]`` and ``[engine_decode]`` override single fields for one role."""

    # Ranks of one engine: tensor parallel (each rank holds a share of every layer's
    # heads) and pipeline parallel (each stage a share of the layers). A KV block holds
    # the whole model either way, so nodes of different sizes share blocks (e.g. TP=4
    # prefill nodes, TP=1 decode nodes). On CPU each rank takes one share of
    # worker.engine_cpus.
    tensor_parallel_size: Annotated[int, msgspec.Meta(ge=1, le=64)] = 1
    pipeline_parallel_size: Annotated[int, msgspec.Meta(ge=1, le=64)] = 1
    # The KV cache's element type ("auto": the model's dtype; "fp8", "fp8_e4m3",
    # "fp8_e5m2" halve or quarter it). It is part of every block's identity, so all roles
    # must use the same.
    kv_cache_dtype: Literal["auto", "fp8", "fp8_e4m3", "fp8_e5m2", "bfloat16",
                            "float16"] = "auto"
    # Share of device memory an engine may take (weights, activations, its KV cache). On
    # CPU, vLLM-CPU sizes its KV cache from worker.engine_kv_cache_gib instead.
    gpu_memory_utilization: Annotated[float, msgspec.Meta(gt=0, le=1)] = 0.15
    # The context an engine serves (0: the model's own, from its config).
    max_model_len: Annotated[int, msgspec.Meta(ge=0)] = 0
    # Requests an engine runs at once, and tokens per step (0: vLLM's defaults).
    max_num_seqs: Annotated[int, msgspec.Meta(ge=0)] = 0
    max_num_batched_tokens: Annotated[int, msgspec.Meta(ge=0)] = 0
    # Eager PyTorch instead of CUDA graphs (faster start, slower decode on GPUs).
    enforce_eager: bool = False
    # A quantization method vLLM knows for the checkpoint ("": the checkpoint's own).
    quantization: str = ""
    # Any other vLLM engine argument, by name (a JSON object in the environment or --set).
    extra_args: dict[str, Any] = msgspec.field(default_factory=dict)

    def __post_init__(self) -> None:
        managed = sorted(set(self.extra_args) & ENGINE_MANAGED_ARGS)
        if managed:
            raise ValueError(f"engine.extra_args may not set {', '.join(managed)}: CPD sets "
                             "them from [model], [cache], [worker] and [engine]'s own "
                             "fields")

    @property
    def ranks(self) -> int:
        """Processes (and, on CPU, core groups) of one engine."""
        return self.tensor_parallel_size * self.pipeline_parallel_size

    def vllm_args(self) -> dict[str, Any]:
        """The arguments to pass to vLLM's ``AsyncEngineArgs`` (unset ones left out)."""
        unless_unset = {"max_model_len": self.max_model_len, "max_num_seqs": self.max_num_seqs,
                        "max_num_batched_tokens": self.max_num_batched_tokens,
                        "quantization": self.quantization}
        return {"gpu_memory_utilization": self.gpu_memory_utilization,
                "enforce_eager": self.enforce_eager, "kv_cache_dtype": self.kv_cache_dtype,
                "tensor_parallel_size": self.tensor_parallel_size,
                "pipeline_parallel_size": self.pipeline_parallel_size,
                **{k: v for k, v in unless_unset.items() if v}, **self.extra_args}


EngineOverrides = msgspec.defstruct(
    "EngineOverrides",
    [(f.name, f.type | None, None) for f in msgspec.structs.fields(EngineSettings)],
    bases=(_Section,), kw_only=True, forbid_unknown_fields=True)
"""One role's ``[engine_<role>]`` section: the fields of :class:`EngineSettings` it sets
(the others come from ``[engine]``)."""


class SimSettings(_Section):
    """The simulated engine (``worker.engine = "sim"``; docs/sim.md). The router reads
    it too: namespace, length limit and prefill cost seeds follow the preset."""

    # Cost preset (cpd.sim.costmodel.PRESETS) of prefill-side workers; decode workers use
    # decode_preset when set (the paper's decode node is data parallel).
    preset: str = DEFAULT_PRESET
    decode_preset: str = ""
    # Simulated seconds per wall second (2.0: a step of 10 ms takes 5 ms of wall time).
    time_scale: Positive = 1.0
    # Arena slots hold the modelled KV bytes of a block divided by this (32 MiB -> 4 KiB
    # for the 8B preset): real bytes over the real data plane, at a size this host moves.
    kv_scale_down: PositiveInt = 8192
    # Wall seconds the host may fall behind between two steps before its lag counts as
    # simulated time (the host, not the modelled GPU, is then the bottleneck).
    host_slack_s: Annotated[float, msgspec.Meta(ge=0)] = 0.005
    max_model_len: PositiveInt = 262_144
    vocab_size: PositiveInt = 32_000
    # The engine's own prefix cache in blocks; 0 derives it from the preset's GPU memory.
    gpu_cache_blocks: Annotated[int, msgspec.Meta(ge=0)] = 0
    max_num_batched_tokens: PositiveInt = 8192
    max_num_seqs: PositiveInt = 256
    # Sustainable load needs TTFT p90 within this (client queue included). The paper does
    # not publish its SLO; `cpd bench sweep` reports its keys at 2 s and at 3 s as well
    # (3 s: the analytic 2P1D saturation at the paper's 0.75-0.8 QPS/GPU, docs/sim.md).
    ttft_slo_s: Positive = DEFAULT_TTFT_SLO_S

    def __post_init__(self) -> None:
        for name in (self.preset, self.decode_preset or self.preset):
            if name not in PRESETS:
                raise ValueError(f"sim preset {name!r} is unknown; known: {sorted(PRESETS)}")


class Settings(_Section):
    """All settings of a CPD process."""

    nats: NatsSettings = msgspec.field(default_factory=NatsSettings)
    bus: BusSettings = msgspec.field(default_factory=BusSettings)
    model: ModelSettings = msgspec.field(default_factory=ModelSettings)
    cache: CacheSettings = msgspec.field(default_factory=CacheSettings)
    telemetry: TelemetrySettings = msgspec.field(default_factory=TelemetrySettings)
    node: NodeSettings = msgspec.field(default_factory=NodeSettings)
    admission: AdmissionSettings = msgspec.field(default_factory=AdmissionSettings)
    dataplane: DataPlaneSettings = msgspec.field(default_factory=DataPlaneSettings)
    kvindex: KvIndexSettings = msgspec.field(default_factory=KvIndexSettings)
    router: RouterSettings = msgspec.field(default_factory=RouterSettings)
    gateway: GatewaySettings = msgspec.field(default_factory=GatewaySettings)
    frontend: FrontendSettings = msgspec.field(default_factory=FrontendSettings)
    worker: WorkerSettings = msgspec.field(default_factory=WorkerSettings)
    engine: EngineSettings = msgspec.field(default_factory=EngineSettings)
    engine_preprefill: EngineOverrides = msgspec.field(  # type: ignore[valid-type]
        default_factory=EngineOverrides)
    engine_prefill: EngineOverrides = msgspec.field(  # type: ignore[valid-type]
        default_factory=EngineOverrides)
    engine_decode: EngineOverrides = msgspec.field(  # type: ignore[valid-type]
        default_factory=EngineOverrides)
    sim: SimSettings = msgspec.field(default_factory=SimSettings)

    def __post_init__(self) -> None:
        if not self.nats.servers:
            raise ValueError("nats.servers must name at least one server")
        for url in self.nats.servers:
            if not re.match(r"^(nats|tls|ws|wss)://[^\s,]+\Z", url):
                raise ValueError(f"nats.servers: {url!r} is not a nats://, tls://, ws:// "
                                 "or wss:// URL")
        if not self.node.node_id:
            # Unique per process and a valid subject token.
            host = "".join(c if c.isalnum() else "-" for c in socket.gethostname())[:40]
            self.node.node_id = f"{host}-{os.getpid()}"
        if self.nats.max_reconnect_attempts < -1:
            raise ValueError("nats.max_reconnect_attempts must be -1 (forever) or >= 0")
        # A role's section is checked at load, like [engine].
        kv_dtypes = {self.engine_for(role).kv_cache_dtype for role in WORKER_ROLES}
        if len(kv_dtypes) > 1:
            raise ValueError(f"engine roles differ in kv_cache_dtype "
                             f"({', '.join(sorted(kv_dtypes))}): a block of one could not "
                             "be loaded by another; set it in [engine] only")

    @property
    def kv_dtype(self) -> str:
        """The element type of every engine's KV cache (the namespace's ``kv_dtype``)."""
        kv = self.engine.kv_cache_dtype
        return self.model.dtype if kv == "auto" else kv

    def served_context(self, model_context: int) -> int:
        """The context every worker's engine serves, for a model whose own is
        ``model_context`` (0: unknown): the smallest ``max_model_len`` any role sets."""
        limits = [n for r in WORKER_ROLES if (n := self.engine_for(r).max_model_len)]
        return min([*limits, model_context] if model_context else limits, default=0)

    def engine_for(self, role: str) -> EngineSettings:
        """The engine settings of a worker of ``role``: ``[engine]`` with the fields its
        ``[engine_<role>]`` section sets."""
        overrides = {Role.PREPREFILL: self.engine_preprefill, Role.PREFILL: self.engine_prefill,
                     Role.DECODE: self.engine_decode}[Role(role)]
        fields = {k: v for k, v in msgspec.structs.asdict(overrides).items() if v is not None}
        merged = msgspec.structs.replace(self.engine, **fields)
        merged.__post_init__()  # extra_args from the role's section are checked too
        return merged

    @property
    def model_cache_dir(self) -> Path:
        return Path(self.model.cache_dir).expanduser()


def env_var_names() -> list[str]:
    """Every environment variable the settings understand (docs, compose checks)."""
    names = ["CPD_CONFIG"]
    for section, stype in _sections().items():
        for field in msgspec.structs.fields(stype):
            names.append(f"{ENV_PREFIX}{section.upper()}__{field.name.upper()}")
    return names


def load_settings(
    config_file: str | os.PathLike[str] | None = None,
    *,
    overrides: Iterable[str] = (),
    environ: Mapping[str, str] | None = None,
) -> Settings:
    """Build validated :class:`Settings` from file, environment and ``overrides``."""
    environ = os.environ if environ is None else environ
    raw: dict[str, dict[str, Any]] = {}
    path = config_file or environ.get("CPD_CONFIG")
    if path:
        try:
            with open(path, "rb") as f:
                data = tomllib.load(f)
        except (OSError, tomllib.TOMLDecodeError) as e:
            raise ConfigError(f"cannot read config file {path}: {e}") from e
        for section, values in data.items():
            if not isinstance(values, dict):
                raise ConfigError(f"config file {path}: [{section}] must be a table")
            raw.setdefault(section, {}).update(values)
    sections = _sections()
    for key, value in environ.items():
        if not key.startswith(ENV_PREFIX) or "__" not in key:
            continue
        section, _, field = key[len(ENV_PREFIX):].partition("__")
        section, field = section.lower(), field.lower()
        if section not in sections:
            raise ConfigError(f"environment variable {key}: unknown section {section!r}")
        raw.setdefault(section, {})[field] = value
    for item in overrides:
        name, sep, value = item.partition("=")
        section, dot, field = name.strip().partition(".")
        if not sep or not dot:
            raise ConfigError(f"override {item!r} must look like section.field=value")
        raw.setdefault(section, {})[field] = value.strip()
    _split_lists(raw, sections)
    try:
        # strict=False lets "8" from the environment become the int 8.
        return msgspec.convert(raw, Settings, strict=False)
    except (msgspec.ValidationError, ValueError) as e:
        raise ConfigError(f"invalid settings: {e}") from e


def _split_lists(raw: dict[str, dict[str, Any]], sections: Mapping[str, type[_Section]]) -> None:
    """A list setting given as one string (environment, ``--set``) is comma-separated; a
    table setting (``engine.extra_args``) is a JSON object."""
    for section, values in raw.items():
        stype = sections.get(section)
        if stype is None:
            continue
        kinds = {f.name: get_origin(_unoptional(f.type)) for f in msgspec.structs.fields(stype)}
        for name, value in values.items():
            if not isinstance(value, str):
                continue
            if kinds.get(name) is list:
                values[name] = [x.strip() for x in value.split(",") if x.strip()]
            elif kinds.get(name) is dict:
                try:
                    values[name] = json.loads(value)
                except json.JSONDecodeError as e:
                    raise ConfigError(f"{section}.{name} must be a JSON object: {e}") from None


def _unoptional(t: Any) -> Any:
    """``T`` of ``T | None`` (override sections); other types as they are."""
    args = [a for a in get_args(t) if a is not type(None)]
    return args[0] if get_origin(t) in (Union, UnionType) and len(args) == 1 else t


def _sections() -> dict[str, type[_Section]]:
    return {f.name: f.type for f in msgspec.structs.fields(Settings)}
