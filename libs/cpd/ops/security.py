"""Least-privilege NATS: identities, credentials, certificates and the server
configuration that gives each identity exactly the subjects its job needs.

The permission table (:func:`permission_table`) is the one place that says who may
publish and subscribe what; every pattern in it comes from :mod:`cpd.protocol.subjects`, so a
subject a service really uses and the permission that allows it cannot drift apart.
The rules that matter most:

* only kvindex creates, reads or consumes the ``CPD_KV`` stream (it carries per-node
  data-plane read capabilities); workers only *publish* their own events into it;
* only kvindex publishes visibility changes (``kv.visible`` / ``kv.invalidate``);
* workers cannot publish client requests (``cpd.v1.generate``);
* clients may only publish ``generate``/``router.status`` and read their own inbox;
* every identity reads replies under its own inbox prefix only
  (:func:`cpd.protocol.subjects.inbox_prefix`); a request is answered through NATS's
  ``allow_responses`` (the answerer may publish to that one reply subject, once), a
  token stream through an explicit publish right on the inboxes of the kinds it serves.

Identities are per kind (``prefill``) or per node (``prefill-0``, with the node's own
subjects only: one prefill node cannot heart-beat or take work in another's name).

Layout of a secrets folder (:class:`SecretsDir`; folders 0700, files 0600)::

    server/    nats-server.conf, server.pem, server-key.pem, ca.pem
    ca/        ca-key.pem                    (only for issuing certificates)
    <name>/    nkey.seed, password, ca.pem[, cert.pem, key.pem]   (one per identity)
    identities.json                          (names, kinds, nodes, public keys, bcrypt hashes)

Pure functions first (tables, credentials, certificates, config text), then files.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import json
import os
import secrets
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

import bcrypt
import msgspec
import nkeys
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from cpd.ops.config import NatsSettings
from cpd.protocol import subjects as s
from cpd.protocol.errors import ConfigError
from cpd.protocol.roles import FRONTEND_PARTS, PREFILL_ROLES, WORKER_ROLES, Role

# Identity kinds: the six services and the front end (three of them in one process),
# plus external callers.
SERVICE_KINDS: Final = (*FRONTEND_PARTS, *WORKER_ROLES, "frontend")
CLIENT: Final = "client"
"""``cpd generate`` / ``cpd status`` and applications: generate and status only."""
ADMIN: Final = "admin"
"""The operator (``cpd up``'s supervisor, ``cpd bench`` cache resets): health/info of
every service, admin subjects, monitoring feeds; no worker, kvindex or stream rights."""
KINDS: Final = (*SERVICE_KINDS, CLIENT, ADMIN)
# Kinds that send generate requests, so the router streams replies into their inboxes.
_REQUESTERS: Final = ("gateway", "frontend", CLIENT, ADMIN)

BCRYPT_COST: Final = 10  # the server checks it on every connect; 10 is ~50 ms
CERT_DAYS: Final = 825  # what browsers and most TLS stacks accept for leaf certificates
DEFAULT_HOSTS: Final = ("localhost", "127.0.0.1", "nats")  # "nats": the compose service


# ----------------------------------------------------------------------------- table


@dataclass(frozen=True)
class Grants:
    """What one identity may do on the bus."""

    publish: tuple[str, ...]
    subscribe: tuple[str, ...]
    # May answer the requests it receives (NATS ``allow_responses``: one reply each).
    responses: bool = False


def inbox_of(kind: str, node: str = "") -> str:
    """The inbox prefix an identity connects with (``nats.inbox_prefix``)."""
    return s.inbox_prefix(kind, node)


def _inboxes(*kinds: str) -> tuple[str, ...]:
    """Every inbox of these kinds (any node): where a stream to them may be published."""
    return tuple(s.everything_under(s.inbox_prefix(k)) for k in kinds)


def permission_table(node: str = "") -> dict[str, Grants]:
    """Grants of every identity kind; ``node`` narrows per-node subjects to that node
    (``""``: any node of the kind). The single source of NATS permissions."""
    n = node or s.ANY

    def own(kind: str) -> tuple[str, ...]:
        # Its own replies, and (services) its NATS micro health/info/stats endpoints
        # plus a PING of its own kind for `cpd health` run in its container.
        base = (s.everything_under(s.inbox_prefix(kind, node)),)
        return base + tuple(s.micro_endpoints(kind)) if kind in SERVICE_KINDS else base

    def service_pub(kind: str) -> tuple[str, ...]:
        return (s.micro_ping(kind),)

    def worker(role: str) -> Grants:
        publish = (
            *service_pub(role),
            s.for_node(s.heartbeat, node=n),
            s.for_node(s.load, role, node=n),
            s.for_node(s.kv_events, node=n),      # into CPD_KV (a JetStream publish)
            s.js_stream_info(s.KV_STREAM),        # waits for the stream; no messages
            # Its own last event: its last epoch (a restart always starts past it).
            s.js_direct_last(s.KV_STREAM, s.for_node(s.kv_events, node=n)),
            *_inboxes("router", "frontend"),      # token streams go to the router
            s.KVINDEX_CHECKSUMS,                  # what a pulled block's writer sealed
        )
        subscribe = (
            *own(role),
            s.HEARTBEAT_ALL,                      # peers' data-plane addresses
            s.for_node(s.run, role, node=n),
            s.for_node(s.admin, role, node=n),
            s.for_node(s.kv_reannounce, node=n),
            s.for_node(s.kv_copies, node=n),      # which of its blocks have copies elsewhere
            s.for_node(s.cancel, node=n),         # the router's "stop generating"
        )
        if role in PREFILL_ROLES:
            publish += (s.for_node(s.run, Role.DECODE),)        # hand-off to any decode node
            subscribe += (s.for_node(s.pull_ack, node=n),)   # decode's "pull done"
        else:
            publish += (s.for_node(s.pull_ack),)             # to the pinning node
        return Grants(publish, subscribe, responses=True)

    table = {
        "kvindex": Grants(
            publish=(*service_pub("kvindex"), s.KV_VISIBLE, s.KV_INVALIDATE,
                     s.KV_DEADLETTER, s.for_node(s.kv_reannounce), s.for_node(s.kv_copies),
                     s.kv_events(s.KVINDEX_EVENTS_NODE),  # its own lease-expiry events
                     s.JS_API_INFO, *s.js_stream_admin(s.KV_STREAM)),
            subscribe=(*own("kvindex"), s.KVINDEX_LOOKUP, s.KVINDEX_CHECKSUMS,
                       s.HEARTBEAT_ALL),
            responses=True),
        "router": Grants(
            publish=(*service_pub("router"), s.KVINDEX_LOOKUP,
                     *(s.for_node(s.run, r) for r in PREFILL_ROLES),
                     s.for_node(s.cancel),
                     *_inboxes(*_REQUESTERS)),
            subscribe=(*own("router"), s.GENERATE, s.GENERATE_CANCEL, s.GENERATE_SUPERSEDE,
                       s.ROUTER_STATUS,
                       s.HEARTBEAT_ALL,
                       s.LOAD_ALL, s.KV_VISIBLE, s.KV_INVALIDATE),
            responses=True),
        "gateway": Grants(
            publish=(*service_pub("gateway"), s.GENERATE, s.GENERATE_CANCEL,
                     s.GENERATE_SUPERSEDE, s.ROUTER_STATUS),
            subscribe=own("gateway"), responses=True),
        **{role: worker(role) for role in WORKER_ROLES},
        CLIENT: Grants(publish=(s.GENERATE, s.GENERATE_CANCEL, s.ROUTER_STATUS),
                       subscribe=own(CLIENT)),
        ADMIN: Grants(
            publish=(s.GENERATE, s.GENERATE_CANCEL, s.GENERATE_SUPERSEDE, s.ROUTER_STATUS,
                     s.KVINDEX_LOOKUP,
                     s.everything_under(s.MICRO_ROOT),
                     *(s.for_node(s.admin, r) for r in WORKER_ROLES)),
            subscribe=(*own(ADMIN), s.HEARTBEAT_ALL, s.LOAD_ALL, s.KV_DEADLETTER)),
    }
    return {**table, "frontend": _frontend(table, node)}


def _frontend(table: dict[str, Grants], node: str) -> Grants:
    """A front end's grants: those of the services it hosts, with its own inbox in
    place of theirs (its parts share one identity)."""
    parts = [table[kind] for kind in FRONTEND_PARTS]
    inboxes = {s.everything_under(s.inbox_prefix(kind, node)) for kind in FRONTEND_PARTS}
    subscribe = [s.everything_under(s.inbox_prefix("frontend", node))]
    subscribe += [x for g in parts for x in g.subscribe if x not in inboxes]
    return Grants(publish=tuple(dict.fromkeys(x for g in parts for x in g.publish)),
                  subscribe=tuple(dict.fromkeys(subscribe)), responses=True)


def subject_matches(pattern: str, subject: str) -> bool:
    """NATS subject matching: ``*`` is one token, a final ``>`` one or more tokens."""
    p, t = pattern.split("."), subject.split(".")
    for i, tok in enumerate(p):
        if tok == ">":
            return len(t) > i
        if i >= len(t) or (tok != "*" and tok != t[i]):
            return False
    return len(p) == len(t)


def allows(patterns: Iterable[str], subject: str) -> bool:
    """Whether any of ``patterns`` matches ``subject``."""
    return any(subject_matches(p, subject) for p in patterns)


def grants(kind: str, node: str = "") -> Grants:
    """The grants of one identity (see :func:`permission_table`)."""
    if kind not in KINDS:
        raise ConfigError(f"unknown identity kind {kind!r}; known: {', '.join(KINDS)}")
    return permission_table(node)[kind]


# ------------------------------------------------------------------------ identities


@dataclass(frozen=True)
class Identity:
    """Who connects: ``name`` is the NATS user name and the secrets sub-folder."""

    name: str
    kind: str
    node: str = ""  # "" = every node of the kind shares this identity

    def __post_init__(self) -> None:
        s.check_token(self.name, "identity name")
        if self.kind not in KINDS:
            raise ConfigError(f"identity {self.name}: unknown kind {self.kind!r}")
        if self.node:
            s.check_token(self.node, "node id")

    @property
    def inbox_prefix(self) -> str:
        return inbox_of(self.kind, self.node)

    @property
    def grants(self) -> Grants:
        return grants(self.kind, self.node)


def identities_for(nodes: Mapping[str, str] | Iterable[tuple[str, str]]) -> list[Identity]:
    """One identity per ``node -> kind`` (named after the node), plus ``client`` and
    ``admin``."""
    pairs = nodes.items() if isinstance(nodes, Mapping) else nodes
    out = [Identity(node, kind, node) for node, kind in pairs]
    out += [Identity(CLIENT, CLIENT), Identity(ADMIN, ADMIN)]
    return out


@dataclass(frozen=True)
class Credentials:
    """The secrets of one identity: a password and an nkey user seed (either works)."""

    identity: Identity
    password: str
    nkey_seed: str

    @property
    def nkey_public(self) -> str:
        return nkey_public(self.nkey_seed)


def new_credentials(identity: Identity) -> Credentials:
    """Fresh random credentials for ``identity``."""
    seed = nkeys.encode_seed(secrets.token_bytes(32), nkeys.PREFIX_BYTE_USER).decode()
    return Credentials(identity, secrets.token_urlsafe(32), seed)


def nkey_public(seed: str) -> str:
    """The public user key (``U...``) of an nkey seed (``SU...``)."""
    try:
        kp = nkeys.from_seed(seed.strip().encode())
        return kp.public_key.decode()
    except (nkeys.NkeysError, ValueError) as e:
        raise ConfigError(f"not an nkey seed: {e!r}") from None


def hash_password(password: str) -> str:
    """bcrypt hash for the server config: the server never holds the password itself."""
    return bcrypt.hashpw(password.encode(), bcrypt.gensalt(BCRYPT_COST)).decode()


# ---------------------------------------------------------------------- certificates


@dataclass(frozen=True)
class CertKey:
    """A PEM certificate and its PEM private key."""

    cert: bytes
    key: bytes


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "CPD"),
                      x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def make_ca(cn: str = "CPD NATS CA", days: int = CERT_DAYS * 4) -> CertKey:
    """A self-signed certificate authority for this deployment."""
    key = ec.generate_private_key(ec.SECP256R1())
    now = dt.datetime.now(dt.UTC)
    cert = (x509.CertificateBuilder().subject_name(_name(cn)).issuer_name(_name(cn))
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5))
            .not_valid_after(now + dt.timedelta(days=days))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True,
                                         crl_sign=True, content_commitment=False,
                                         key_encipherment=False, data_encipherment=False,
                                         key_agreement=False, encipher_only=False,
                                         decipher_only=False), critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()),
                           critical=False)
            .sign(key, hashes.SHA256()))
    return CertKey(cert.public_bytes(serialization.Encoding.PEM), _pem_key(key))


def issue_cert(ca: CertKey, cn: str, *, hosts: Iterable[str] = (), server: bool,
               days: int = CERT_DAYS) -> CertKey:
    """A leaf certificate signed by ``ca``: a server one (``hosts`` as DNS/IP names) or
    a client one (``cn`` names the identity)."""
    ca_cert = x509.load_pem_x509_certificate(ca.cert)
    ca_key = serialization.load_pem_private_key(ca.key, password=None)
    assert isinstance(ca_key, ec.EllipticCurvePrivateKey)
    key = ec.generate_private_key(ec.SECP256R1())
    now = dt.datetime.now(dt.UTC)
    names: list[x509.GeneralName] = []
    for h in hosts:
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(h)))
        except ValueError:
            names.append(x509.DNSName(h))
    b = (x509.CertificateBuilder().subject_name(_name(cn)).issuer_name(ca_cert.subject)
         .public_key(key.public_key()).serial_number(x509.random_serial_number())
         .not_valid_before(now - dt.timedelta(minutes=5))
         .not_valid_after(now + dt.timedelta(days=days))
         .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
         .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH if server
                                               else ExtendedKeyUsageOID.CLIENT_AUTH]),
                        critical=False)
         .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(
             ca_cert.public_key()), critical=False))  # type: ignore[arg-type]
    if names:
        b = b.add_extension(x509.SubjectAlternativeName(names), critical=False)
    cert = b.sign(ca_key, hashes.SHA256())
    return CertKey(cert.public_bytes(serialization.Encoding.PEM), _pem_key(key))


# --------------------------------------------------------------------- server config


@dataclass(frozen=True)
class ServerTls:
    """Paths, as the server sees them, of its TLS files."""

    cert_file: str
    key_file: str
    ca_file: str
    verify_clients: bool = False  # mutual TLS: every client shows a certificate


def _q(value: str) -> str:
    # JSON strings are valid NATS config strings, and quoting keeps "$JS..." and
    # "$SRV..." literal (an unquoted "$X" is a variable reference there).
    return json.dumps(value)


def _perm_block(g: Grants, indent: str) -> str:
    lines = [f"{indent}permissions: {{",
             f"{indent}  publish: {{ allow: [{', '.join(_q(x) for x in g.publish)}] }}",
             f"{indent}  subscribe: {{ allow: [{', '.join(_q(x) for x in g.subscribe)}] }}"]
    if g.responses:
        lines.append(f"{indent}  allow_responses: true")
    lines.append(f"{indent}}}")
    return "\n".join(lines)


def server_config(users: Iterable[tuple[Identity, str, str]], *, tls: ServerTls | None,
                  store_dir: str | None = None, listen: str | None = None,
                  http: str | None = None) -> str:
    """The nats-server configuration text. ``users``: (identity, bcrypt password hash,
    public nkey) - each identity may log in with either, under the same permissions.
    ``store_dir``/``listen``/``http`` are left out when the command line gives them."""
    out = ["# Generated by cpd.ops.security (`cpd secure init` / `cpd up --secure`): regenerate",
           "# rather than edit; permissions come from cpd.ops.security.permission_table.", ""]
    if listen:
        out.append(f"listen: {_q(listen)}")
    if http:
        out.append(f"http: {_q(http)}")
    out.append("jetstream {" + (f" store_dir: {_q(store_dir)} " if store_dir else " ") + "}")
    if tls:
        out += ["tls {", f"  cert_file: {_q(tls.cert_file)}", f"  key_file: {_q(tls.key_file)}",
                f"  ca_file: {_q(tls.ca_file)}", f"  verify: {str(tls.verify_clients).lower()}",
                "  timeout: 5", "}"]
    out += ["", "authorization {", "  users: ["]
    for ident, pw_hash, nkey in users:
        block = _perm_block(ident.grants, "      ")
        out += [f"    # {ident.name} ({ident.kind}{', node ' + ident.node if ident.node else ''})",
                f"    {{ user: {_q(ident.name)}, password: {_q(pw_hash)},",
                block, "    }",
                f"    {{ nkey: {_q(nkey)},", block, "    }"]
    out += ["  ]", "}", ""]
    return "\n".join(out)


# --------------------------------------------------------------------------- files


SERVER_DIR: Final = "server"
CA_DIR: Final = "ca"
MANIFEST: Final = "identities.json"
CONFIG_FILE: Final = "nats-server.conf"
# Names inside an identity's folder (mounted as one folder into its container).
NKEY_FILE: Final = "nkey.seed"
PASSWORD_FILE: Final = "password"
CA_FILE: Final = "ca.pem"
CERT_FILE: Final = "cert.pem"
KEY_FILE: Final = "key.pem"
SERVER_CERT: Final = "server.pem"
SERVER_KEY: Final = "server-key.pem"


def _write(path: Path, data: bytes | str, mode: int = 0o600) -> None:
    """Write a secret: created 0600 (never briefly world-readable), replaced atomically."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    with os.fdopen(fd, "wb") as f:
        f.write(data.encode() if isinstance(data, str) else data)
    os.chmod(tmp, mode)
    os.replace(tmp, path)


@dataclass
class SecretsDir:
    """A folder of generated secrets, created or completed by :meth:`ensure`."""

    root: Path
    identities: dict[str, Identity] = field(default_factory=dict)
    mtls: bool = False
    hosts: tuple[str, ...] = DEFAULT_HOSTS

    @classmethod
    def ensure(cls, root: str | os.PathLike[str], identities: Iterable[Identity], *,
               hosts: Iterable[str] = DEFAULT_HOSTS, mtls: bool = False,
               server_root: str | None = None, store_dir: str | None = None,
               listen: str | None = None, http: str | None = None) -> SecretsDir:
        """Reuse what ``root`` holds, add what is missing (new identities, client
        certificates when ``mtls``), and (re)write the server config. ``server_root``
        is where the server will see ``root/server`` (a container mount); default: there."""
        root = Path(root).expanduser().resolve()
        root.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.chmod(root, 0o700)
        self = cls(root, mtls=mtls, hosts=tuple(dict.fromkeys(hosts)))
        known = self._load_manifest()
        for ident in identities:
            if ident.name in known and known[ident.name] != ident:
                raise ConfigError(f"{root}: identity {ident.name} exists as "
                                  f"{known[ident.name]}, not {ident}")
            known[ident.name] = ident
        self.identities = known
        ca = self._ca()
        server_cert = root / SERVER_DIR / SERVER_CERT
        manifest = self._read_json()
        if not server_cert.exists() or tuple(manifest.get("hosts", ())) != self.hosts:
            leaf = issue_cert(ca, "nats-server", hosts=self.hosts, server=True)
            _write(root / SERVER_DIR / SERVER_KEY, leaf.key)
            _write(server_cert, leaf.cert)
        _write(root / SERVER_DIR / CA_FILE, ca.cert)
        users = []
        # bcrypt is slow on purpose: keep the hash of a password that did not change.
        old_hashes = {x["name"]: x for x in manifest.get("identities", [])}
        hashes: dict[str, str] = {}
        for ident in known.values():
            folder = root / ident.name
            fresh = not (folder / PASSWORD_FILE).exists()
            creds = self._credentials(ident, folder)
            old = old_hashes.get(ident.name, {})
            hashes[ident.name] = (old["password_hash"] if not fresh and old.get("password_hash")
                                  else hash_password(creds.password))
            _write(folder / CA_FILE, ca.cert)
            if mtls and not (folder / CERT_FILE).exists():
                leaf = issue_cert(ca, ident.name, server=False)
                _write(folder / KEY_FILE, leaf.key)
                _write(folder / CERT_FILE, leaf.cert)
            users.append((ident, hashes[ident.name], creds.nkey_public))
        where = Path(server_root) if server_root else root / SERVER_DIR
        tls = ServerTls(str(where / SERVER_CERT), str(where / SERVER_KEY), str(where / CA_FILE),
                        verify_clients=mtls)
        _write(self.config_file, server_config(users, tls=tls, store_dir=store_dir,
                                               listen=listen, http=http))
        _write(root / MANIFEST, json.dumps({
            "hosts": list(self.hosts), "mtls": mtls,
            "identities": [{"name": i.name, "kind": i.kind, "node": i.node,
                            "nkey": nkey_public((root / i.name / NKEY_FILE).read_text()),
                            "password_hash": hashes[i.name]}
                           for i in known.values()]}, indent=2) + "\n")
        return self

    @property
    def config_file(self) -> Path:
        return self.root / SERVER_DIR / CONFIG_FILE

    def folder(self, name: str) -> Path:
        """The folder of one identity's secrets."""
        if name not in self.identities:
            raise ConfigError(f"no identity {name!r} in {self.root}")
        return self.root / name

    def credentials(self, name: str) -> Credentials:
        """The stored credentials of one identity."""
        folder = self.folder(name)
        return Credentials(self.identities[name], (folder / PASSWORD_FILE).read_text().strip(),
                           (folder / NKEY_FILE).read_text().strip())

    def env(self, name: str, *, mount: str | None = None, auth: str = "nkey") -> dict[str, str]:
        """``CPD_NATS__*`` variables that make a process connect as ``name``; ``mount``
        is where the process sees the identity's folder (default: where it is).
        ``auth``: ``nkey`` or ``password`` (user + password file)."""
        return identity_env(self.identities[name], mount or str(self.folder(name)),
                            mtls=self.mtls, auth=auth)

    # -- helpers ---------------------------------------------------------------------

    def _read_json(self) -> dict:
        path = self.root / MANIFEST
        if not path.exists():
            return {}
        try:
            return json.loads(path.read_text())
        except ValueError as e:
            raise ConfigError(f"{path} is not valid JSON: {e}") from None

    def _load_manifest(self) -> dict[str, Identity]:
        return {x["name"]: Identity(x["name"], x["kind"], x.get("node", ""))
                for x in self._read_json().get("identities", [])}

    def _ca(self) -> CertKey:
        cert, key = self.root / SERVER_DIR / CA_FILE, self.root / CA_DIR / "ca-key.pem"
        if cert.exists() and key.exists():
            return CertKey(cert.read_bytes(), key.read_bytes())
        ca = make_ca()
        _write(key, ca.key)
        _write(cert, ca.cert)
        # A new CA invalidates every certificate it did not sign.
        (self.root / SERVER_DIR / SERVER_CERT).unlink(missing_ok=True)
        for name in self.identities:
            (self.root / name / CERT_FILE).unlink(missing_ok=True)
        return ca

    @staticmethod
    def _credentials(ident: Identity, folder: Path) -> Credentials:
        pw, seed = folder / PASSWORD_FILE, folder / NKEY_FILE
        if pw.exists() and seed.exists():
            return Credentials(ident, pw.read_text().strip(), seed.read_text().strip())
        creds = new_credentials(ident)
        _write(pw, creds.password)
        _write(seed, creds.nkey_seed)
        return creds


def identity_env(ident: Identity, folder: str, *, mtls: bool,
                 auth: str = "nkey") -> dict[str, str]:
    """``CPD_NATS__*`` variables for ``ident`` whose secrets are at ``folder`` (pure)."""
    env = {"CPD_NATS__INBOX_PREFIX": ident.inbox_prefix,
           "CPD_NATS__TLS_CA_FILE": f"{folder}/{CA_FILE}"}
    if auth == "nkey":
        env["CPD_NATS__NKEY_SEED_FILE"] = f"{folder}/{NKEY_FILE}"
    elif auth == "password":
        env["CPD_NATS__USER"] = ident.name
        env["CPD_NATS__PASSWORD_FILE"] = f"{folder}/{PASSWORD_FILE}"
    else:
        raise ConfigError(f"auth must be 'nkey' or 'password', not {auth!r}")
    if mtls:
        env["CPD_NATS__TLS_CERT_FILE"] = f"{folder}/{CERT_FILE}"
        env["CPD_NATS__TLS_KEY_FILE"] = f"{folder}/{KEY_FILE}"
    return env


def nats_settings_for(secrets: SecretsDir, name: str, base: NatsSettings) -> NatsSettings:
    """``base`` with the identity ``name`` of ``secrets`` (nkey, TLS, inbox prefix): how
    an in-process client such as ``cpd up``'s supervisor connects as that identity."""
    ident = secrets.identities[name]
    folder = secrets.folder(name)
    extra = {"tls_cert_file": str(folder / CERT_FILE),
             "tls_key_file": str(folder / KEY_FILE)} if secrets.mtls else {}
    return msgspec.structs.replace(base, user="", password="", password_file="",
                                   creds_file="", nkey_seed_file=str(folder / NKEY_FILE),
                                   tls_ca_file=str(folder / CA_FILE),
                                   inbox_prefix=ident.inbox_prefix, **extra)
