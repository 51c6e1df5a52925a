"""The workers on the ``small`` model preset (8 layers, 4 KV heads: twice the ``tiny``
preset's) on every path, in a cluster of this module's own, which stops before the
suite's shared cluster (:mod:`tests.test_workers`) starts."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import numpy as np
import pytest

from tests.helpers.cluster import VllmCluster, reference_outputs
from tests.helpers.workerpaths import BS, MAX_TOKENS, every_path, view

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

_rng = np.random.default_rng(43)
SMALL_PROMPTS = [_rng.integers(0, 1900, size=n).tolist() for n in (3 * BS, 5 * BS + 77)]


@pytest.fixture(scope="module")
async def small_reference(model_cache: Path,
                          tmp_path_factory: pytest.TempPathFactory) -> list[list[int]]:
    return await reference_outputs(model_cache, tmp_path_factory.mktemp("small-ref"),
                                   SMALL_PROMPTS, MAX_TOKENS, preset="small")


@pytest.fixture(scope="module")
async def small_cluster(model_cache: Path, tmp_path_factory: pytest.TempPathFactory
                        ) -> AsyncIterator[dict]:
    """pp0, p0 and d0 on the ``small`` preset (its own NATS and kvindex)."""
    c = VllmCluster(tmp_path_factory.mktemp("small"), model_cache, "model.preset=small")
    try:
        await c.start()
        yield view(c)
    finally:
        await c.stop()


async def test_the_small_model_is_token_identical_on_every_path(
        small_reference: list[list[int]], small_cluster: dict) -> None:
    """The ``small`` preset (twice the layers and KV heads of ``tiny``): cold, warm from
    a peer's DRAM, from the node's own DRAM and from its engine's cache, each output equal
    to monolithic vLLM on the same model."""
    for prompt, want in zip(SMALL_PROMPTS, small_reference, strict=True):
        await every_path(small_cluster, prompt, want)
