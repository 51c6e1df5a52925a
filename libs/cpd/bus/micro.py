"""The NATS service API ("micro", protocol v1) of one process: endpoints whose requests are
counted and timed, and discovery on ``$SRV.<PING|INFO|STATS>[.<name>[.<id>]]``.

nats-py's ``nats.micro`` hides a request's reply subject and times only the subscription
callback, so a handler run as a task (or one that turns its errors into typed replies)
shows neither its time nor its errors. Here an endpoint's handler says how the request
ended, and a request served by a spawned task is timed until that task ends. The JSON
answers carry ``nats.micro``'s fields, in its order, so ``nats micro ping|info|stats``
and other micro clients read them as they read any service's.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import time
from collections.abc import Awaitable, Callable, Coroutine
from datetime import UTC, datetime
from typing import Any

from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.nuid import NUID

from cpd.ops import telemetry

ROOT = "$SRV"
"""The root of every discovery subject."""

VERBS = ("PING", "INFO", "STATS")
"""The discovery requests every service answers."""

PING_RESPONSE = "io.nats.micro.v1.ping_response"
INFO_RESPONSE = "io.nats.micro.v1.info_response"
STATS_RESPONSE = "io.nats.micro.v1.stats_response"

EndpointHandler = Callable[[Msg], Awaitable[str | None]]
"""Serves one request and answers it itself: returns ``None`` when the request succeeded,
else a description of the error it ended in (counted, and shown as ``last_error``)."""

Spawn = Callable[[Coroutine[Any, Any, None]], object]
"""Runs a request's serving coroutine as a task (the owner tracks it for a graceful stop)."""

_NAME = re.compile(r"^[A-Za-z0-9\-_]+$")

log = telemetry.get_logger("cpd.bus")


def control_subjects(verb: str, name: str, service_id: str) -> tuple[str, str, str]:
    """The three subjects ``verb`` is answered on: all services, every instance of
    ``name``, and instance ``service_id`` of it."""
    return f"{ROOT}.{verb}", f"{ROOT}.{verb}.{name}", f"{ROOT}.{verb}.{name}.{service_id}"


class Endpoint:
    """One subject served in a queue group, and the statistics of its requests."""

    def __init__(self, name: str, subject: str, queue_group: str, handler: EndpointHandler,
                 *, spawn: Spawn | None = None, metadata: dict[str, str] | None = None) -> None:
        _check_name(name, "endpoint")
        self.name = name
        self.subject = subject
        self.queue_group = queue_group
        self.metadata = dict(metadata or {})
        self.num_requests = 0
        self.num_errors = 0
        self.last_error = ""
        self.processing_time = 0
        """Nanoseconds spent on the finished requests, each from arrival to its end."""
        self._finished = 0
        self._handler = handler
        self._spawn = spawn
        self._sub: Subscription | None = None

    @property
    def serving(self) -> bool:
        """Whether it takes requests (subscribed, not yet stopped)."""
        return self._sub is not None

    async def receive(self, msg: Msg) -> None:
        """The subscription's callback (and :mod:`cpd.bus.local`'s delivery): count the
        request as it arrives, then serve it here (inline) or in a spawned task, which
        lets the next request in at once."""
        self.num_requests += 1
        serving = self._serve(msg, time.perf_counter_ns())
        if self._spawn is None:
            await serving
        else:
            self._spawn(serving)

    async def _serve(self, msg: Msg, arrived_ns: int) -> None:
        error: str | None = None
        try:
            error = await self._handler(msg)
        except Exception as e:  # a handler's bug: counted and logged, the endpoint serves on
            error = repr(e)
            log.exception("endpoint.failed", endpoint=self.name, subject=msg.subject[:200])
        except BaseException as e:  # cancelled (a stop that ran out of time)
            error = repr(e)
            raise
        finally:
            self._finish(arrived_ns, error)

    def _finish(self, arrived_ns: int, error: str | None) -> None:
        self.processing_time += time.perf_counter_ns() - arrived_ns
        self._finished += 1
        if error is not None:
            self.num_errors += 1
            self.last_error = error

    def info(self) -> dict[str, Any]:
        """This endpoint in an INFO answer."""
        return {"name": self.name, "subject": self.subject, "queue_group": self.queue_group,
                "metadata": self.metadata}

    def stats(self) -> dict[str, Any]:
        """This endpoint in a STATS answer (times in nanoseconds; the average is over the
        finished requests, so requests in flight do not lower it)."""
        return {"name": self.name, "subject": self.subject, "queue_group": self.queue_group,
                "num_requests": self.num_requests, "num_errors": self.num_errors,
                "last_error": self.last_error, "processing_time": self.processing_time,
                "average_processing_time": self.processing_time // max(1, self._finished),
                "data": None}


class MicroService:
    """One instance of a NATS micro service: its endpoints and its discovery answers.

    :meth:`start` subscribes the discovery subjects, :meth:`add_endpoint` serves a
    subject, :meth:`stop` unsubscribes the endpoints (no more work is taken) and drains
    the discovery subscriptions.
    """

    def __init__(self, nc: Client, *, name: str, version: str, description: str = "",
                 metadata: dict[str, str] | None = None) -> None:
        _check_name(name, "service")
        self.id = NUID().next().decode()
        self.name = name
        self.version = version
        self.description = description
        self.metadata = dict(metadata or {})
        self.endpoints: list[Endpoint] = []
        self.started = datetime.now(UTC)
        self._nc = nc
        self._subs: list[Subscription] = []

    async def start(self) -> None:
        """Answer PING, INFO and STATS on their three subjects each."""
        answers = {"PING": self.ping, "INFO": self.info, "STATS": self.stats}
        for verb in VERBS:
            respond = self._responder(answers[verb])
            for subject in control_subjects(verb, self.name, self.id):
                self._subs.append(await self._nc.subscribe(subject, cb=respond))
        self.started = datetime.now(UTC)
        await self._nc.flush()

    async def add_endpoint(self, name: str, subject: str, handler: EndpointHandler, *,
                           queue_group: str, spawn: Spawn | None = None,
                           metadata: dict[str, str] | None = None) -> Endpoint:
        """Serve ``subject`` in ``queue_group`` with ``handler``: in the subscription's
        callback (one request at a time), or through ``spawn`` (concurrently)."""
        endpoint = Endpoint(name, subject, queue_group, handler, spawn=spawn,
                            metadata=metadata)
        endpoint._sub = await self._nc.subscribe(subject, queue=queue_group,
                                                 cb=endpoint.receive)
        self.endpoints.append(endpoint)
        return endpoint

    async def stop(self) -> None:
        """Stop taking requests and answering discovery (requests already being served
        go on: their owner waits for them)."""
        for endpoint in self.endpoints:
            sub, endpoint._sub = endpoint._sub, None
            if sub is not None:
                with contextlib.suppress(Exception):
                    await sub.unsubscribe()
        subs, self._subs = self._subs, []
        await asyncio.gather(*(sub.drain() for sub in subs), return_exceptions=True)

    def ping(self) -> dict[str, Any]:
        """The PING answer."""
        return {"type": PING_RESPONSE, "id": self.id, "name": self.name,
                "version": self.version, "metadata": self.metadata}

    def info(self) -> dict[str, Any]:
        """The INFO answer."""
        return {"type": INFO_RESPONSE, "id": self.id, "name": self.name,
                "version": self.version, "description": self.description,
                "endpoints": [e.info() for e in self.endpoints], "metadata": self.metadata}

    def stats(self) -> dict[str, Any]:
        """The STATS answer (``started`` in RFC 3339, UTC, to the millisecond)."""
        started = self.started.strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3] + "Z"
        return {"type": STATS_RESPONSE, "name": self.name, "id": self.id,
                "version": self.version, "started": started,
                "endpoints": [e.stats() for e in self.endpoints], "metadata": self.metadata}

    def _responder(self, answer: Callable[[], dict[str, Any]]) -> Callable[[Msg], Awaitable[None]]:
        async def respond(msg: Msg) -> None:
            if msg.reply:  # a request without a reply subject gets no answer
                await self._nc.publish(msg.reply, json.dumps(answer()).encode())
        return respond


def _check_name(name: str, what: str) -> None:
    """Refuse a name that is not one subject token (letters, digits, ``-`` and ``_``)."""
    if not _NAME.match(name):
        raise ValueError(f"invalid {what} name {name!r}: use letters, digits, - and _")
