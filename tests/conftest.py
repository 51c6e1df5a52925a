"""Shared fixtures: real servers, started once per session where tests only use them,
per test where a test restarts or kills them."""

from __future__ import annotations

import os
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from cpd.bus import Bus
from cpd.config import Settings, load_settings
from cpd.natsserver import NatsServer

ROOT = Path(__file__).resolve().parent.parent
PYTHON = sys.executable


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
    return load_settings(environ={}, overrides=[f"nats.url={nats_server.url}",
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


def run_engine_helper(script: str, model_cache: Path, name: str) -> dict:
    """Run ``tests/helpers/<script>`` (vLLM needs a ``__main__`` of its own) with a fresh
    shared-memory arena path, and return the JSON it prints after ``RESULT``."""
    import json
    import subprocess

    shm = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(os.environ.get("TMPDIR", "/tmp"))
    arena = shm / f"cpd-test-{name}-{os.getpid()}"
    try:
        out = subprocess.run([PYTHON, str(ROOT / "tests" / "helpers" / script),
                              str(model_cache), str(arena)],
                             capture_output=True, text=True, timeout=540)
    finally:
        arena.unlink(missing_ok=True)
    line = next((x for x in out.stdout.splitlines() if x.startswith("RESULT ")), None)
    assert line, out.stdout[-3000:] + out.stderr[-5000:]
    return json.loads(line[len("RESULT "):])


@pytest.fixture(scope="session")
def engine_helper() -> object:
    """:func:`run_engine_helper`, for tests' own module-scoped fixtures."""
    return run_engine_helper
