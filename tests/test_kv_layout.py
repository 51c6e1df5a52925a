"""Where each engine rank's KV goes in a whole block (pure arithmetic, table-driven)."""

from __future__ import annotations

import pytest

from cpd.engines.vllm.engine import rank_cpus
from cpd.engines.vllm.kv_layout import ShardLayout, runs


@pytest.mark.parametrize("heads, tp, rank, local, first, writes", [
    (2, 1, 0, 2, 0, True),
    (2, 2, 0, 1, 0, True),
    (2, 2, 1, 1, 1, True),
    (8, 4, 3, 2, 6, True),
    # Fewer heads than ranks: each head on tp/heads ranks, the first of them writes.
    (2, 4, 0, 1, 0, True),
    (2, 4, 1, 1, 0, False),
    (2, 4, 2, 1, 1, True),
    (2, 4, 3, 1, 1, False),
    (1, 8, 7, 1, 0, False),
])
def test_a_ranks_heads(heads: int, tp: int, rank: int, local: int, first: int,
                       writes: bool) -> None:
    lay = ShardLayout(num_layers=4, num_kv_heads=heads, tp_size=tp, tp_rank=rank,
                      layer_bytes=heads * 1024)
    assert (lay.local_heads, lay.first_head, lay.writes) == (local, first, writes)
    assert lay.head_bytes == 1024 and lay.slot_bytes == 4 * heads * 1024
    assert lay.layer_offset(3) == 3 * heads * 1024


def test_every_head_is_written_by_exactly_one_rank() -> None:
    for heads, tp in [(2, 1), (2, 2), (2, 4), (8, 4), (4, 8), (1, 2), (16, 16)]:
        written = [h for r in range(tp)
                   if (lay := ShardLayout(num_layers=1, num_kv_heads=heads, tp_size=tp,
                                          tp_rank=r, layer_bytes=heads)).writes
                   for h in range(lay.first_head, lay.first_head + lay.local_heads)]
        assert sorted(written) == list(range(heads)), (heads, tp)


@pytest.mark.parametrize("kwargs", [
    {"num_kv_heads": 3, "tp_size": 2},          # neither divides the other
    {"num_kv_heads": 2, "tp_size": 2, "tp_rank": 2},
    {"num_kv_heads": 0},
    {"num_kv_heads": 4, "layer_bytes": 6},      # not a whole number of bytes per head
])
def test_impossible_layouts_are_refused(kwargs: dict) -> None:
    with pytest.raises(ValueError):
        ShardLayout(**{"num_layers": 2, "layer_bytes": 8, **kwargs})


def test_a_layer_outside_the_model_is_refused() -> None:
    with pytest.raises(ValueError):
        ShardLayout(num_layers=2, num_kv_heads=1, layer_bytes=8).layer_offset(2)


@pytest.mark.parametrize("pairs, expected", [
    ([], []),
    ([(4, 0)], [(4, 0, 1)]),
    ([(4, 0), (5, 1), (6, 2)], [(4, 0, 3)]),
    ([(4, 0), (5, 2), (6, 3)], [(4, 0, 1), (5, 2, 2)]),   # the slots jump
    ([(4, 0), (9, 1)], [(4, 0, 1), (9, 1, 1)]),            # the blocks jump
    ([(5, 1), (4, 0)], [(5, 1, 1), (4, 0, 1)]),            # order is kept
])
def test_copies_go_by_runs(pairs: list, expected: list) -> None:
    assert runs(pairs) == expected


@pytest.mark.parametrize("cpus, ranks, bind", [
    ((0, 1), 1, "0,1"),
    ((0, 1), 2, "0|1"),
    ((0, 1, 2, 3, 4), 2, "0,1,2|3,4"),
    ((4, 6, 8, 10), 4, "4|6|8|10"),
])
def test_each_rank_gets_its_share_of_the_cpus(cpus: tuple, ranks: int, bind: str) -> None:
    assert rank_cpus(cpus, ranks) == bind
