"""Messages between the services of one process, delivered without NATS.

A front-end process hosts the gateway, the router and a kvindex replica together
(``services.frontend``); each keeps its own NATS connection, identity and endpoints, and
all three share one :class:`LocalHub`. A message one of them sends to an endpoint or an
inbox of another is handed over in the process: no socket write, no trip through the
server, no wake-up of another process. On a warm request that removes four of the six
messages before its first token (gateway → router, the router's kvindex lookup and its
answer, the first token back to the gateway), each worth 0.5–1 ms on a busy host.

What is delivered here is exactly what NATS would have delivered to that subscriber:
the same bytes and headers (trace context included), after the same size check. Only
exact subjects are matched (an endpoint's subject, or a reply inbox of a connection of
this process); everything else, plain subscriptions included, goes through NATS as
before, so a message is never delivered twice. A request for a subject served here goes
to the local endpoint while it takes work (a queue group's member nearest the caller,
as llm-d and Dynamo front ends keep their router beside the HTTP server); once it stops,
requests go through NATS to the other replicas.
"""

from __future__ import annotations

from collections.abc import Awaitable
from typing import Protocol

from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg

__all__ = ["LocalEndpoint", "LocalHub", "LocalInboxes", "send"]


class LocalEndpoint(Protocol):
    """An endpoint that takes requests handed over in the process."""

    subject: str

    @property
    def serving(self) -> bool:
        """Whether it takes requests now (subscribed, not stopped)."""

    def receive(self, msg: Msg) -> Awaitable[None]:
        """Take one request, as its subscription would."""


class LocalInboxes(Protocol):
    """A connection's reply inboxes (:class:`cpd.bus.ReplyMux`)."""

    def deliver(self, msg: Msg) -> bool:
        """Hand ``msg`` to the request or stream it answers; ``False`` when none of this
        connection waits for it (a closed stream: NATS answers the sender then)."""


class LocalHub:
    """The endpoints and reply inboxes of one process's services, by subject."""

    def __init__(self) -> None:
        self._endpoints: dict[str, list[LocalEndpoint]] = {}
        self._inboxes: dict[str, LocalInboxes] = {}
        self.delivered = 0
        """Messages handed over in the process so far."""

    def add_endpoint(self, endpoint: LocalEndpoint) -> None:
        """Serve ``endpoint.subject`` here too (a wildcard subject is left to NATS)."""
        if "*" in endpoint.subject or ">" in endpoint.subject:
            return
        self._endpoints.setdefault(endpoint.subject, []).append(endpoint)

    def add_inboxes(self, prefix: str, inboxes: LocalInboxes) -> None:
        """Deliver subjects ``<prefix><token>`` (``prefix`` ends with a dot) to
        ``inboxes``."""
        self._inboxes[prefix] = inboxes

    async def deliver(self, nc: NatsClient, subject: str, payload: bytes, reply: str,
                      headers: dict[str, str] | None) -> bool:
        """Hand one message to its subscriber in this process; ``False`` when it has none
        here (the caller publishes it to NATS). ``nc`` is the sender's connection: the
        receiver sees the message as if it came on it."""
        dot = subject.rfind(".")
        inboxes = self._inboxes.get(subject[:dot + 1]) if dot > 0 else None
        if inboxes is not None:
            if not inboxes.deliver(_msg(nc, subject, payload, reply, headers)):
                return False
            self.delivered += 1
            return True
        for endpoint in self._endpoints.get(subject, ()):
            if endpoint.serving:
                self.delivered += 1
                await endpoint.receive(_msg(nc, subject, payload, reply, headers))
                return True
        return False


async def send(nc: NatsClient, hub: LocalHub | None, subject: str, payload: bytes, *,
               reply: str = "", headers: dict[str, str] | None = None) -> None:
    """Publish ``payload`` on ``subject``: in the process when ``hub`` has its
    subscriber, else through NATS."""
    if hub is not None and await hub.deliver(nc, subject, payload, reply, headers or None):
        return
    await nc.publish(subject, payload, reply=reply, headers=headers or None)


def _msg(nc: NatsClient, subject: str, payload: bytes, reply: str,
         headers: dict[str, str] | None) -> Msg:
    return Msg(_client=nc, subject=subject, reply=reply, data=payload,
               headers=dict(headers) if headers else None)
