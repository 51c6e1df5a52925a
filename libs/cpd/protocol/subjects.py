"""Every NATS subject, stream and queue group CPD uses (docs/architecture.md, "Subjects"), in one
place.

Services never spell a subject literally; they call these helpers, which also validate
the variable tokens (node ids and roles), so a bad id cannot escape into a wildcard.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Final, NamedTuple

from .errors import ForgedSender
from .roles import WORKER_ROLES

PREFIX: Final = "cpd.v1"

GENERATE: Final = f"{PREFIX}.generate"
GENERATE_CANCEL: Final = f"{PREFIX}.generate.cancel"
"""Every router (no queue group): a client stopped reading a stream (``CancelGenerate``)."""
GENERATE_SUPERSEDE: Final = f"{PREFIX}.generate.supersede"
"""Every router (no queue group), from gateways only: a client resumed a request whose
earlier streams nobody reads any more (``SupersedeGenerate``)."""
KVINDEX_LOOKUP: Final = f"{PREFIX}.kvindex.lookup"
KVINDEX_CHECKSUMS: Final = f"{PREFIX}.kvindex.checksums"  # a puller's check
ROUTER_STATUS: Final = f"{PREFIX}.router.status"
KV_EVENTS_ALL: Final = f"{PREFIX}.kv.events.>"
KV_VISIBLE: Final = f"{PREFIX}.kv.visible"
KV_INVALIDATE: Final = f"{PREFIX}.kv.invalidate"
KV_DEADLETTER: Final = f"{PREFIX}.kv.deadletter"
HEARTBEAT_ALL: Final = f"{PREFIX}.node.heartbeat.>"
LOAD_ALL: Final = f"{PREFIX}.load.>"
BENCH_ECHO: Final = f"{PREFIX}.bench.echo"
"""A responder that only replies (``bench.echo``): the floor a benchmark measures a
service's request/reply latency against, side by side."""

# JetStream stream holding block lifecycle events.
KV_STREAM: Final = "CPD_KV"

# Queue groups: every replica of a service shares its group.
QUEUE_ROUTER: Final = "router"
QUEUE_KVINDEX: Final = "kvindex"

_TOKEN = re.compile(r"[A-Za-z0-9_-]{1,64}")


def check_token(value: str, what: str = "token") -> str:
    """Return ``value`` if it is a safe single subject token, else raise ``ValueError``."""
    if not _TOKEN.fullmatch(value):
        raise ValueError(f"{what} {value!r} must match [A-Za-z0-9_-]{{1,64}}")
    return value


def kv_events(node: str) -> str:
    """Subject a node publishes its block lifecycle events on (JetStream ``CPD_KV``)."""
    return f"{PREFIX}.kv.events.{check_token(node, 'node id')}"


KVINDEX_EVENTS_NODE: Final = "_kvindex"
"""Pseudo node under which kvindex itself writes into ``CPD_KV`` (lease expiries)."""


def kv_reannounce(node: str) -> str:
    """Subject kvindex uses to ask one node to re-announce its blocks."""
    return f"{PREFIX}.kv.reannounce.{check_token(node, 'node id')}"


def kv_copies(node: str) -> str:
    """Subject kvindex tells one node which of its DRAM blocks have a copy elsewhere on."""
    return f"{PREFIX}.kv.copies.{check_token(node, 'node id')}"


def pull_ack(node: str) -> str:
    """Subject a decode node acks a finished pull on, to the node that pinned the blocks."""
    return f"{PREFIX}.kv.ack.{check_token(node, 'node id')}"


def cancel(node: str) -> str:
    """Subject a router asks a worker node to stop generating a request on."""
    return f"{PREFIX}.cancel.{check_token(node, 'node id')}"


def heartbeat(node: str) -> str:
    """Subject a node publishes its heartbeat (lease renewal) on."""
    return f"{PREFIX}.node.heartbeat.{check_token(node, 'node id')}"


def load(role: str, node: str) -> str:
    """Subject a worker publishes its load reports on."""
    return f"{PREFIX}.load.{_role(role)}.{check_token(node, 'node id')}"


class Sender(NamedTuple):
    """Whose per-node subject a message came on: the node, and for a load report the
    role its subject names."""

    node: str
    role: str = ""


def sender(subject: str) -> Sender | None:
    """The node (and role) a heartbeat, load report or KV event subject belongs to;
    ``None`` for any other subject. Only that node's credentials may publish there
    (:mod:`cpd.ops.security`), so a message naming another node is forged."""
    for pattern in (HEARTBEAT_ALL, KV_EVENTS_ALL):
        rest = _after(subject, pattern)
        if rest is not None:
            return Sender(rest) if _TOKEN.fullmatch(rest) else None
    rest = _after(subject, LOAD_ALL)
    if rest is not None:
        role, _, node = rest.partition(".")
        if _TOKEN.fullmatch(role) and _TOKEN.fullmatch(node):
            return Sender(node, role)
    return None


def check_sender(subject: str, node: str, role: str = "") -> None:
    """Raise :class:`~cpd.protocol.errors.ForgedSender` unless ``node`` (and ``role``,
    where the subject names one) is whose per-node ``subject`` this is."""
    s = sender(subject)
    if s is None or s.node != node or (s.role and s.role != role):
        raise ForgedSender(f"a message naming {node!r}{f' as {role}' if role else ''} "
                           f"came on {subject[:200]!r}")


def _after(subject: str, wildcard: str) -> str | None:
    """What follows ``wildcard``'s fixed part (``a.b.>`` → ``a.b.``) in ``subject``."""
    head = wildcard[:-1]
    return subject[len(head):] if subject.startswith(head) else None


def run(role: str, node: str) -> str:
    """Per-instance work subject: the router picks the node, not a queue group."""
    return f"{PREFIX}.{_role(role)}.{check_token(node, 'node id')}.run"


def admin(role: str, node: str) -> str:
    """Per-instance operator subject (cache resets)."""
    return f"{PREFIX}.{_role(role)}.{check_token(node, 'node id')}.admin"


def _role(role: str) -> str:
    if role not in WORKER_ROLES:
        raise ValueError(f"role {role!r} must be one of {WORKER_ROLES}")
    return role


# ------------------------------------------------------------------------------------
# Subject patterns for NATS permissions (cpd.ops.security): derived from the helpers above,
# so a permission can never drift from the subject a service really uses.

ANY: Final = "*"
"""One-token wildcard, e.g. for "any node" in a permission pattern."""

# A valid node token standing in for ANY while a helper validates and formats.
_ANY_NODE = "ANY0NODE0PLACEHOLDER"


def for_node(helper: Callable[..., str], *args: str, node: str = ANY) -> str:
    """``helper(*args, node)``, or the pattern matching every node when ``node`` is
    :data:`ANY` (e.g. ``for_node(heartbeat)`` is ``cpd.v1.node.heartbeat.*``)."""
    if node != ANY:
        return helper(*args, node)
    return helper(*args, _ANY_NODE).replace(_ANY_NODE, ANY)


def everything_under(prefix: str) -> str:
    """The pattern of every subject below ``prefix`` (``prefix.>``)."""
    return f"{prefix}.>"


# Request/reply inboxes: every identity gets its own prefix (nats-py
# ``connect(inbox_prefix=...)``), so only it may subscribe to its replies.
INBOX_ROOT: Final = "_INBOX"


def inbox_prefix(identity_kind: str, node: str = "") -> str:
    """Inbox prefix of one identity: ``_INBOX_<kind>`` (one per kind) or
    ``_INBOX_<kind>.<node>`` (one per node; others reach every node of the kind through
    ``_INBOX_<kind>.>``)."""
    base = f"{INBOX_ROOT}_{check_token(identity_kind, 'identity kind')}"
    return f"{base}.{check_token(node, 'node id')}" if node else base


# NATS micro service API (health, info, stats) - ``$SRV.<VERB>[.<name>[.<id>]]``.
MICRO_ROOT: Final = "$SRV"
MICRO_VERBS: Final = ("PING", "INFO", "STATS")


def micro_name(service: str) -> str:
    """The NATS micro name a CPD service registers under."""
    return f"cpd-{check_token(service, 'service')}"


def micro_ping(service: str) -> str:
    """PING subject answered by every instance of ``service``."""
    return f"{MICRO_ROOT}.PING.{micro_name(service)}"


def micro_endpoints(service: str) -> list[str]:
    """Patterns of every micro API subject ``service`` subscribes to."""
    name = micro_name(service)
    return [f"{MICRO_ROOT}.{ANY}", f"{MICRO_ROOT}.{ANY}.{name}", f"{MICRO_ROOT}.{ANY}.{name}.{ANY}"]


# JetStream API and protocol subjects of one stream.
JS_API: Final = "$JS.API"
JS_API_INFO: Final = f"{JS_API}.INFO"


def js_stream_info(stream: str) -> str:
    """Read a stream's configuration and counters (not its messages)."""
    return f"{JS_API}.STREAM.INFO.{check_token(stream, 'stream')}"


def js_direct_last(stream: str, subject: str) -> str:
    """Read the last message of ``subject`` in ``stream`` (a direct get; the stream
    allows it): only that subject's, unlike the message-get API."""
    return f"{JS_API}.DIRECT.GET.{check_token(stream, 'stream')}.{subject}"


def js_stream_admin(stream: str) -> list[str]:
    """Patterns to create, update, inspect and consume ``stream`` (its owner only)."""
    s = check_token(stream, "stream")
    # STREAM.NAMES: a consumer created by subject first finds the stream's name.
    return [f"{JS_API}.STREAM.NAMES", f"{JS_API}.STREAM.{ANY}.{s}",
            f"{JS_API}.CONSUMER.{ANY}.{s}", f"{JS_API}.CONSUMER.{ANY}.{s}.>",
            f"{JS_API}.CONSUMER.{ANY}.{ANY}.{s}.>",
            f"$JS.ACK.{s}.>", f"$JS.FC.{s}.>"]


MAX_REPLY_SUBJECT = 256
"""Longest reply subject a service publishes a stream to (inboxes are ~40 bytes)."""

_REPLY = re.compile(r"[!-~]+")


def check_reply_subject(value: str) -> str:
    """Return ``value`` if it is a subject a service may publish replies to: printable
    ASCII tokens without whitespace or wildcards (a space or CR/LF would inject NATS
    protocol), else raise ``ValueError``."""
    tokens = value.split(".")
    if (len(value) > MAX_REPLY_SUBJECT or not _REPLY.fullmatch(value)
            or any(not t or t in ("*", ">") for t in tokens)):
        raise ValueError(f"reply subject {value[:80]!r} is not a valid NATS subject")
    return value
