"""Least-privilege NATS (cpd.ops.security): a real nats-server started with the generated
config (auth, TLS, per-identity permissions, JetStream). Each identity can do exactly its
job and is refused outside it; wrong credentials and plain TCP are refused; a service
holding another's credentials cannot start; a secure ``cpd up`` with sim workers serves
a request over TLS with auth."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import msgspec
import nats.errors
import pytest
from nats.aio.client import Client as NatsClient

from cpd.bus import EXIT_REFUSED, connect, flush_all, permission_denials, wait_denied
from cpd.client import Client
from cpd.kvstore import events as kvevents
from cpd.ops import security
from cpd.ops.config import NatsSettings, load_settings
from cpd.ops.natsserver import NatsServer
from cpd.protocol import subjects, wire
from cpd.protocol.errors import CpdError, ErrorCode, NatsAuthFailed, PermissionDenied
from cpd.protocol.roles import WORKER_ROLES
from cpd.sim.workloads import block_token_ids
from services.kvindex import KvIndexService

ROOT = Path(__file__).resolve().parent.parent
NODES = {"kvindex-0": "kvindex", "router-0": "router", "gateway-0": "gateway",
         "preprefill-0": "preprefill", "prefill-0": "prefill", "prefill-1": "prefill",
         "decode-0": "decode"}


# ----------------------------------------------------------------------- pure table


def _pub(name_or_kind: str, node: str = "") -> tuple[str, ...]:
    return security.grants(name_or_kind, node).publish


def _sub(kind: str, node: str = "") -> tuple[str, ...]:
    return security.grants(kind, node).subscribe


def test_permission_table_keeps_each_identity_to_its_job() -> None:
    allows = security.allows
    for role in WORKER_ROLES:
        # Workers never send client requests, visibility changes or stream admin.
        for forbidden in (subjects.GENERATE, subjects.KV_VISIBLE, subjects.KV_INVALIDATE,
                          subjects.js_stream_info("OTHER"), "$JS.API.CONSUMER.CREATE.CPD_KV",
                          "$JS.API.STREAM.DELETE.CPD_KV", subjects.KVINDEX_LOOKUP):
            assert not allows(_pub(role, f"{role}-0"), forbidden), (role, forbidden)
        # Their own node's subjects only, when the identity is per node.
        assert allows(_pub(role, f"{role}-0"), subjects.heartbeat(f"{role}-0"))
        assert not allows(_pub(role, f"{role}-0"), subjects.heartbeat(f"{role}-1"))
        assert allows(_pub(role, f"{role}-0"), subjects.kv_events(f"{role}-0"))
        assert not allows(_pub(role, f"{role}-0"), subjects.kv_events(f"{role}-1"))
        assert allows(_sub(role, f"{role}-0"), subjects.run(role, f"{role}-0"))
        assert not allows(_sub(role, f"{role}-0"), subjects.run(role, f"{role}-1"))
        assert allows(_pub(role), subjects.kv_events("anything"))  # per-kind identity
        # Its own last event (its last epoch), never another node's events.
        last = subjects.js_direct_last(subjects.KV_STREAM, subjects.kv_events(f"{role}-0"))
        assert allows(_pub(role, f"{role}-0"), last)
        assert not allows(_pub(role, f"{role}-0"), subjects.js_direct_last(
            subjects.KV_STREAM, subjects.kv_events(f"{role}-1")))
        assert not allows(_pub(role, f"{role}-0"), "$JS.API.STREAM.MSG.GET.CPD_KV")
        assert not allows(_pub(role, f"{role}-0"), "$JS.API.DIRECT.GET.CPD_KV")
        # Every puller asks kvindex what the bytes it pulls must checksum to.
        assert allows(_pub(role, f"{role}-0"), subjects.KVINDEX_CHECKSUMS), role
    # Only kvindex (alone, or in a front end) publishes visibility changes and
    # manages/consumes CPD_KV.
    for kind in security.KINDS:
        g = security.grants(kind)
        is_kvindex = kind in ("kvindex", "frontend")
        assert allows(g.publish, subjects.KV_VISIBLE) == is_kvindex, kind
        assert allows(g.publish, "$JS.API.CONSUMER.CREATE.CPD_KV.x.y") == is_kvindex, kind
        # Nobody reads the events as core NATS messages (they carry capabilities).
        assert not allows(g.subscribe, subjects.kv_events("prefill-0")), kind
        # Everyone reads only under its own inbox prefix.
        for other in security.KINDS:
            if other != kind:
                assert not allows(g.subscribe, f"{subjects.inbox_prefix(other)}.x"), (kind,
                                                                                     other)
    assert set(_pub(security.CLIENT)) == {subjects.GENERATE, subjects.GENERATE_CANCEL,
                                          subjects.ROUTER_STATUS}
    # A resume's cancel of earlier streams names a tenant: gateways and admins only.
    for kind in security.KINDS:
        may = kind in ("gateway", "frontend", security.ADMIN)
        assert allows(security.grants(kind).publish, subjects.GENERATE_SUPERSEDE) == may, kind
    assert allows(_sub("router"), subjects.GENERATE_SUPERSEDE)
    # Only routers tell workers to stop generating; workers hear only their own node's.
    assert allows(_pub("router"), subjects.cancel("decode-0"))
    assert allows(_pub("frontend"), subjects.cancel("decode-0"))  # its router's
    assert not any(allows(_pub(k), subjects.cancel("decode-0"))
                   for k in ("gateway", "kvindex", "prefill", "decode", security.CLIENT))
    assert allows(_sub("decode", "decode-0"), subjects.cancel("decode-0"))
    assert not allows(_sub("decode", "decode-0"), subjects.cancel("decode-1"))
    assert set(_sub(security.CLIENT)) == {f"{subjects.inbox_prefix('client')}.>"}
    # Who streams to whom: workers to the router, the router to its callers.
    assert allows(_pub("decode"), f"{subjects.inbox_prefix('router', 'router-0')}.abc")
    assert not allows(_pub("decode"), f"{subjects.inbox_prefix('client')}.abc")
    assert allows(_pub("router"), f"{subjects.inbox_prefix('client')}.abc")
    # A front end holds exactly the rights of the services it hosts, under its own inbox.
    frontend = security.grants("frontend", "frontend-0")
    parts = [security.grants(k, "frontend-0") for k in ("kvindex", "router", "gateway")]
    assert set(frontend.publish) == {x for g in parts for x in g.publish}
    inbox = f"{subjects.inbox_prefix('frontend', 'frontend-0')}.>"
    assert set(frontend.subscribe) - {inbox} == {
        x for g in parts for x in g.subscribe if not x.startswith(subjects.INBOX_ROOT)}
    assert allows(_pub("decode"), f"{subjects.inbox_prefix('frontend', 'frontend-0')}.abc")
    with pytest.raises(Exception, match="unknown identity kind"):
        security.grants("intruder")


def test_server_config_lists_every_identity_twice_with_the_same_rights(tmp_path: Path) -> None:
    d = security.SecretsDir.ensure(tmp_path / "s", security.identities_for(NODES))
    text = d.config_file.read_text()
    for name in [*NODES, "client", "admin"]:
        creds = d.credentials(name)
        assert f'user: "{name}"' in text and f'nkey: "{creds.nkey_public}"' in text
        assert creds.password not in text  # bcrypt hashes only
        mode = (d.folder(name) / security.NKEY_FILE).stat().st_mode & 0o777
        assert mode == 0o600
    assert (d.root.stat().st_mode & 0o777) == 0o700
    # Reused, not regenerated: the same secrets on a second run; new identities added.
    again = security.SecretsDir.ensure(tmp_path / "s", security.identities_for(
        {**NODES, "decode-1": "decode"}))
    assert again.credentials("router-0") == d.credentials("router-0")
    assert "decode-1" in again.identities
    check = subprocess.run([str(Path(sys.executable).parent / "nats-server"), "-c",
                            str(again.config_file), "-t"], capture_output=True, text=True,
                           timeout=30)
    assert check.returncode == 0, check.stderr


# -------------------------------------------------------------------- live server


@pytest.fixture(scope="module")
def secure(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[security.SecretsDir,
                                                                      NatsServer]]:
    tmp = tmp_path_factory.mktemp("secure")
    d = security.SecretsDir.ensure(tmp / "secrets", security.identities_for(NODES))
    server = NatsServer.secure(d.root, store_dir=tmp / "nats").start()
    yield d, server
    server.cleanup()


def _nats(secure: tuple[security.SecretsDir, NatsServer], name: str) -> NatsSettings:
    d, server = secure
    return security.nats_settings_for(d, name, NatsSettings(servers=[server.url],
                                                            max_reconnect_attempts=2))


@pytest.fixture
async def conns(secure: tuple[security.SecretsDir, NatsServer]) -> AsyncIterator[dict]:
    opened: dict[str, NatsClient] = {}

    async def open_as(name: str) -> NatsClient:
        opened[name] = await connect(_nats(secure, name), f"test-{name}")
        return opened[name]

    yield {"open": open_as}
    for nc in opened.values():
        await nc.close()


async def _denied(nc: NatsClient, timeout: float = 5.0) -> str:
    return await asyncio.wait_for(wait_denied(nc), timeout)


async def test_each_identity_does_its_job_and_is_refused_outside_it(conns: dict) -> None:
    kvi = await conns["open"]("kvindex-0")
    router = await conns["open"]("router-0")
    worker = await conns["open"]("prefill-0")
    client = await conns["open"]("client")

    # kvindex owns CPD_KV: creates it and consumes it; the worker publishes into it.
    js = kvi.jetstream()
    await kvevents.ensure_stream(js)
    assert (await kvevents.ensure_stream(worker.jetstream(), update=False)).config.name \
        == subjects.KV_STREAM
    got: asyncio.Queue[bytes] = asyncio.Queue()

    async def on_event(msg: nats.aio.msg.Msg) -> None:
        await got.put(msg.data)

    await js.subscribe(subjects.KV_EVENTS_ALL, cb=on_event, ordered_consumer=True)
    ack = await worker.jetstream().publish(subjects.kv_events("prefill-0"), b"event")
    assert ack.stream == subjects.KV_STREAM
    assert await asyncio.wait_for(got.get(), 5) == b"event"

    # Request/reply through each identity's own inbox: router -> kvindex lookup.
    async def lookup(msg: nats.aio.msg.Msg) -> None:
        await msg.respond(b"hits")

    await kvi.subscribe(subjects.KVINDEX_LOOKUP, cb=lookup, queue=subjects.QUEUE_KVINDEX)
    await flush_all(kvi)
    reply = await router.request(subjects.KVINDEX_LOOKUP, b"q", timeout=5)
    assert reply.data == b"hits"
    assert reply.subject.startswith(subjects.inbox_prefix("router", "router-0") + ".")

    # A stream: the router answers a client's request many times (its inbox), the
    # worker streams tokens into the router's inbox.
    async def status(msg: nats.aio.msg.Msg) -> None:
        for i in range(3):
            await router.publish(msg.reply, str(i).encode())

    await router.subscribe(subjects.ROUTER_STATUS, cb=status, queue=subjects.QUEUE_ROUTER)
    generate_seen: list[bytes] = []

    async def on_generate(msg: nats.aio.msg.Msg) -> None:
        generate_seen.append(msg.data)

    await router.subscribe(subjects.GENERATE, cb=on_generate)
    await flush_all(router)
    inbox = client.new_inbox()
    sub = await client.subscribe(inbox)
    await flush_all(client)
    await client.publish(subjects.ROUTER_STATUS, b"", reply=inbox)
    assert [(await sub.next_msg(5)).data for _ in range(3)] == [b"0", b"1", b"2"]
    rinbox = router.new_inbox()
    rsub = await router.subscribe(rinbox)
    await flush_all(router)
    await worker.publish(rinbox, b"token")
    assert (await rsub.next_msg(5)).data == b"token"
    await worker.publish(subjects.heartbeat("prefill-0"), b"hb")
    await flush_all(worker)
    assert permission_denials(worker) == permission_denials(router) == []
    assert permission_denials(kvi) == permission_denials(client) == []

    # Refusals. A worker cannot send client requests (the router never sees it) ...
    await worker.publish(subjects.GENERATE, b"forged")
    assert "cpd.v1.generate" in await _denied(worker)
    # ... nor visibility changes, nor heart-beat in another node's name.
    for subject in (subjects.KV_VISIBLE, subjects.heartbeat("prefill-1"),
                    subjects.kv_events("prefill-1")):
        n = len(permission_denials(worker))
        await worker.publish(subject, b"x")
        await flush_all(worker)
        await asyncio.sleep(0.05)
        assert len(permission_denials(worker)) == n + 1, subject
    # A core subscription to the events (capabilities inside) is refused everyone.
    await router.subscribe(subjects.KV_EVENTS_ALL)
    assert "cpd.v1.kv.events" in await _denied(router)
    # Nobody reads another identity's replies.
    await client.subscribe(subjects.everything_under(subjects.inbox_prefix("router")))
    assert "_inbox_router" in (await _denied(client)).lower()
    # A client cannot read CPD_KV: creating a consumer is refused (and times out).
    with pytest.raises(nats.errors.TimeoutError):
        await client.jetstream(timeout=1).subscribe(subjects.KV_EVENTS_ALL,
                                                    stream=subjects.KV_STREAM)
    assert any("consumer" in x.lower() for x in permission_denials(client))
    # Nor can a worker (it only may publish into the stream and read its info).
    with pytest.raises(nats.errors.TimeoutError):
        await worker.jetstream(timeout=1).subscribe(subjects.KV_EVENTS_ALL,
                                                    stream=subjects.KV_STREAM)
    await asyncio.sleep(0.1)
    assert generate_seen == []


async def test_wrong_credentials_and_plain_tcp_are_refused(
        secure: tuple[security.SecretsDir, NatsServer], tmp_path: Path) -> None:
    d, server = secure
    good = _nats(secure, "client")
    # Wrong password (user known), a fast typed error naming the setting.
    pw = tmp_path / "pw"
    pw.write_text("not-the-password")
    bad_pw = msgspec.structs.replace(good, nkey_seed_file="", user="client",
                                     password_file=str(pw))
    t = time.monotonic()
    with pytest.raises(NatsAuthFailed, match=r"nats\.user=client"):
        await connect(bad_pw, "bad-pw")
    assert time.monotonic() - t < 5  # refused, not retried forever
    # The right password works too (each identity has both kinds of credentials).
    ok = msgspec.structs.replace(bad_pw, password_file=str(d.folder("client") / "password"))
    await (await connect(ok, "pw-ok")).close()
    # An nkey the server does not know.
    stranger = tmp_path / "stranger.nk"
    stranger.write_text(security.new_credentials(security.Identity("x", "client")).nkey_seed)
    with pytest.raises(NatsAuthFailed, match=r"nats.nkey_seed_file"):
        await connect(msgspec.structs.replace(good, nkey_seed_file=str(stranger)), "stranger")
    # No credentials at all.
    with pytest.raises(NatsAuthFailed, match="no credentials"):
        await connect(msgspec.structs.replace(good, nkey_seed_file=""), "anon")
    # A CA that did not sign the server's certificate.
    other_ca = tmp_path / "other-ca.pem"
    other_ca.write_bytes(security.make_ca().cert)
    with pytest.raises(NatsAuthFailed, match=r"nats.tls_ca_file"):
        await connect(msgspec.structs.replace(good, tls_ca_file=str(other_ca)), "bad-ca")
    # Unreadable/invalid files are named before connecting.
    with pytest.raises(NatsAuthFailed, match=r"nats.nkey_seed_file=.*cannot read"):
        await connect(msgspec.structs.replace(good, nkey_seed_file=str(tmp_path / "no")), "x")
    with pytest.raises(NatsAuthFailed, match="does not hold an nkey seed"):
        await connect(msgspec.structs.replace(good, nkey_seed_file=str(pw)), "x")
    # Plain TCP (no TLS): the server demands TLS and never answers a plain CONNECT.
    host, port = server.url.removeprefix("nats://").split(":")
    with socket.create_connection((host, int(port)), timeout=5) as sock:
        info = sock.recv(4096)
        assert b'"tls_required":true' in info, info
        sock.sendall(b'CONNECT {"verbose":false,"user":"client","pass":"x"}\r\nPING\r\n')
        answer = b""
        with contextlib.suppress(OSError):
            while chunk := sock.recv(4096):  # until the server closes the connection
                answer += chunk
    assert b"PONG" not in answer and b"+OK" not in answer, answer


async def test_mutual_tls_needs_a_client_certificate(tmp_path: Path) -> None:
    d = security.SecretsDir.ensure(tmp_path / "s", security.identities_for({}), mtls=True)
    with NatsServer(store_dir=tmp_path / "nats", config_file=str(d.config_file)) as server:
        s = security.nats_settings_for(d, "client", NatsSettings(servers=[server.url]))
        await (await connect(s, "mtls-ok")).close()
        no_cert = msgspec.structs.replace(s, tls_cert_file="", tls_key_file="")
        with pytest.raises(NatsAuthFailed, match=r"nats.tls_cert_file"):
            await connect(no_cert, "mtls-none")


def _kvindex_settings(secure: tuple[security.SecretsDir, NatsServer], name: str,
                      tmp: Path):
    d, server = secure
    env = {"CPD_NATS__SERVERS": server.url, **d.env(name), "CPD_NODE__NODE_ID": "kvindex-0",
           "CPD_KVINDEX__SNAPSHOT_DIR": str(tmp / "snap"), "CPD_NATS__DRAIN_TIMEOUT_S": "2"}
    return env, load_settings(environ=env)


async def test_a_service_holding_another_services_credentials_is_refused(
        secure: tuple[security.SecretsDir, NatsServer], tmp_path: Path) -> None:
    # kvindex with a worker's identity: refused at once, with a typed error.
    _, stolen = _kvindex_settings(secure, "prefill-0", tmp_path)
    svc = KvIndexService(stolen)
    t = time.monotonic()
    with pytest.raises(PermissionDenied, match="kvindex kvindex-0: NATS refused"):
        await svc.run()
    assert time.monotonic() - t < 4  # not after the JetStream request timed out
    # With its own identity it works: a lookup through the router's identity answers.
    _, own = _kvindex_settings(secure, "kvindex-0", tmp_path)
    svc = KvIndexService(own)
    await svc.start()
    try:
        router = await connect(_nats(secure, "router-0"), "router-as-client")
        try:
            reply = await router.request(subjects.KVINDEX_LOOKUP, wire.encode(
                wire.LookupRequest(request_id="r", namespace="ns", block_hashes=b"")), 5)
            assert isinstance(wire.decode(reply.data), wire.LookupReply | wire.Error)
        finally:
            await router.close()
    finally:
        await svc.stop()


def test_a_refused_service_process_exits_once_with_a_clear_line(
        secure: tuple[security.SecretsDir, NatsServer], tmp_path: Path) -> None:
    env, _ = _kvindex_settings(secure, "router-0", tmp_path)
    out = subprocess.run([sys.executable, "-m", "services.kvindex"],
                         env={**os.environ, **env, "CPD_TELEMETRY__LOG_JSON": "false"},
                         capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert out.returncode == EXIT_REFUSED, out.stderr[-2000:]
    assert "kvindex: refused by NATS" in out.stderr and "Traceback" not in out.stderr


# ------------------------------------------------------------------- end to end


# What the secure cpd up starts besides its workers -> the inboxes its identities read.
_SECURE_TOPOLOGIES = {
    "separate": (("kvindex", "router"), {"_INBOX_router.router-0", "_INBOX_kvindex.kvindex-0"}),
    "frontend": (("frontend",), {"_INBOX_frontend.frontend-0"}),
}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("topology", list(_SECURE_TOPOLOGIES))
async def test_cpd_up_secure_serves_a_request_over_tls_with_auth(tmp_path: Path,
                                                                 topology: str) -> None:
    """``cpd up --secure`` with sim workers: every service (or front end) runs as its own
    identity, the banner says how a client connects, and that client gets its tokens."""
    services, service_inboxes = _SECURE_TOPOLOGIES[topology]
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("CPD_")},
           "CPD_NATS__EMBEDDED_STORE_DIR": str(tmp_path / "nats"),
           "CPD_NATS__SECRETS_DIR": str(tmp_path / "secrets"),
           "CPD_KVINDEX__SNAPSHOT_DIR": str(tmp_path / "snap"),
           "CPD_WORKER__ENGINE": "sim", "CPD_NODE__HEARTBEAT_INTERVAL_S": "0.2",
           "CPD_DATAPLANE__ARENA_BYTES": str(256 << 20),
           # The warm request below must pull over UCX (capabilities, TLS).
           "CPD_ROUTER__WARM_ON_IDLE_PREPREFILL": "false",
           "CPD_TELEMETRY__LOG_JSON": "false", "PYTHONUNBUFFERED": "1"}
    only = [a for s in ("preprefill", "prefill", "decode", *services) for a in ("--only", s)]
    proc = subprocess.Popen([sys.executable, "-m", "tools.cli", "up", "--secure", "--port", "0",
                             *only], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, cwd=ROOT,
                            start_new_session=True)
    try:
        assert proc.stdout is not None
        lines: list[str] = []
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline and not any("Stop:" in x for x in lines):
            line = await asyncio.to_thread(proc.stdout.readline)
            if not line:
                break
            lines.append(line)
        banner = "".join(lines)
        exports = dict(re.findall(r"export (CPD_NATS__\w+)=(\S+)", banner))
        assert {"CPD_NATS__SERVERS", "CPD_NATS__NKEY_SEED_FILE", "CPD_NATS__TLS_CA_FILE",
                "CPD_NATS__INBOX_PREFIX"} <= set(exports), banner
        assert exports["CPD_NATS__INBOX_PREFIX"] == subjects.inbox_prefix("client")
        settings = load_settings(environ=exports)
        async with await Client.connect(settings=settings, name="secure-e2e") as client:
            deadline = time.monotonic() + 30
            while True:  # until the router has seen every worker's heartbeat
                status = await client.status()
                if {n.role for n in status.nodes if n.alive} >= set(WORKER_ROLES):
                    break
                assert time.monotonic() < deadline, status
                await asyncio.sleep(0.2)
            # Workers learn each other's data-plane addresses from heartbeats: one that
            # started after a peer's first heartbeat knows it one interval later.
            await asyncio.sleep(0.5)
            prompt = [*block_token_ids(list(range(1, 9)), 256).tolist(), 7, 8, 9]
            done = await client.generate(prompt, max_tokens=4, ignore_eos=True, timeout_s=30)
            assert len(done.token_ids) == 4 and done.finish_reason == "length"
            assert done.route.decode_node == "decode-0"
            # The hand-off: decode pulled the sealed blocks over UCX and acked the pull.
            assert done.route.decode_tokens_pulled == 8 * 256, done.route
            # The same prompt again is warm: the blocks' events went through CPD_KV to
            # kvindex (the only reader), which made them visible to the router's lookup.
            deadline = time.monotonic() + 20
            while True:
                again = await client.generate(prompt, max_tokens=4, ignore_eos=True,
                                              timeout_s=30)
                if again.route.path != "cold":
                    break
                assert time.monotonic() < deadline, again.route
                await asyncio.sleep(0.3)
            assert again.token_ids == done.token_ids
            # ... and pulled over UCX from the pre-prefill node (kvindex's lookup said where).
            assert again.route.prefill_node == "prefill-0" and again.route.tokens.remote > 0
            # A bus client may not act for a tenant: only the gateway and an admin may.
            with pytest.raises(CpdError) as forged:
                await client.generate(prompt, max_tokens=4, tenant="acme", timeout_s=30)
            assert forged.value.code is ErrorCode.FORGED_SENDER
        # The processes really run as their own identities: each got its own inbox.
        children = Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()
        inboxes = set()
        for pid in children:
            with contextlib.suppress(OSError):
                environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
                inboxes |= {e.split(b"=", 1)[1].decode() for e in environ
                            if e.startswith(b"CPD_NATS__INBOX_PREFIX=")}
        assert {"_INBOX_prefill.prefill-0", *service_inboxes} <= inboxes, inboxes
    finally:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            rest, _ = await asyncio.to_thread(proc.communicate, timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            rest, _ = proc.communicate()
    assert proc.returncode == 0, rest[-3000:]


async def test_cpd_up_stops_waiting_for_a_service_nats_refused(tmp_path: Path) -> None:
    """A service that exited as refused (its credentials cannot work) fails the start at
    once with its log, instead of a readiness wait and a restart loop."""
    from tools.supervisor import Proc, _ready_or_refused, _restart

    log = tmp_path / "kvindex-0.log"
    log.write_text("kvindex: refused by NATS: (the reason)\n")
    proc = Proc("kvindex", "kvindex-0", log, {})
    proc.popen = subprocess.Popen([sys.executable, "-c", f"raise SystemExit({EXIT_REFUSED})"])
    proc.popen.wait(30)
    never: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    with pytest.raises(CpdError, match=r"(?s)NATS refused kvindex-0.*the reason"):
        await asyncio.wait_for(_ready_or_refused([proc], never), 10)
    assert never.cancelled()
    _restart(proc)  # the supervisor leaves it down rather than restarting it
    assert proc.popen.returncode == EXIT_REFUSED and not proc.alive()
