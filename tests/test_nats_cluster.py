"""A NATS cluster with JetStream as ``cpd nats cluster`` configures it: the configs are
valid for nats-server, kvindex keeps the CPD_KV stream at three replicas across the
members, and a member killed with ``kill -9`` loses no block event."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from cpd.bus import Bus
from cpd.kvstore import events as kvevents
from cpd.ops import natscluster, security
from cpd.ops.config import Settings, load_settings
from cpd.ops.natsserver import NatsCluster, nats_server_binary
from cpd.ops.netif import interface_ipv4
from cpd.protocol import subjects, wire
from cpd.protocol.errors import ConfigError, CpdError
from cpd.protocol.hashing import Namespace, block_hashes
from cpd.transfer.runtime import ucx_options
from services.kvindex import KvIndexService
from tests.helpers.cluster import free_ports

pytestmark = pytest.mark.timeout(120)

NS = Namespace(model_id="cpd-tiny", model_revision="r1", tokenizer_hash="t",
               kv_dtype="float32", block_size=4)


def test_cli_writes_a_valid_config_per_member(tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, "-m", "tools.cli", "nats", "cluster",
                          str(tmp_path / "c"), "--size", "3", "--host", "10.9.0.1",
                          "--host", "10.9.0.2", "--host", "10.9.0.3"],
                         capture_output=True, text=True, check=True).stdout
    seeds = "nats://10.9.0.1:4222,nats://10.9.0.2:4222,nats://10.9.0.3:4222"
    assert f"CPD_NATS__SERVERS={seeds}" in out.splitlines()[-2]
    assert load_settings(environ={"CPD_NATS__SERVERS": seeds}).nats.servers == seeds.split(",")
    for i in range(3):
        conf = tmp_path / "c" / f"nats-{i}.conf"
        assert conf.stat().st_mode & 0o077 == 0  # holds the route password
        check = subprocess.run([nats_server_binary(), "-t", "-c", str(conf)],
                               capture_output=True, text=True)
        assert check.returncode == 0, check.stderr
        text = conf.read_text()
        # Routes to the two others, never to itself.
        assert text.count("nats-route://") == 2 and f"@10.9.0.{i + 1}:" not in text


def test_cli_cluster_includes_the_least_privilege_config(tmp_path: Path) -> None:
    secrets = tmp_path / "secrets"
    security.SecretsDir.ensure(secrets, security.identities_for({"kvindex-0": "kvindex"}),
                               hosts=["nats-0", "nats-1"], listen="0.0.0.0:4222")
    subprocess.run([sys.executable, "-m", "tools.cli", "nats", "cluster", "-", "--size",
                    "2", "--secrets", str(secrets)], capture_output=True, check=True)
    conf = secrets / security.SERVER_DIR / "nats-1.conf"
    assert f'include "{security.CONFIG_FILE}"' in conf.read_text()
    check = subprocess.run([nats_server_binary(), "-t", "-c", str(conf)],
                           capture_output=True, text=True)
    assert check.returncode == 0, check.stderr


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[NatsCluster]:
    for attempt in range(3):
        # A free port may be taken by another process before a member binds it (the
        # suite's engines listen too): then the cluster starts again on fresh ports.
        ports = free_ports(9)
        members = [natscluster.Member(f"nats-{i}", "127.0.0.1", *ports[3 * i:3 * i + 3])
                   for i in range(3)]
        c = NatsCluster(tmp_path / f"nats-{attempt}", members)
        try:
            c.start()
            break
        except CpdError:
            c.stop()
            if attempt == 2:
                raise
    try:
        yield c
    finally:
        c.stop()


def _settings(urls: list[str], tmp: Path, node: str) -> Settings:
    return load_settings(environ={}, overrides=[
        f"nats.servers={','.join(urls)}", "nats.reconnect_wait_s=0.1",
        "nats.drain_timeout_s=2", f"node.node_id={node}", "kvindex.stream_replicas=3",
        f"kvindex.snapshot_dir={tmp / 'snap'}"])


@pytest.fixture
async def kvindex(cluster: NatsCluster, tmp_path: Path) -> AsyncIterator[KvIndexService]:
    svc = KvIndexService(_settings(cluster.urls, tmp_path, "kvi-0"))
    await svc.start()
    try:
        yield svc
    finally:
        await svc.stop()


def _chain(n_blocks: int, seed: int) -> tuple[bytes, list[wire.BlockRef]]:
    hs = block_hashes(NS, [(seed * 7919 + i) % 50_000 for i in range(n_blocks * 4)])
    return hs, [wire.BlockRef(hs[i * 16:(i + 1) * 16], hs[(i - 1) * 16:i * 16] if i else b"",
                              4) for i in range(n_blocks)]


async def _beat(bus: Bus, node: str, epoch: int) -> None:
    while True:
        await bus.publish(subjects.heartbeat(node), wire.Heartbeat(
            node=node, role="prefill", started_unix_ms=epoch, lease_ttl_ms=60_000,
            namespace=NS.id, namespace_spec=NS.to_spec()))
        await asyncio.sleep(0.2)


async def _visible(bus: Bus, hs: bytes) -> int:
    try:
        reply = await bus.request(subjects.KVINDEX_LOOKUP, wire.LookupRequest(
            request_id="q", namespace=NS.id, block_hashes=hs), expect=wire.LookupReply,
            timeout=2.0)
    except (CpdError, TimeoutError):  # a member is down: asked again
        return -1
    return reply.num_blocks


async def test_member_killed_loses_no_block_event(cluster: NatsCluster,
                                                  kvindex: KvIndexService,
                                                  tmp_path: Path) -> None:
    # The writer reaches the cluster through the member about to die; kvindex and the
    # reader fail over to the other two.
    first = [cluster.urls[0]]
    writer = await Bus.open(_settings(first, tmp_path, "w0"), "writer")
    reader = await Bus.open(_settings(cluster.urls[1:], tmp_path, "r0"), "reader")
    beat = asyncio.create_task(_beat(writer, "w0", 11))
    try:
        js = writer.nc.jetstream()
        info = await js.stream_info(subjects.KV_STREAM)
        assert info.config.num_replicas == 3
        assert info.cluster is not None and len(info.cluster.replicas or []) == 2
        pub = kvevents.KvEventPublisher(js, "w0", epoch=11)
        chains = [_chain(8, seed) for seed in range(20)]
        for _, refs in chains[:10]:
            await pub.allocated(NS.id, refs)
            await pub.sealed(NS.id, [wire.BlockSeal(r.hash, 4096, 1) for r in refs])
        # Kill the member the writer is connected to: it reconnects to a survivor (it
        # learnt them from the server) and its publishes retry until a leader is elected.
        cluster.servers["nats-0"].kill()
        t_kill = time.monotonic()
        for _, refs in chains[10:]:
            await pub.allocated(NS.id, refs)
            await pub.sealed(NS.id, [wire.BlockSeal(r.hash, 4096, 1) for r in refs])
        deadline = time.monotonic() + 60
        counts: list[int] = []
        while time.monotonic() < deadline:
            counts = [await _visible(reader, hs) for hs, _ in chains]
            if counts == [8] * 20:
                break
            await asyncio.sleep(0.2)
        recovery_s = time.monotonic() - t_kill
        assert counts == [8] * 20, counts
        assert kvindex.index.num_locations == 20 * 8
        # The stream lost no event: its last sequence is every publish, once.
        info = await reader.nc.jetstream().stream_info(subjects.KV_STREAM)
        assert info.state.messages == pub.seq == 40
        print(f"recovered in {recovery_s:.2f} s after kill -9 of a member")
    finally:
        beat.cancel()
        await writer.close()
        await reader.close()


def test_cpd_serve_joins_the_cluster_through_its_seeds(cluster: NatsCluster,
                                                       tmp_path: Path) -> None:
    """``cpd serve kvindex`` and ``cpd serve router`` are processes of their own that join
    the NATS cluster named in ``nats.servers``; ``cpd health`` finds them through another
    member; SIGTERM stops them cleanly."""
    env = {**os.environ, "CPD_NATS__SERVERS": ",".join(cluster.urls),
           "CPD_KVINDEX__SNAPSHOT_DIR": str(tmp_path / "snap"),
           "CPD_KVINDEX__STREAM_REPLICAS": "3", "CPD_TELEMETRY__LOG_JSON": "false",
           "CPD_ROUTER__POLICY": "pd-rr", "CPD_WORKER__ENGINE": "sim"}
    procs = {}
    try:
        for service in ("kvindex", "router"):
            procs[service] = subprocess.Popen(
                [sys.executable, "-m", "tools.cli", "serve", service],
                env={**env, "CPD_NODE__NODE_ID": f"{service}-s"}, start_new_session=True,
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        for service, proc in procs.items():
            probe = {**env, "CPD_NATS__SERVERS": cluster.urls[2]}
            deadline = time.monotonic() + 60
            while True:
                rc = subprocess.run([sys.executable, "-m", "tools.cli", "health", service,
                                     "--node", f"{service}-s"], env=probe,
                                    capture_output=True).returncode
                if rc == 0 or time.monotonic() > deadline or proc.poll() is not None:
                    break
            assert rc == 0, proc.stdout.read().decode() if proc.poll() is not None else rc
        for proc in procs.values():
            proc.send_signal(signal.SIGTERM)
        for service, proc in procs.items():
            assert proc.wait(timeout=30) == 0, (service, proc.stdout.read().decode()[-3000:])
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def test_advertise_interface_gives_the_address_and_ucx_devices() -> None:
    assert interface_ipv4("lo") == "127.0.0.1"
    with pytest.raises(ConfigError):
        interface_ipv4("cpd-no-such0")
    s = load_settings(environ={"CPD_DATAPLANE__ADVERTISE_INTERFACE": "lo"})
    assert ucx_options(s.dataplane)["NET_DEVICES"] == "lo"
    s = load_settings(environ={"CPD_DATAPLANE__ADVERTISE_INTERFACE": "lo",
                               "CPD_DATAPLANE__UCX_NET_DEVICES": "mlx5_0:1"})
    assert ucx_options(s.dataplane)["NET_DEVICES"] == "mlx5_0:1"
    assert "NET_DEVICES" not in ucx_options(load_settings(environ={}).dataplane)
