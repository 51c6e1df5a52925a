"""Shared fixtures: real servers, started once per session where tests only use them,
per test where a test restarts or kills them."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from cpd.bus import Bus
from cpd.ops.config import Settings, load_settings
from cpd.ops.natsserver import NatsServer
from tests.helpers.cluster import VllmCluster, run_engine_helper
from tools.cluster.spec import compile_cache

_CHILD_TMP = "_cpd_child_tmp"
_SHM_BEFORE = "_cpd_shm_before"
_SHM = Path("/dev/shm")
# What vLLM-CPU's ranks (and torch's and Python's multiprocessing) leave in shared
# memory when they are killed, not stopped: gone with the session that made it.
_SHM_LEFTOVERS = ("vllm_dist_", "psm_", "sem.mp-")


def _shm_entries() -> set[str]:
    try:
        return {p.name for p in _SHM.iterdir() if p.name.startswith(_SHM_LEFTOVERS)}
    except OSError:
        return set()


def _shm_in_use() -> set[str]:
    """The shared-memory entries some live process still maps or holds open: another
    session's engines (a second test session, a benchmark) that started meanwhile."""
    used: set[str] = set()
    prefix = f"{_SHM}/"
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            for line in (proc / "maps").read_text().splitlines():
                at = line.find(prefix)
                if at >= 0:
                    used.add(line[at + len(prefix):].split(" ")[0])
            for fd in (proc / "fd").iterdir():
                target = os.readlink(fd)
                if target.startswith(prefix):
                    used.add(target[len(prefix):].split(" ")[0])
        except OSError:  # gone meanwhile, or not ours to read
            continue
    return used


def pytest_configure(config: pytest.Config) -> None:
    """The processes the tests start get a temp folder of the session's own, removed at
    its end: vLLM leaves sockets and rank rendezvous files there, and a killed process
    whatever it held. The test process keeps the system one (its base for tmp_path),
    and torch's compile cache stays where it is shared across runs. Shared-memory
    leftovers made during the session are removed at its end, unless a live process
    still uses them."""
    tempfile.gettempdir()  # pinned before TMPDIR changes for the children
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = compile_cache()  # shared across runs
    folder = tempfile.mkdtemp(prefix="cpd-tests-")
    setattr(config, _CHILD_TMP, folder)
    setattr(config, _SHM_BEFORE, _shm_entries())
    os.environ["TMPDIR"] = folder


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The modules that use the session's shared vLLM cluster (:func:`vllm_cluster`) run
    last, one after the other, in their usual order: its engines then start once the
    rest of the suite is done, and never share this host's memory and cores with the
    engines other tests start."""
    shared = {getattr(item, "module", None) for item in items
              if "vllm_cluster" in getattr(item, "fixturenames", ())}
    shared.discard(None)
    # A stable sort: the order within each part stays.
    items.sort(key=lambda item: getattr(item, "module", None) in shared)


def pytest_unconfigure(config: pytest.Config) -> None:
    folder = getattr(config, _CHILD_TMP, None)
    if folder:
        shutil.rmtree(folder, ignore_errors=True)
    before = getattr(config, _SHM_BEFORE, None)
    if before is not None:
        for name in _shm_entries() - before - _shm_in_use():
            (_SHM / name).unlink(missing_ok=True)


@pytest.fixture(scope="session")
def nats_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NatsServer]:
    """One real nats-server (JetStream, random port) for the whole session."""
    server = NatsServer(store_dir=tmp_path_factory.mktemp("nats"))
    server.start()
    yield server
    server.cleanup()


@pytest.fixture
def fresh_nats(tmp_path: Path) -> Iterator[NatsServer]:
    """A nats-server of this test's own, for tests that restart or kill it."""
    server = NatsServer(store_dir=tmp_path / "nats")
    server.start()
    yield server
    server.cleanup()


@pytest.fixture
def settings(nats_server: NatsServer) -> Settings:
    """Default settings pointing at the session's NATS server."""
    return load_settings(environ={}, overrides=[f"nats.servers={nats_server.url}",
                                                "nats.drain_timeout_s=2"])


@pytest.fixture
async def bus(settings: Settings) -> AsyncIterator[Bus]:
    """A client connection to the session's NATS server."""
    b = await Bus.open(settings, "test-client")
    yield b
    await b.close()


@pytest.fixture(scope="session")
def model_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where this session builds models (the user's cache when CPD_TEST_MODEL_CACHE is set,
    so CI reuses what ``make test`` built)."""
    env = os.environ.get("CPD_TEST_MODEL_CACHE")
    return Path(env).expanduser() if env else tmp_path_factory.mktemp("models")


@pytest.fixture(scope="session")
def engine_helper() -> object:
    """:func:`run_engine_helper`, for tests' own module-scoped fixtures."""
    return run_engine_helper


@pytest.fixture(scope="session")
async def vllm_cluster(model_cache: Path,
                       tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[VllmCluster]:
    """One pre-prefill (pp0), one prefill (p0) and one decode (d0) worker on real vLLM-CPU
    engines, with NATS and kvindex, for the whole session. A test that kills a node
    restarts it before it ends."""
    c = VllmCluster(tmp_path_factory.mktemp("cluster"), model_cache)
    try:
        await c.start()
        yield c
    finally:
        await c.stop()


@pytest.fixture
async def vllm_cluster_intact(vllm_cluster: VllmCluster) -> AsyncIterator[None]:
    """The shared cluster whole around one test: a node found dead before it (left so by
    an earlier failure) is started again, and a node that died during it fails the test
    with the node's log, once restarted, so that one crash fails one test, not every
    later test of the session."""
    if found := await vllm_cluster.revive():
        print(f"restarted before the test, found dead: {sorted(found)}")
    yield
    if crashed := await vllm_cluster.revive():
        pytest.fail("the shared cluster lost " + ", ".join(sorted(crashed)) + " during the "
                    "test; restarted. Their logs ended:\n"
                    + "\n".join(f"--- {n}\n{tail}" for n, tail in sorted(crashed.items())))


@pytest.fixture(autouse=True)
def _shared_cluster_checked(request: pytest.FixtureRequest) -> None:
    """:func:`vllm_cluster_intact` around every test that uses the shared cluster."""
    if "vllm_cluster" in request.fixturenames:
        request.getfixturevalue("vllm_cluster_intact")
