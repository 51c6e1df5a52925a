"""Whose tenant a generate request runs under: the sender's identity decides, not the
request's own word.

With identities (``nats.inbox_prefix`` set: ``cpd up --secure`` or a deployment's
credentials) every identity may read replies only under its own inbox prefix
(:func:`cpd.protocol.subjects.inbox_prefix`, :mod:`cpd.ops.security`), so a request's
reply inbox names the kind of identity that will read its answer. The gateway (which
authenticates its HTTP callers and sets their tenant; in a process of its own or in a
front end) and an admin may run requests
under any tenant; every other requester is pinned to the default tenant, and a request
of theirs naming another one is refused (:class:`ForgedTenant`, counted as bad input),
so no bus client can read — or fill — another tenant's cache through a reply it can
read. A request whose reply inbox is another identity's cannot be read by its sender.
Without identities nothing tells requesters apart, and the request's tenant stands.
"""

from __future__ import annotations

from cpd.ops.security import ADMIN
from cpd.protocol import subjects, wire
from cpd.protocol.errors import CpdError, ErrorCode

SETS_TENANTS = frozenset({"gateway", "frontend", ADMIN})
"""Identity kinds that may run a request under any tenant."""


class ForgedTenant(CpdError):
    """A requester named a tenant its identity may not act for."""

    code = ErrorCode.FORGED_SENDER


def requester(reply_to: str) -> str | None:
    """The identity kind whose inbox ``reply_to`` is in (``_INBOX_<kind>…``), or
    ``None`` for an inbox of no identity (NATS's own ``_INBOX.…``)."""
    root = f"{subjects.INBOX_ROOT}_"
    if not reply_to.startswith(root):
        return None
    return reply_to[len(root):].split(".", 1)[0]


def tenant_for(req: wire.GenerateRequest, reply_to: str, *, identities: bool) -> str:
    """The tenant ``req`` runs under, sent with reply inbox ``reply_to``; raises
    :class:`ForgedTenant` when its sender may not act for the tenant it names."""
    kind = requester(reply_to) if identities else None
    if not identities or kind in SETS_TENANTS:
        return req.tenant
    if req.tenant != wire.DEFAULT_TENANT:
        raise ForgedTenant(f"a {kind or 'plain'} requester may not act for "
                           f"tenant {req.tenant!r}")
    return req.tenant
