"""The connector worker's copies on CPU tensors shaped as vLLM's caches: every rank of a
tensor-parallel engine, pipeline stages, replicated heads and the K/V-first (GPU) layout
give the same whole block a single-rank engine gives, and load back into each rank's
share. The same code runs inside vLLM (tests/test_connector.py, test_connector_layouts.py)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from cpd.engines.vllm.kv_meta import CpdConnectorMetadata
from cpd.engines.vllm.kv_worker import ConnectorWorker
from tools.bench.connectorcopy import measure

LAYERS, HEADS, BS, HEAD_DIM, ENGINE_BLOCKS, SLOTS = 4, 4, 16, 8, 12, 6
SAVES = [(3, 0), (4, 1), (9, 2), (10, 4)]  # two runs of two, slot 3 left alone


def _full_caches(layout: str) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    shape = ((ENGINE_BLOCKS, HEADS, BS, 2 * HEAD_DIM) if layout == "cpu"
             else (2, ENGINE_BLOCKS, BS, HEADS, HEAD_DIM))
    return [torch.randn(shape, generator=g) for _ in range(LAYERS)]


def _heads(t: torch.Tensor, layout: str, first: int, n: int) -> torch.Tensor:
    return (t[:, first:first + n] if layout == "cpu" else t[:, :, :, first:first + n]).clone()


def _worker(arena: Path, caches: dict[str, torch.Tensor], tp: int, rank: int,
            heads: int = HEADS) -> ConnectorWorker:
    w = ConnectorWorker(str(arena), SLOTS, _slot_bytes(heads), block_size=BS,
                        num_layers=LAYERS, num_kv_heads=heads, tp_size=tp)
    w.register_kv_caches(caches, tp_rank=rank)
    return w


def _slot_bytes(heads: int = HEADS) -> int:
    return LAYERS * heads * BS * 2 * HEAD_DIM * 4


def _arena(tmp: Path, name: str, heads: int = HEADS) -> Path:
    path = tmp / name
    path.write_bytes(bytes(SLOTS * _slot_bytes(heads)))
    return path


def _bytes(path: Path) -> np.ndarray:
    return np.fromfile(path, dtype=np.uint8)


def _named(layers: list[torch.Tensor], first: int = 0) -> dict[str, torch.Tensor]:
    return {f"model.layers.{first + i}.self_attn.attn": t for i, t in enumerate(layers)}


@pytest.fixture(params=["cpu", "kv_first"])
def layout(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.mark.parametrize("tp", [2, 4])
def test_tensor_parallel_ranks_write_the_single_rank_block(tmp_path: Path, layout: str,
                                                           tp: int) -> None:
    full = _full_caches(layout)
    one = _arena(tmp_path, "tp1")
    _worker(one, _named(full), 1, 0).save(CpdConnectorMetadata(saves=SAVES))
    split = _arena(tmp_path, "tpn")
    h = HEADS // tp
    for rank in range(tp):
        _worker(split, _named([_heads(t, layout, rank * h, h) for t in full]), tp,
                rank).save(CpdConnectorMetadata(saves=SAVES))
    assert np.array_equal(_bytes(one), _bytes(split))
    # The untouched slot stays zero; a saved one is layer after layer of block 3.
    slots = _bytes(one).reshape(SLOTS, -1)
    assert not slots[3].any()
    want = torch.cat([(t[3] if layout == "cpu" else t[:, 3]).reshape(-1) for t in full])
    assert np.array_equal(slots[0], want.numpy().view(np.uint8))


def test_each_rank_loads_its_heads_from_the_whole_block(tmp_path: Path, layout: str) -> None:
    full = _full_caches(layout)
    arena = _arena(tmp_path, "a")
    _worker(arena, _named(full), 1, 0).save(CpdConnectorMetadata(saves=SAVES))
    for rank in range(2):
        mine = [torch.zeros_like(_heads(t, layout, 0, 2)) for t in full]
        w = _worker(arena, _named(mine), 2, rank)
        w.start_load(CpdConnectorMetadata(loads=[(b, s, 0) for b, s in SAVES]))
        assert w.get_block_ids_with_load_errors() == set()
        for got, t in zip(mine, full, strict=True):
            want = _heads(t, layout, 2 * rank, 2)
            for block, _ in SAVES:
                sel = (slice(None), block) if layout == "kv_first" else (block,)
                assert torch.equal(got[sel], want[sel])
            assert not got[(slice(None), 0) if layout == "kv_first" else (0,)].any()


def test_replicated_heads_are_written_once(tmp_path: Path) -> None:
    """2 KV heads on 4 ranks: ranks 0 and 1 hold head 0, ranks 2 and 3 head 1. Only the
    first of each pair writes: the second's bytes never reach the block."""
    full = [t[:, :2] for t in _full_caches("cpu")]
    one = _arena(tmp_path, "tp1", heads=2)
    _worker(one, _named([t.clone() for t in full]), 1, 0, heads=2).save(
        CpdConnectorMetadata(saves=SAVES))
    split = _arena(tmp_path, "tp4", heads=2)
    for rank in range(4):
        head = [t[:, rank // 2:rank // 2 + 1].clone() for t in full]
        if rank % 2:
            head = [torch.full_like(t, 7.0) for t in head]  # must not be written
        _worker(split, _named(head), 4, rank, heads=2).save(CpdConnectorMetadata(saves=SAVES))
    assert np.array_equal(_bytes(one), _bytes(split))


def test_a_pipeline_stage_writes_only_its_layers(tmp_path: Path) -> None:
    full = _full_caches("cpu")
    one = _arena(tmp_path, "pp1")
    _worker(one, _named(full), 1, 0).save(CpdConnectorMetadata(saves=SAVES))
    staged = _arena(tmp_path, "pp2")
    _worker(staged, _named(full[2:], first=2), 1, 0).save(CpdConnectorMetadata(saves=SAVES))
    half = _slot_bytes() // 2
    a, b = _bytes(one).reshape(SLOTS, -1), _bytes(staged).reshape(SLOTS, -1)
    assert not b[:, :half].any()
    assert np.array_equal(a[:, half:], b[:, half:])


def test_a_block_that_fails_its_checksum_is_not_copied(tmp_path: Path) -> None:
    full = _full_caches("cpu")
    arena = _arena(tmp_path, "a")
    _worker(arena, _named(full), 1, 0).save(CpdConnectorMetadata(saves=SAVES))
    mine = [torch.zeros_like(t) for t in full]
    w = _worker(arena, _named(mine), 1, 0)
    w.start_load(CpdConnectorMetadata(loads=[(3, 0, 12345), (4, 1, 0)]))
    assert w.get_block_ids_with_load_errors() == {3}
    assert not mine[0][3].any() and torch.equal(mine[0][4], full[0][4])


@pytest.mark.parametrize("kwargs, shape", [
    ({"num_layers": LAYERS, "num_kv_heads": HEADS, "tp_size": 2}, (ENGINE_BLOCKS, 1, BS, 16)),
    ({"num_layers": LAYERS, "num_kv_heads": HEADS + 1}, (ENGINE_BLOCKS, HEADS, BS, 16)),
    ({"num_layers": LAYERS, "num_kv_heads": HEADS}, (ENGINE_BLOCKS, HEADS, BS + 1, 16)),
])
def test_a_cache_that_does_not_fit_the_slots_is_refused(tmp_path: Path, kwargs: dict,
                                                        shape: tuple) -> None:
    w = ConnectorWorker(str(_arena(tmp_path, "a")), SLOTS, _slot_bytes(), block_size=BS,
                        **kwargs)
    with pytest.raises(ValueError):
        w.register_kv_caches(_named([torch.zeros(shape) for _ in range(LAYERS)]))


def test_the_copy_benchmark_reports_its_ratio() -> None:
    r = measure(layers=2, kv_heads=2, head_dim=32, block_size=16)
    assert r["connector_copy_gbps"] > 0 and r["memcpy_gbps"] > 0
    assert r["connector_copy_over_memcpy"] == pytest.approx(
        r["connector_copy_gbps"] / r["memcpy_gbps"], rel=0.05)
    assert r["connector_copy_bytes"] == 32 * 2 * 2 * 16 * 64 * 4
