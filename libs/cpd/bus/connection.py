"""The NATS connection of a process: reconnecting forever, its identity (nkey, password,
TLS), and the permission denials the server reports."""

from __future__ import annotations

import asyncio
import functools
import ssl
import weakref
from pathlib import Path
from typing import Any, TypeVar

import nats
import nats.errors
import nkeys
from nats.aio.client import Client as NatsClient

from cpd.ops import metrics, telemetry
from cpd.ops.config import NatsSettings
from cpd.protocol import subjects, wire
from cpd.protocol.errors import (
    CpdError,
    ErrorCode,
    NatsAuthFailed,
    NatsRefused,
)

T = TypeVar("T", bound=wire.Message)

log = telemetry.get_logger("cpd.bus")


async def connect(settings: NatsSettings, name: str, *, url: str | None = None,
                  **extra: Any) -> NatsClient:
    """Connect to NATS with reconnect handling and state-change logging, as the identity
    ``settings`` names (user/password or nkey, TLS, inbox prefix; cpd.ops.security).
    ``url`` (one server) replaces ``settings.servers`` (the seeds of a cluster; the
    client fails over to any member it has seen).

    Credentials or TLS the server refuses raise :class:`~cpd.protocol.errors.NatsAuthFailed`
    naming the setting (instead of retrying forever); a publish or subscribe the server
    refuses later is logged, counted and kept for :func:`permission_denials`. ``extra``
    goes to ``nats.connect`` as is (e.g. ``pending_size``).
    """
    servers = [url] if url else list(settings.servers)
    target = ", ".join(servers)
    denials = _Denials()
    holder: dict[str, NatsClient] = {}
    options: dict[str, Any] = {
        "servers": servers,
        "name": name,
        "connect_timeout": settings.connect_timeout_s,
        "reconnect_time_wait": settings.reconnect_wait_s,
        "max_reconnect_attempts": settings.max_reconnect_attempts,
        **_state_callbacks(settings, name, target, denials, holder),
        "drain_timeout": settings.drain_timeout_s,
        **identity_options(settings),
        **extra,
    }
    try:
        nc = await nats.connect(**options)
    except NatsRefused:
        raise
    except (OSError, nats.errors.Error) as e:
        raise CpdError(f"cannot connect to NATS at {target}: {e!r}",
                       code=ErrorCode.UNAVAILABLE, retryable=True) from e
    holder["nc"] = nc
    _DENIALS[nc] = denials
    for op in ("publish", "subscribe"):  # at 0 from the start: alerts see the series
        _denied_counter().add(0, {"client": name, "operation": op})
    return nc


def _state_callbacks(settings: NatsSettings, name: str, target: str, denials: _Denials,
                     holder: dict[str, NatsClient]) -> dict[str, Any]:
    """nats-py's error, disconnect and reconnect callbacks for the connection ``connect``
    makes (``holder["nc"]`` once it is made): permission denials go to ``denials``, an
    identity refused while still connecting raises, state changes are logged."""

    async def on_error(e: Exception) -> None:
        text = str(e)
        if _PERMISSION_VIOLATION in text.lower():
            denials.add(name, text)
            return
        nc = holder.get("nc")
        if nc is None and is_refused(e):
            # Still connecting: the server said no to who we are, which no retry fixes.
            raise NatsAuthFailed(refusal_message(settings, target, e))
        log.warning("nats.error", client=name, error=repr(e))

    async def on_disconnect() -> None:
        nc = holder.get("nc")
        if nc is None or not (nc.is_closed or nc.is_draining):  # not our own close()
            log.warning("nats.disconnected", client=name)

    async def on_reconnect() -> None:
        log.info("nats.reconnected", client=name)

    return {"error_cb": on_error, "disconnected_cb": on_disconnect,
            "reconnected_cb": on_reconnect}


_PERMISSION_VIOLATION = "permissions violation"


class _Denials:
    """Publishes/subscribes the server refused on one connection."""

    def __init__(self) -> None:
        self.seen: list[str] = []
        self.event = asyncio.Event()

    def add(self, client: str, text: str) -> None:
        # nats-py hands over 'nats: permissions violation for publish to "subj"'.
        detail = text.split(_PERMISSION_VIOLATION, 1)[-1].strip(" '\"")
        op = "subscribe" if detail.lower().startswith("for subscription") else "publish"
        target = detail.rsplit(" ", 1)[-1].strip('"').lower()
        # An answer to someone's inbox may be refused through no fault of this process
        # (a caller reusing a reply subject that was answered already): logged and
        # counted, but not a sign that this identity lacks rights for its own job.
        if not (op == "publish" and target.startswith(subjects.INBOX_ROOT.lower())):
            self.seen.append(detail)
            self.event.set()
        _denied_counter().add(1, {"client": client, "operation": op})
        log.error("nats.permission_denied", client=client, operation=op, detail=detail)


_DENIALS: weakref.WeakKeyDictionary[NatsClient, _Denials] = weakref.WeakKeyDictionary()


@functools.cache
def _denied_counter() -> Any:
    return metrics.counter(telemetry.meter(), metrics.NATS_PERMISSION_DENIED)


async def flush_all(nc: NatsClient) -> None:
    """Return once the server has processed every command sent before this call.

    nats-py's ``flush()`` writes its PING straight to the socket while subscriptions and
    publishes still wait in its pending buffer for the flusher task, so the PONG can come
    back before the server saw them (a subscription "made" but not yet live: no
    responders, lost messages). Yielding once first lets the flusher, already woken by
    those commands, write them ahead of the PING (without the cost of a second round trip).
    """
    await asyncio.sleep(0)
    await nc.flush()


def permission_denials(nc: NatsClient) -> list[str]:
    """What the server refused this connection so far (``for publish to "x"`` ...),
    except answers to other identities' inboxes (see ``_Denials.add``)."""
    d = _DENIALS.get(nc)
    return list(d.seen) if d else []


async def wait_denied(nc: NatsClient) -> str:
    """Wait until the server refuses something on ``nc``; returns what it refused."""
    d = _DENIALS.get(nc)
    if d is None:
        await asyncio.Event().wait()  # a connection not made by connect(): never
    assert d is not None
    await d.event.wait()
    return d.seen[0]


def is_refused(e: Exception) -> bool:
    """An error that means the server will not take this identity (or its TLS)."""
    text = str(e).lower()
    return (isinstance(e, ssl.SSLError | nats.errors.AuthorizationError)
            or "authorization violation" in text or "tls required" in text
            or "secure connection" in text or "certificate" in text)


def identity_desc(settings: NatsSettings) -> str:
    if settings.nkey_seed_file:
        return f"nats.nkey_seed_file={settings.nkey_seed_file}"
    if settings.creds_file:
        return f"nats.creds_file={settings.creds_file}"
    if settings.user:
        return f"nats.user={settings.user} with nats.password" + (
            f"_file={settings.password_file}" if settings.password_file else "")
    return "no credentials (set nats.nkey_seed_file, or nats.user and nats.password_file)"


def refusal_message(settings: NatsSettings, url: str, e: Exception) -> str:
    if isinstance(e, ssl.SSLError) or "authorization" not in str(e).lower():
        return (f"TLS with NATS at {url} failed ({e}): check nats.tls_ca_file"
                f"={settings.tls_ca_file or '(unset)'} (the CA that signed the server's "
                "certificate) and, when the server verifies clients, nats.tls_cert_file/"
                "nats.tls_key_file")
    return f"NATS at {url} refused {identity_desc(settings)}: {e}"


def identity_options(settings: NatsSettings) -> dict[str, Any]:
    """``nats.connect`` options for the identity and TLS ``settings`` name; a missing or
    unreadable file raises :class:`~cpd.protocol.errors.NatsAuthFailed` naming the setting."""
    out: dict[str, Any] = {}

    def read(setting: str, path: str) -> str:
        try:
            return Path(path).expanduser().read_text().strip()
        except OSError as e:
            raise NatsAuthFailed(f"nats.{setting}={path}: cannot read it ({e.strerror})") \
                from None

    if settings.nkey_seed_file:
        seed = read("nkey_seed_file", settings.nkey_seed_file)
        try:
            nkeys.from_seed(seed.encode())
        except (nkeys.NkeysError, ValueError):
            raise NatsAuthFailed(f"nats.nkey_seed_file={settings.nkey_seed_file} does not "
                                 "hold an nkey seed (SU...)") from None
        out["nkeys_seed_str"] = seed
    elif settings.user:
        out["user"] = settings.user
        out["password"] = (read("password_file", settings.password_file)
                           if settings.password_file else settings.password)
    elif settings.password_file:
        raise NatsAuthFailed("nats.password_file is set but nats.user is not")
    if settings.creds_file:
        out["user_credentials"] = settings.creds_file
    if settings.tls_ca_file or settings.tls_cert_file:
        if bool(settings.tls_cert_file) != bool(settings.tls_key_file):
            raise NatsAuthFailed("nats.tls_cert_file and nats.tls_key_file go together")
        try:
            ctx = ssl.create_default_context(
                cafile=str(Path(settings.tls_ca_file).expanduser())
                if settings.tls_ca_file else None)
        except (OSError, ssl.SSLError) as e:
            raise NatsAuthFailed(f"nats.tls_ca_file={settings.tls_ca_file}: {e}") from None
        if settings.tls_cert_file:
            try:
                ctx.load_cert_chain(str(Path(settings.tls_cert_file).expanduser()),
                                    str(Path(settings.tls_key_file).expanduser()))
            except (OSError, ssl.SSLError) as e:
                raise NatsAuthFailed(f"nats.tls_cert_file={settings.tls_cert_file} / "
                                     f"nats.tls_key_file={settings.tls_key_file}: {e}") from None
        out["tls"] = ctx
    if settings.inbox_prefix:
        try:
            subjects.check_token(settings.inbox_prefix.replace(".", "_"), "inbox prefix")
        except ValueError as e:
            raise NatsAuthFailed(f"nats.inbox_prefix: {e}") from None
        out["inbox_prefix"] = settings.inbox_prefix
    return out


