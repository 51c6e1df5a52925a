"""The shared launcher (tools.cluster): specs, settings checked before anything starts, a
clean child environment, node verbs and a stop that leaves nothing behind."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from cpd.protocol.errors import ConfigError, CpdError
from tools.cluster import (
    Cluster,
    ClusterSpec,
    NatsSpec,
    NodeSpec,
    env_overrides,
    override_env,
)


def test_specs_name_nodes_as_cpd_up_and_refuse_repeats() -> None:
    spec = ClusterSpec.topology({"kvindex": 1, "prefill": 2, "router": 1})
    assert spec.services() == {"kvindex-0": "kvindex", "prefill-0": "prefill",
                               "prefill-1": "prefill", "router-0": "router"}
    assert [n.stage for n in spec.nodes] == [0, 1, 1, 2]
    with pytest.raises(ConfigError, match="repeat"):
        ClusterSpec(nodes=(NodeSpec("a", "kvindex"), NodeSpec("a", "router")))


def test_env_settings_round_trip_as_overrides() -> None:
    env = {"CPD_SIM__TIME_SCALE": "0.5", "CPD_WORKER__AUDIT_DIR": "/x"}
    assert override_env(env_overrides(env)) == env
    with pytest.raises(ConfigError):
        env_overrides({"PATH": "/bin"})


def test_cpd_ups_environment_keeps_the_callers_settings_but_no_inherited_identity(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CPD_SIM__TIME_SCALE", "7")
    monkeypatch.setenv("CPD_NATS__NKEY_SEED_FILE", "/caller/seed")
    spec = ClusterSpec(nodes=(), inherit_cpd_env=True, harness_defaults=False,
                       nats=NatsSpec(config_file="/secrets/nats.conf"))
    env = spec.base_env(Path("/w"), "nats://127.0.0.1:1")
    assert env["CPD_SIM__TIME_SCALE"] == "7" and env["CPD_NATS__SERVERS"] == "nats://127.0.0.1:1"
    assert "CPD_NATS__NKEY_SEED_FILE" not in env  # secured: identities come per node
    assert "CPD_WORKER__ENGINE" not in env and "CPD_KVINDEX__SNAPSHOT_DIR" not in env
    node = NodeSpec("kvindex-0", "kvindex", env={"CPD_NATS__NKEY_SEED_FILE": "/own"},
                    start_stage=1)
    assert node.child_env(env)["CPD_NATS__NKEY_SEED_FILE"] == "/own" and node.stage == 1


async def test_a_node_added_without_waiting_runs_and_a_removed_one_is_gone() -> None:
    async with Cluster(ClusterSpec(nodes=(), label="t")) as cluster:
        await cluster.add(NodeSpec("kvi", "kvindex"), wait=False)
        assert cluster.alive("kvi") and cluster.spec.services() == {"kvi": "kvindex"}
        with pytest.raises(ConfigError, match="repeat"):
            await cluster.add(NodeSpec("kvi", "kvindex"))
        pid = cluster.pid("kvi")
        await cluster.remove("kvi")
        assert not cluster.procs and not cluster.spec.nodes
        assert not Path(f"/proc/{pid}").exists()


async def test_a_bad_setting_fails_before_anything_starts() -> None:
    cluster = Cluster(ClusterSpec(nodes=(NodeSpec("kvi", "kvindex"),),
                                  overrides=("kvindex.no_such_field=1",)))
    with pytest.raises(ConfigError):
        await cluster.start()
    assert cluster.nats is None and not cluster.procs
    assert not cluster.workdir.exists()


async def test_a_node_that_exits_fails_the_start_at_once_with_its_log() -> None:
    broken = NodeSpec("kvi", "kvindex", env={"PYTHONHOME": "/nonexistent"})  # no stdlib
    cluster = Cluster(ClusterSpec(nodes=(broken,), label="broken"))
    t0 = time.monotonic()
    with pytest.raises(CpdError, match=r"(?s)kvi exited \(code 1\) during start-up.*Python"):
        await cluster.start()
    assert time.monotonic() - t0 < 30  # not the readiness timeout
    assert not cluster.alive("kvi") and not cluster.workdir.exists()
    assert cluster.nats is not None and cluster.nats.proc is not None
    assert cluster.nats.proc.poll() is not None


@pytest.mark.timeout(90)
async def test_node_verbs_and_a_stop_that_leaves_nothing(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # The caller's own settings (a stray config file, a sim setting) stay out.
    monkeypatch.setenv("CPD_CONFIG", "/nonexistent/cpd.toml")
    monkeypatch.setenv("CPD_SIM__TIME_SCALE", "7")
    spec = ClusterSpec(nodes=(NodeSpec("kvi", "kvindex"),),
                       overrides=("kvindex.snapshot_interval_s=3600",), label="t")
    async with Cluster(spec) as cluster:
        workdir = cluster.workdir
        env = _environ(cluster.pid("kvi"))
        assert "CPD_CONFIG" not in env and "CPD_SIM__TIME_SCALE" not in env
        assert env["CPD_KVINDEX__SNAPSHOT_INTERVAL_S"] == "3600"
        assert env["CPD_NODE__NODE_ID"] == "kvi" and env["CPD_NATS__SERVERS"] == cluster.url
        assert cluster.settings("kvi").kvindex.snapshot_interval_s == 3600
        first = cluster.pid("kvi")
        await cluster.restart("kvi")  # waits until the new one answers lookups
        assert cluster.pid("kvi") != first and cluster.alive("kvi")
        await cluster.stop_node("kvi")
        assert cluster.dead() == ["kvi"] and cluster.crashed() == []  # stopped on purpose
        await cluster.restart("kvi")
        assert cluster.crashed() == []
        cluster.kill("kvi")
        await _until(lambda: not cluster.alive("kvi"))
        assert cluster.crashed() == ["kvi"]  # exited, and nobody stopped it
        pids = [cluster.pid("kvi")]
        # Supervised: a killed node and a killed NATS come back.
        events: list[str] = []
        cluster.supervise(events.append)
        cluster.kill_nats()
        await _until(lambda: {"kvi", "nats"} <= {n for _, n in cluster.restarts})
        await cluster.stop_supervising()
        assert cluster.alive("kvi") and cluster.pid("kvi") != pids[0]
        assert "kvi exited (code -9); restarting" in events
        pids.append(cluster.pid("kvi"))
        assert cluster.nats is not None and cluster.nats.proc is not None
        pids.append(cluster.nats.proc.pid)
    await cluster.stop()  # a second stop does nothing
    assert not workdir.exists()
    assert not any(Path(f"/proc/{pid}").exists() for pid in pids)


async def _until(check: Callable[[], bool], timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.1)


def _environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(x.decode().partition("=")[::2] for x in raw if x)

