"""Every NATS subject, stream and queue group CPD uses (DESIGN.md §4), in one place.

Services never spell a subject literally; they call these helpers, which also validate
the variable tokens (node ids and roles), so a bad id cannot escape into a wildcard.
"""

from __future__ import annotations

import re
from typing import Final

PREFIX: Final = "cpd.v1"

GENERATE: Final = f"{PREFIX}.generate"
KVINDEX_LOOKUP: Final = f"{PREFIX}.kvindex.lookup"
ROUTER_STATUS: Final = f"{PREFIX}.router.status"
KV_EVENTS_ALL: Final = f"{PREFIX}.kv.events.>"
KV_VISIBLE: Final = f"{PREFIX}.kv.visible"
KV_INVALIDATE: Final = f"{PREFIX}.kv.invalidate"
KV_DEADLETTER: Final = f"{PREFIX}.kv.deadletter"
HEARTBEAT_ALL: Final = f"{PREFIX}.node.heartbeat.>"
LOAD_ALL: Final = f"{PREFIX}.load.>"

# JetStream stream holding block lifecycle events.
KV_STREAM: Final = "CPD_KV"

# Queue groups: every replica of a service shares its group.
QUEUE_ROUTER: Final = "router"
QUEUE_KVINDEX: Final = "kvindex"

ROLES: Final = ("preprefill", "prefill", "decode")

_TOKEN = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


def check_token(value: str, what: str = "token") -> str:
    """Return ``value`` if it is a safe single subject token, else raise ``ValueError``."""
    if not _TOKEN.match(value):
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


def pull_ack(node: str) -> str:
    """Subject a decode node acks a finished pull on, to the node that pinned the blocks."""
    return f"{PREFIX}.kv.ack.{check_token(node, 'node id')}"


def heartbeat(node: str) -> str:
    """Subject a node publishes its heartbeat (lease renewal) on."""
    return f"{PREFIX}.node.heartbeat.{check_token(node, 'node id')}"


def load(role: str, node: str) -> str:
    """Subject a worker publishes its load reports on."""
    return f"{PREFIX}.load.{_role(role)}.{check_token(node, 'node id')}"


def run(role: str, node: str) -> str:
    """Per-instance work subject: the router picks the node, not a queue group."""
    return f"{PREFIX}.{_role(role)}.{check_token(node, 'node id')}.run"


def admin(role: str, node: str) -> str:
    """Per-instance operator subject (cache resets)."""
    return f"{PREFIX}.{_role(role)}.{check_token(node, 'node id')}.admin"


def node_of(subject: str) -> str:
    """The last token of a per-node subject (events, heartbeats, load reports)."""
    return subject.rsplit(".", 1)[-1]


def _role(role: str) -> str:
    if role not in ROLES:
        raise ValueError(f"role {role!r} must be one of {ROLES}")
    return role
