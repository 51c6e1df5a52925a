"""``cpd bench fuzz``: hostile input against every subject a CPD service listens on
(docs/security.md). The fault bench's ``fuzz_crashes`` is this run's count.

A real cluster of processes (NATS, kvindex, router, a sim prefill and a sim decode
worker, each with its Prometheus endpoint) gets :func:`tools.fuzzing.cases` per subject:
request subjects through ``nc.request`` (every case must get a typed answer), plain
subscriptions and the ``CPD_KV`` stream through publishes, and the UCX data plane header
both in-process (the server's decoder) and over a real UCX connection to the prefill
node. After each subject: every process is alive, a real generate through the router
completes, a lookup of that prompt still answers exactly as before the fuzzing, and each
listener's ``cpd_rejected_messages_total`` rose by exactly the number of cases it had to
refuse.

A *crash* is a process that died, a service that stopped answering valid requests, a
case without a typed answer (no reply, an undecodable reply, an ``internal`` error), or
a rejection the service did not count. The tests (``tests/fuzz``) run the same driver.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import re
import shutil
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import httpx
import msgspec
import nats
import nats.errors

from cpd import transfer
from cpd.bus import BAD_INPUT, Bus
from cpd.client import Client
from cpd.engines.profile import served_model
from cpd.engines.servedmodel import ServedModel
from cpd.ops.config import Settings
from cpd.protocol import subjects, wire
from cpd.protocol.errors import CpdError, ErrorCode, NoResponders, RequestTimeout
from cpd.protocol.hashing import block_hashes
from cpd.protocol.roles import Role
from cpd.transfer import framing
from tools import fuzzing
from tools.bench.hostinfo import free_port
from tools.bench.registry import SettingsFactory
from tools.cluster import Cluster, ClusterSpec, NatsSpec, nodes_of

# The cluster: node id -> service.
NODES = {"kvi": "kvindex", "p0": "prefill", "d0": "decode", "router": "router"}
WORKERS = {"p0": "prefill", "d0": "decode"}
# The sim model's context, small enough that "past the model limit" fits in one message.
MAX_MODEL_LEN = 4096
READY_TIMEOUT_S = 120.0
# A case with no reply within this is a hang.
REPLY_TIMEOUT_S = 10.0
# Requests in flight at once (the services must keep up or answer "overloaded").
CONCURRENCY = 128
# How long a listener may take to count what was published to it.
SETTLE_TIMEOUT_S = 30.0
HEALTH_TIMEOUT_S = 30.0
HEALTH_MAX_TOKENS = 4
HEALTH_RETRY_S = 0.5
HEALTH_PROMPT_BLOCKS = 3
# Real UCX connections are slow to open after each refused header: a few hundred cases
# go over the wire, the rest of the volume through the server's decoder in-process.
UCX_WIRE_CASES = 300
STOP_TIMEOUT_S = 10.0
_METRIC = "cpd_rejected_messages_total"

Style = Literal["request", "publish", "jetstream", "ucx"]


@dataclass(frozen=True)
class Target:
    """One subject under fuzz: where cases go and which services listen there."""

    name: str
    family: str
    subject: str
    style: Style
    # Node ids whose rejection counter must rise by the cases they refuse.
    listeners: tuple[str, ...]
    # (node id, subscription subject) pairs this target exercises (coverage check).
    covers: tuple[tuple[str, str], ...]


def targets() -> list[Target]:
    """Every subject the cluster's services listen on (``tests/fuzz`` checks the NATS
    server's subscription list against this)."""
    hb = subjects.heartbeat(fuzzing.FuzzContext.fake_nodes[0])
    out = [
        Target(subjects.GENERATE, "generate", subjects.GENERATE, "request", ("router",),
               (("router", subjects.GENERATE),)),
        Target(subjects.ROUTER_STATUS, "status", subjects.ROUTER_STATUS, "request",
               ("router",), (("router", subjects.ROUTER_STATUS),)),
        Target(subjects.GENERATE_CANCEL, "cancel_generate", subjects.GENERATE_CANCEL,
               "publish", ("router",), (("router", subjects.GENERATE_CANCEL),)),
        Target(subjects.GENERATE_SUPERSEDE, "supersede_generate", subjects.GENERATE_SUPERSEDE,
               "publish", ("router",), (("router", subjects.GENERATE_SUPERSEDE),)),
        Target(subjects.KVINDEX_LOOKUP, "lookup", subjects.KVINDEX_LOOKUP, "request",
               ("kvi",), (("kvi", subjects.KVINDEX_LOOKUP),)),
        Target(subjects.KVINDEX_CHECKSUMS, "checksums", subjects.KVINDEX_CHECKSUMS, "request",
               ("kvi",), (("kvi", subjects.KVINDEX_CHECKSUMS),)),
        Target(subjects.HEARTBEAT_ALL, "heartbeat", hb, "publish",
               ("router", "kvi", *WORKERS),
               tuple((n, subjects.HEARTBEAT_ALL) for n in ("router", "kvi", *WORKERS))),
        Target(subjects.LOAD_ALL, "load", subjects.load("prefill", "fz0"), "publish",
               ("router",), (("router", subjects.LOAD_ALL),)),
        Target(subjects.KV_EVENTS_ALL, "kv_event", subjects.kv_events("fz0"), "jetstream",
               ("kvi",), (("kvi", subjects.KV_STREAM),)),
        Target(subjects.KV_VISIBLE, "visible", subjects.KV_VISIBLE, "publish", ("router",),
               (("router", subjects.KV_VISIBLE),)),
        Target(subjects.KV_INVALIDATE, "invalidated", subjects.KV_INVALIDATE, "publish",
               ("router",), (("router", subjects.KV_INVALIDATE),)),
    ]
    for node, role in WORKERS.items():
        out += [
            Target(subjects.run(role, node), role, subjects.run(role, node), "request",
                   (node,), ((node, subjects.run(role, node)),)),
            Target(subjects.admin(role, node), "reset", subjects.admin(role, node), "request",
                   (node,), ((node, subjects.admin(role, node)),)),
            Target(subjects.kv_reannounce(node), "reannounce", subjects.kv_reannounce(node),
                   "publish", (node,), ((node, subjects.kv_reannounce(node)),)),
            Target(subjects.kv_copies(node), "copies", subjects.kv_copies(node),
                   "publish", (node,), ((node, subjects.kv_copies(node)),)),
            Target(subjects.cancel(node), "cancel", subjects.cancel(node), "publish", (node,),
                   ((node, subjects.cancel(node)),)),
        ]
        if role == Role.PREFILL:
            out.append(Target(subjects.pull_ack(node), "pull_ack", subjects.pull_ack(node),
                              "publish", (node,), ((node, subjects.pull_ack(node)),)))
    out.append(Target("ucx.header", "ucx_header", "p0", "ucx", (), (("p0", "ucx"),)))
    return out


@dataclass
class Outcome:
    """What one subject's cases got."""

    cases: int = 0
    typed_errors: int = 0
    answered: int = 0  # a non-error typed reply (a valid-looking case was served)
    refused: int = 0  # over the max payload: the client refused to send it
    hangs: int = 0
    untyped: int = 0  # undecodable reply or an "internal" error (an unhandled exception)
    uncounted: int = 0  # rejections the service did not count (or counted in excess)
    crashes: int = 0
    rejected: int = 0
    codes: Counter = field(default_factory=Counter)
    # Rejections beyond the decoder's that one listener makes (e.g. bad UCX addresses).
    extra: Counter = field(default_factory=Counter)
    problems: list[str] = field(default_factory=list)

    def report(self) -> dict[str, Any]:
        return {"cases": self.cases, "typed_errors": self.typed_errors,
                "answered": self.answered, "refused": self.refused, "hangs": self.hangs,
                "untyped": self.untyped, "uncounted": self.uncounted, "crashes": self.crashes,
                "rejected": self.rejected, "codes": dict(self.codes),
                "problems": self.problems[:10]}

    @property
    def failures(self) -> int:
        return self.crashes + self.hangs + self.untyped + self.uncounted


def expected_rejection(data: bytes, kind: type[wire.Message],
                       subject: str = "") -> ErrorCode | None:
    """The code a receiver refuses ``data`` on ``subject`` with (``None``: it takes it):
    its decoder's, or, on a node's own subject, ``forged_sender`` for a message naming
    another node (or, on a load subject, another role)."""
    try:
        msg = wire.decode(data, kind)
        if subjects.sender(subject) is not None:
            wire.check_sender(subject, msg)  # type: ignore[arg-type]
    except CpdError as e:
        return e.code
    return None


# ------------------------------------------------------------------------ the cluster


class FuzzCluster:
    """NATS (with its monitoring port) and the services as processes
    (:class:`tools.cluster.Cluster`, each node with its Prometheus endpoint), and what the
    fuzzer checks them by."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.monitor_port = free_port()
        self.metrics_ports = {node: free_port() for node in NODES}
        self.cluster = Cluster(ClusterSpec(
            nodes=tuple(dataclasses.replace(n, metrics_port=self.metrics_ports[n.node_id])
                        for n in nodes_of(NODES)),
            nats=NatsSpec(extra_args=("-m", str(self.monitor_port))),
            overrides=(f"sim.max_model_len={MAX_MODEL_LEN}", "sim.time_scale=50",
                       f"dataplane.arena_bytes={64 << 20}"),
            workdir=tmp, label="fuzz", ready_timeout_s=READY_TIMEOUT_S,
            stop_timeout_s=STOP_TIMEOUT_S))
        self.settings: Settings
        self.model: ServedModel
        self.ctx: fuzzing.FuzzContext
        self.http = httpx.AsyncClient(timeout=10)
        self.health_tokens: list[int] = []
        self.baseline: wire.LookupReply | None = None

    @property
    def client(self) -> Client | None:
        return self.cluster.client

    @property
    def bus(self) -> Bus:
        return self.cluster.bus

    async def start(self) -> None:
        """The cluster serving (the router sees both workers), then the fuzz context, a
        real generate of the health prompt and its baseline lookup."""
        await self.cluster.start()
        self.settings = self.cluster.settings()
        self.model = served_model(self.settings)
        self.ctx = fuzzing.FuzzContext(
            vocab_size=self.model.vocab_size, max_model_len=self.model.max_model_len,
            block_size=self.settings.cache.block_size, namespace=self.model.namespace.id,
            max_payload=self.bus.nc.max_payload,
            max_lookup_blocks=self.settings.kvindex.max_lookup_blocks,
            max_blocks_per_transfer=self.settings.dataplane.max_blocks_per_transfer,
            namespace_spec=self.model.namespace.to_spec())
        # The health prompt: its blocks must stay visible exactly as they are.
        bs = self.settings.cache.block_size
        self.health_tokens = [(7 * i + 3) % self.model.vocab_size
                              for i in range(HEALTH_PROMPT_BLOCKS * bs + 1)]
        await self._generate_ok()
        self.baseline = await self._settled_lookup(None)

    def log_tail(self, node: str, chars: int = 3000) -> str:
        return self.cluster.log_tail(node, chars)

    async def stop(self) -> None:
        await self.cluster.stop()
        await self.http.aclose()

    # ---------------------------------------------------------------- observation

    async def subscriptions(self) -> set[tuple[str, str]]:
        """(node id, subject) of every subscription the services hold on the server,
        from its monitoring endpoint (``/connz?subs=detail``)."""
        r = await self.http.get(f"http://127.0.0.1:{self.monitor_port}/connz",
                                params={"subs": "detail", "limit": 1000})
        out = set()
        for conn in r.json().get("connections", []):
            m = re.fullmatch(r"cpd-(\w+)-(.+)", conn.get("name", ""))
            if not m or m.group(2) not in NODES:
                continue
            for sub in conn.get("subscriptions_list_detail", []):
                out.add((m.group(2), sub["subject"]))
        return out

    async def stream_consumers(self) -> int:
        """Consumers on ``CPD_KV`` (kvindex's ordered consumer)."""
        js = self.bus.nc.jetstream()
        info = await js.stream_info(subjects.KV_STREAM)
        return info.state.consumer_count

    async def rejected(self, node: str, subject: str | None = None) -> int:
        """``cpd_rejected_messages_total`` of ``node`` (for one subject label, or all)."""
        r = await self.http.get(f"http://127.0.0.1:{self.metrics_ports[node]}/metrics")
        total = 0.0
        for line in r.text.splitlines():
            if not line.startswith(_METRIC + "{"):
                continue
            labels, _, value = line.rpartition(" ")
            if subject is None or f'subject="{subject}"' in labels:
                total += float(value)
        return int(total)

    # -------------------------------------------------------------------- health

    def dead(self) -> list[str]:
        return self.cluster.dead()

    async def _generate_ok(self) -> None:
        """A real generate completes. Requests a flood got accepted may still hold the
        workers, so a retryable refusal (overloaded) is retried for HEALTH_TIMEOUT_S."""
        assert self.client is not None
        deadline = time.monotonic() + HEALTH_TIMEOUT_S
        while True:
            try:
                done = await asyncio.wait_for(self.client.generate(
                    self.health_tokens, max_tokens=HEALTH_MAX_TOKENS, temperature=0),
                    max(deadline - time.monotonic(), 1.0))
                break
            except CpdError as e:
                if not e.retryable or time.monotonic() >= deadline:
                    raise
                await asyncio.sleep(HEALTH_RETRY_S)
        if done.usage.completion_tokens != HEALTH_MAX_TOKENS:
            raise CpdError(f"health generate made {done.usage.completion_tokens} tokens, "
                           f"not {HEALTH_MAX_TOKENS}")

    def _health_lookup(self) -> wire.LookupRequest:
        ns = self.model.namespace
        return wire.LookupRequest(request_id="fuzz-health", namespace=ns.id,
                                  block_hashes=block_hashes(ns, self.health_tokens))

    async def _settled_lookup(self, want: wire.LookupReply | None) -> wire.LookupReply:
        """The health prompt's lookup once it shows every block (or equals ``want``)."""
        deadline = time.monotonic() + HEALTH_TIMEOUT_S
        reply = None
        while time.monotonic() < deadline:
            reply = await self.bus.request(subjects.KVINDEX_LOOKUP, self._health_lookup(),
                                           expect=wire.LookupReply, timeout=5)
            if want is None and reply.num_blocks >= HEALTH_PROMPT_BLOCKS:
                return reply
            if want is not None and _same_lookup(reply, want):
                return reply
            await asyncio.sleep(0.1)
        raise CpdError(f"lookup of the health prompt is {reply}, expected {want or 'a hit'}")

    async def health(self) -> list[str]:
        """What is wrong with the cluster now (empty: alive, answering, state intact)."""
        problems = [f"{n} died:\n{self.log_tail(n)}" for n in self.dead()]
        if problems:
            return problems
        try:
            await self._generate_ok()
        except Exception as e:
            problems.append(f"valid generate failed: {e!r}")
        try:
            assert self.baseline is not None
            await self._settled_lookup(self.baseline)
        except Exception as e:
            problems.append(f"kvindex state changed: {e!r}")
        return problems


def _same_lookup(a: wire.LookupReply, b: wire.LookupReply) -> bool:
    """The same answer, but for the GPU tier: which engine's prefix cache still holds the
    health prompt follows the traffic (the flood evicts it, the health generate brings it
    back to whichever node served it), so only the host tiers must be as they were."""
    def key(r: wire.LookupReply) -> tuple:
        return r.status, r.num_blocks, sorted(msgspec.structs.astuple(m) for m in r.matches
                                              if m.tier != wire.Tier.GPU)

    return key(a) == key(b)


# ----------------------------------------------------------------------- the driver


async def _request_case(bus: Bus, subject: str, data: bytes, out: Outcome,
                        sem: asyncio.Semaphore) -> None:
    async with sem:
        try:
            reply = await bus.request_bytes(subject, data, timeout=REPLY_TIMEOUT_S)
        except nats.errors.MaxPayloadError:
            out.refused += 1
            return
        except (RequestTimeout, NoResponders) as e:
            out.hangs += 1
            out.problems.append(f"no reply ({type(e).__name__}) to {data[:80]!r}")
            return
    try:
        answer = wire.decode(reply.data)
    except CpdError as e:
        out.untyped += 1
        out.problems.append(f"undecodable reply {reply.data[:80]!r}: {e.message}")
        return
    if not isinstance(answer, wire.Error):
        out.answered += 1
        return
    out.codes[answer.code] += 1
    if answer.code not in ErrorCode.__members__.values() or answer.code == ErrorCode.INTERNAL:
        out.untyped += 1
        out.problems.append(f"{answer.code}: {answer.message[:300]} <- {data[:80]!r}")
        return
    out.typed_errors += 1
    if answer.code in BAD_INPUT:
        out.rejected += 1


def _on_stream(msg: Any, out: Outcome) -> None:
    """A message of a fuzz case's own reply stream: errors there must be typed."""
    if b"error" not in msg.data[:32]:  # the kind tag comes first: not an error message
        return
    try:
        answer = wire.decode(msg.data)
    except CpdError:
        return  # not a service's message (the fuzz cases themselves pass by here)
    if not isinstance(answer, wire.Error):
        return
    out.codes[f"stream:{answer.code}"] += 1
    if answer.code == ErrorCode.INTERNAL or answer.code not in ErrorCode.__members__.values():
        out.untyped += 1
        out.problems.append(f"stream {answer.code}: {answer.message[:300]}")
    elif answer.code in BAD_INPUT:
        out.rejected += 1


async def _publish_cases(cluster: FuzzCluster, target: Target, cases: list[fuzzing.Case],
                         kind: type[wire.Message], out: Outcome) -> None:
    nc = cluster.bus.nc
    js = nc.jetstream() if target.style == "jetstream" else None
    sem = asyncio.Semaphore(CONCURRENCY)

    async def one(data: bytes) -> None:
        async with sem:
            try:
                if js is not None:
                    await js.publish(target.subject, data, timeout=REPLY_TIMEOUT_S)
                else:
                    await nc.publish(target.subject, data)
            except nats.errors.MaxPayloadError:
                out.refused += 1
                return
            except Exception as e:  # a stream that refused a message it should store
                out.hangs += 1
                out.problems.append(f"publish failed: {e!r}")
                return
        code = expected_rejection(data, kind, target.subject)
        if code is not None:
            out.rejected += 1
            out.typed_errors += 1
            out.codes[code.value] += 1
            return
        out.answered += 1
        if target.family == "heartbeat":  # workers refuse a peer address they cannot use
            hb = wire.decode(data, wire.Heartbeat)
            try:
                if hb.ucx_address:
                    transfer.decode_address(hb.ucx_address)
            except CpdError:
                for node in WORKERS:
                    out.extra[node] += 1

    await asyncio.gather(*(one(c.data) for c in cases))
    await nc.flush()


async def _ucx_cases(cluster: FuzzCluster, cases: list[fuzzing.Case], out: Outcome) -> None:
    """The data-plane header: every case through the server's decoder in-process, and
    the first :data:`UCX_WIRE_CASES` over a real UCX connection to the prefill node."""
    cap = transfer.header_capacity(cluster.settings.dataplane.max_blocks_per_transfer)
    for c in cases:
        buf = bytearray(cap)
        framed = framing.LENGTH.pack(len(c.data)) + c.data
        if len(framed) > cap:  # the receive buffer is too small: UCX truncation error
            out.typed_errors += 1
            out.codes["truncated"] += 1
            continue
        buf[:len(framed)] = framed
        try:
            framing.unframe(buf, wire.Message)
        except CpdError as e:
            out.typed_errors += 1
            out.codes[e.code.value] += 1
        except Exception as e:
            out.untyped += 1
            out.problems.append(f"header decoder raised {e!r} on {c.data[:80]!r}")
        else:
            out.answered += 1
    await _ucx_wire(cluster, cases[:UCX_WIRE_CASES], out)


async def _ucx_wire(cluster: FuzzCluster, cases: list[fuzzing.Case], out: Outcome) -> None:
    """Real UCX: a refused header closes the connection (the client sees it gone); a
    decodable get or put is answered with a ``BlockReply`` on its transfer's tag."""
    transfer.init_ucx(cluster.settings.dataplane)
    import ucxx

    address = await _ucx_address(cluster, "p0")
    host, port = transfer.decode_address(address)
    cap = transfer.header_capacity(cluster.settings.dataplane.max_blocks_per_transfer)
    ep = None
    for c in cases:
        if ep is None or ep.closed:
            ep = await ucxx.create_endpoint(host, port, connect_timeout=5)
        framed = framing.LENGTH.pack(len(c.data)) + c.data
        if len(framed) > cap:
            continue  # counted by the in-process pass; UCX would truncate it
        msg = None
        with contextlib.suppress(CpdError):
            msg = wire.decode(c.data)
        try:
            await asyncio.wait_for(ep.send(bytearray(framed), tag=transfer.CTRL_TAG), 5)
            if isinstance(msg, wire.BlockGet | wire.BlockPut):
                buf = bytearray(cap)
                await asyncio.wait_for(
                    ep.recv(buf, tag=transfer.xfer_tag(msg.xfer_id, 0)), REPLY_TIMEOUT_S)
                framing.unframe(buf, wire.BlockReply)
                if isinstance(msg, wire.BlockPut):  # do not push bytes: start afresh
                    ep.abort()
                    ep = None
            else:
                # Refused header: the server must close the connection at once.
                await asyncio.wait_for(ep.recv(bytearray(cap), tag=1 << 60), 5)
                out.problems.append(f"UCX header {c.data[:60]!r}: connection not closed")
                out.hangs += 1
        except TimeoutError:
            out.hangs += 1
            out.problems.append(f"UCX: no answer to {c.data[:80]!r}")
            ep = None
        except Exception:  # closed by the server: the typed refusal of a bad header
            ep = None
    if ep is not None:
        ep.abort()


async def _ucx_address(cluster: FuzzCluster, node: str) -> bytes:
    sub = await cluster.bus.nc.subscribe(subjects.heartbeat(node))
    try:
        while True:
            msg = await sub.next_msg(timeout=READY_TIMEOUT_S)
            hb = wire.decode(msg.data, wire.Heartbeat)
            if hb.ucx_address:
                return hb.ucx_address
    finally:
        await sub.unsubscribe()


async def fuzz_target(cluster: FuzzCluster, target: Target, n: int, seed: int) -> Outcome:
    """Run ``n`` cases against ``target`` and check the cluster afterwards."""
    fam = fuzzing.FAMILIES[target.family]
    cases = fuzzing.cases(target.family, n, seed, cluster.ctx)
    out = Outcome(cases=len(cases))
    label = target.name  # the metric label of the subscription (cpd.bus.service._subject_label)
    before = {node: await cluster.rejected(node, label) for node in target.listeners}
    if target.style == "request":
        sem = asyncio.Semaphore(CONCURRENCY)
        # Workers answer "accepted" and stream the rest to the case's own reply_to: what
        # they refuse after accepting arrives there (and must be typed and counted too).
        own = await cluster.bus.reply_prefix()

        async def on_stream(msg: Any) -> None:
            if not msg.subject.startswith(own):
                _on_stream(msg, out)

        # A mutated reply_to may name any subject: listen on all, except this client's
        # own request inbox (the direct answers, counted by _request_case).
        streams = await cluster.bus.nc.subscribe(">", cb=on_stream)
        await asyncio.gather(*(_request_case(cluster.bus, target.subject, c.data, out, sem)
                               for c in cases))
    elif target.style in ("publish", "jetstream"):
        await _publish_cases(cluster, target, cases, fam.kind, out)
    else:
        await _ucx_cases(cluster, cases, out)
    # Every listener must have counted what it refused (publishes: wait for it).
    for node in target.listeners:
        deadline = time.monotonic() + SETTLE_TIMEOUT_S
        agreed = 0
        while time.monotonic() < deadline:
            got = await cluster.rejected(node, label) - before[node]
            # Agreement twice in a row: streamed refusals may still be on their way.
            want = out.rejected + out.extra[node]
            agreed = agreed + 1 if got == want else 0
            if agreed == 2:
                break
            await asyncio.sleep(0.25)
        if got != want:
            out.uncounted += abs(got - want)
            out.problems.append(f"{node} counted {got} rejections on {label}, "
                                f"expected {want}")
    if target.style == "request":
        await streams.unsubscribe()
    problems = await cluster.health()
    if problems:
        out.crashes += 1
        out.problems += problems
    return out


async def run_async(cases_per_subject: int = 10_000, seed: int = 0,
                    only: list[str] | None = None, tmp: Path | None = None,
                    progress: bool = True) -> dict[str, Any]:
    """Start a cluster, fuzz every target (or those named in ``only``), stop it."""
    own = tmp is None
    tmp = Path(tempfile.mkdtemp(prefix="cpd-fuzz-")) if tmp is None else tmp
    cluster = FuzzCluster(tmp)
    report: dict[str, Any] = {"cases_per_subject": cases_per_subject, "seed": seed,
                              "subjects": {}}
    t0 = time.monotonic()
    try:
        await cluster.start()
        for target in targets():
            if only and target.name not in only:
                continue
            t = time.monotonic()
            out = await fuzz_target(cluster, target, cases_per_subject, seed)
            entry = out.report()
            entry["seconds"] = round(time.monotonic() - t, 1)
            report["subjects"][target.name] = entry
            if progress:
                print(f"{target.name}: {out.cases} cases, {out.typed_errors} typed errors, "
                      f"{out.answered} served, {out.failures} failures "
                      f"({entry['seconds']} s)", file=sys.stderr, flush=True)
    finally:
        await cluster.stop()
        if own:
            shutil.rmtree(tmp, ignore_errors=True)
    subjects_ = report["subjects"]
    report["fuzz_crashes"] = sum(s["crashes"] + s["hangs"] + s["untyped"] + s["uncounted"]
                                 for s in subjects_.values())
    report["seconds"] = round(time.monotonic() - t0, 1)
    return report


def run(cases_per_subject: int = 10_000, seed: int = 0) -> dict[str, Any]:
    """The fuzz bench: ``{"fuzz_crashes": n, "subjects": {subject: {...}}}``."""
    return asyncio.run(run_async(cases_per_subject, seed))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``cpd bench fuzz``'s flags. No ``--quick``: fewer cases is ``--cases``."""
    parser.add_argument("--cases", type=int, default=10_000,
                        help="hostile messages per subject (default 10000)")
    parser.add_argument("--seed", type=int, default=0, help="corpus seed (default 0)")


def run_args(args: argparse.Namespace, settings: SettingsFactory) -> dict:
    """Run from ``cpd bench fuzz``'s flags; the cluster uses its own settings."""
    return run(args.cases, args.seed)
