"""Whose tenant a generate request runs under (services/router/tenancy.py), table-driven:
the sender's identity, read from its reply inbox, decides."""

from __future__ import annotations

import pytest

from cpd.protocol import subjects, wire
from cpd.protocol.errors import ErrorCode
from services.router.tenancy import ForgedTenant, requester, tenant_for


def inbox(kind: str, node: str = "") -> str:
    return f"{subjects.inbox_prefix(kind, node)}.NUID123.abcdef"


@pytest.mark.parametrize(("reply", "kind"), [
    (inbox("gateway"), "gateway"), (inbox("gateway", "gateway-1"), "gateway"),
    (inbox("client"), "client"), (inbox("admin"), "admin"),
    ("_INBOX.abc.def", None), ("_INBOXX_gateway.x", None), ("reply.here", None),
])
def test_the_requester_is_the_kind_whose_inbox_the_reply_is_in(reply: str,
                                                               kind: str | None) -> None:
    assert requester(reply) == kind


# (identities on, sender's inbox, tenant asked, tenant run under or None: refused)
@pytest.mark.parametrize(("identities", "reply", "asked", "runs"), [
    (True, inbox("gateway"), "acme", "acme"),
    (True, inbox("gateway", "gateway-0"), "acme", "acme"),
    (True, inbox("frontend", "frontend-0"), "acme", "acme"),  # a front end's gateway
    (True, inbox("admin"), "acme", "acme"),
    (True, inbox("client"), "default", "default"),
    (True, inbox("client"), "acme", None),
    (True, inbox("client", "c7"), "acme", None),
    (True, "_INBOX.plain.x", "acme", None),       # an inbox of no identity
    (True, inbox("prefill"), "acme", None),        # not a requester at all
    (False, "_INBOX.plain.x", "acme", "acme"),     # no identities: nothing to go by
    (False, inbox("client"), "acme", "acme"),
])
def test_only_gateways_and_an_admin_act_for_a_tenant(identities: bool, reply: str,
                                                         asked: str, runs: str | None) -> None:
    req = wire.GenerateRequest(request_id="r", tenant=asked, tokens=b"\x01\x00\x00\x00")
    if runs is None:
        with pytest.raises(ForgedTenant) as e:
            tenant_for(req, reply, identities=identities)
        assert e.value.code is ErrorCode.FORGED_SENDER
    else:
        assert tenant_for(req, reply, identities=identities) == runs
