"""Hostile input against every subject the services listen on, through a real NATS
server to real service processes (bench.fuzz's driver, as ``cpd bench fuzz`` runs it).

Each subject gets ``CPD_FUZZ_CASES`` cases (10,000 by default): every request case must
get a typed answer, every listener must count exactly the messages it refused, and
afterwards every process is alive, a real generate completes and kvindex answers the
health prompt's lookup exactly as before."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from cpd.protocol import subjects
from tools.bench.fuzz import FuzzCluster, Target, fuzz_target, targets

CASES = int(os.environ.get("CPD_FUZZ_CASES", "10000"))
# Subscriptions that are no service's input: request inboxes (replies to the service's
# own requests), NATS micro's $SRV discovery (payload ignored) and JetStream's API.
_NOT_INPUT = ("_INBOX.", "$SRV.", "$JS.")

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
async def cluster(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[FuzzCluster]:
    c = FuzzCluster(Path(tmp_path_factory.mktemp("fuzz")))
    try:
        await c.start()
        yield c
    finally:
        await c.stop()


async def test_every_subscription_is_fuzzed(cluster: FuzzCluster) -> None:
    """A service that starts listening on a new subject fails this until the subject
    has a fuzz target (and a target whose subject nobody serves any more fails too)."""
    held = {(node, subject) for node, subject in await cluster.subscriptions()
            if not subject.startswith(_NOT_INPUT)}
    covered = {c for t in targets() for c in t.covers}
    assert held - covered == set(), "subjects without a fuzz target"
    pseudo = {("kvi", subjects.KV_STREAM), ("p0", "ucx")}
    assert covered - pseudo - held == set(), "fuzz targets nobody listens on"
    # The CPD_KV events reach kvindex through its ordered consumer, not a subscription.
    assert await cluster.stream_consumers() >= 1


@pytest.mark.parametrize("target", targets(), ids=lambda t: t.name)
async def test_subject_survives_hostile_input(cluster: FuzzCluster, target: Target) -> None:
    out = await fuzz_target(cluster, target, CASES, seed=0)
    assert out.failures == 0, out.problems
    assert out.cases == CASES
    # The corpus reached both sides: mostly refusals, and some messages the service took.
    assert out.typed_errors > CASES // 2
    assert out.answered > 0
    if target.listeners:
        assert out.rejected > CASES // 2
