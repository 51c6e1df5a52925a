"""The sim cost model: presets follow from their public figures, reproduce their anchor
point, and agree with the router's prefill-cost form."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cpd.sim import costmodel as cm
from services.router.cost import PrefillCost

pytestmark = pytest.mark.timeout(30)

PAPER = cm.B200_TP4_8B
COMPUTE_BOUND_TOKENS = 512


def test_presets_derive_from_public_figures() -> None:
    # 2 FLOP/param/token over 4 GPUs x 2.25 PFLOPS x MFU 0.5.
    assert PAPER.per_token_s == pytest.approx(2 * 8.03e9 / (4 * 2250e12 * 0.5))
    # 4 FLOP per (query, key, q-dim) x 32 layers x 4096, at attention efficiency 0.45.
    assert PAPER.per_pair_s == pytest.approx(4 * 32 * 4096 / (4 * 2250e12 * 0.45))
    # KV bytes per token = layers x 2 x kv_heads x head_dim x bytes.
    assert PAPER.kv_bytes_per_token == 32 * 2 * 8 * 128 * 2 == 128 * 1024
    assert cm.B200_TP4_70B_FP8.kv_bytes_per_token == 80 * 2 * 8 * 128 * 1
    # TP4 reads a quarter of the BF16 weights per GPU at 80 % of 8 TB/s.
    assert PAPER.weight_read_s == pytest.approx(8.03e9 * 2 / 4 / (8e12 * 0.8))
    # DP decode: every GPU reads all the weights.
    assert cm.B200_DP4_8B.weight_read_s == pytest.approx(4 * PAPER.weight_read_s)
    # H200 is slower than B200 per GPU, the 70B model slower than the 8B one.
    assert cm.H200_TP4_8B.per_token_s > PAPER.per_token_s
    assert cm.B200_TP4_70B_FP8.prefill_s(10_000) > PAPER.prefill_s(10_000)
    assert set(cm.PRESETS) >= {cm.DEFAULT_PRESET, "b200-tp4-llama-3.1-70b-fp8"}


def test_an_fp8_kv_cache_halves_kv_bytes_and_leaves_prefill_alone() -> None:
    fp8kv = cm.PRESETS["b200-tp4-llama-3.1-8b-fp8kv"]
    assert fp8kv is cm.B200_TP4_8B_FP8KV
    assert fp8kv.kv_bytes_per_token == PAPER.kv_bytes_per_token // 2
    assert fp8kv.kv_move_s(100_000) == pytest.approx(PAPER.kv_move_s(100_000) / 2)
    # Prefill compute is the same (weights and attention math stay BF16) ...
    assert fp8kv.prefill_s(10_000, 50_000) == PAPER.prefill_s(10_000, 50_000)
    # ... decode at long context reads half the KV, and twice the tokens fit.
    ctx = 24 * 120_000
    assert fp8kv.decode_step_s(24, ctx) - fp8kv.overhead_s - fp8kv.weight_read_s == \
        pytest.approx((PAPER.decode_step_s(24, ctx) - PAPER.overhead_s - PAPER.weight_read_s) / 2)
    assert fp8kv.kv_capacity_tokens == pytest.approx(2 * PAPER.kv_capacity_tokens, rel=1e-6)
    assert cm.PRESETS["b200-dp4-llama-3.1-8b-fp8kv"].weight_read_s == \
        pytest.approx(cm.B200_DP4_8B.weight_read_s)


def test_an_fp8_model_halves_prefill_and_kv_bytes() -> None:
    fp8 = cm.PRESETS["b200-tp4-llama-3.1-8b-fp8"]
    assert fp8 is cm.B200_TP4_8B_FP8
    assert fp8.kv_bytes_per_token == cm.B200_TP4_8B_FP8KV.kv_bytes_per_token
    # GEMMs and attention at the FP8 peak: the compute part of a prefill halves.
    for new, ctx in ((8_192, 0), (2_000, 100_000), (100_000, 0)):
        assert fp8.prefill_s(new, ctx) - fp8.overhead_s == \
            pytest.approx((PAPER.prefill_s(new, ctx) - PAPER.overhead_s) / 2)
    # Half the weight bytes: a decode step's weight pass halves too.
    assert fp8.weight_read_s == pytest.approx(PAPER.weight_read_s / 2)
    assert cm.PRESETS["b200-dp4-llama-3.1-8b-fp8"].weight_read_s == \
        pytest.approx(cm.B200_DP4_8B.weight_read_s / 2)


@pytest.mark.parametrize("anchor", cm.ANCHORS, ids=lambda a: a.model.name)
def test_anchor_points(anchor: cm.Anchor) -> None:
    got = anchor.model.prefill_s(anchor.new_tokens)
    assert abs(got - anchor.seconds) <= anchor.tolerance * anchor.seconds, anchor.source


def test_paper_preset_operating_point() -> None:
    # The blog: a cold 100K-token prompt holds a prefill node for seconds-ish; a warm
    # one (100K cached, 2K new) is served in well under a second.
    cold = PAPER.prefill_s(100_000)
    warm = PAPER.prefill_s(2_000, 100_000)
    assert 0.5 < cold < 2.0
    assert warm < 0.1 and cold / warm > 20
    # Long context: attention is a large share of a 100K prefill (quadratic term).
    attn = PAPER.per_pair_s * 100_000 ** 2 / 2
    assert 0.3 < attn / cold < 0.7
    # Loading 100K tokens of KV over PCIe Gen5 (4 x 55 GB/s) beats recomputing them.
    assert PAPER.kv_move_s(100_000) == pytest.approx(100_000 * 131072 / 220e9)
    assert PAPER.kv_move_s(100_000) < cold / 10


@given(new=st.integers(1, 300_000), ctx=st.integers(0, 300_000))
@settings(max_examples=200, deadline=None)
def test_prefill_matches_router_cost_form(new: int, ctx: int) -> None:
    router = PrefillCost(*PAPER.prefill_coefficients_ms())
    got = PAPER.prefill_s(new, ctx) * 1e3
    if new >= COMPUTE_BOUND_TOKENS:
        assert got == pytest.approx(router.ms(new, ctx), rel=1e-9)
    else:  # tiny chunks: at least one pass over the weights
        assert got >= router.ms(new, ctx) * (1 - 1e-9)


@given(chunks=st.lists(st.integers(COMPUTE_BOUND_TOKENS, 20_000), min_size=1, max_size=12),
       ctx=st.integers(0, 100_000))
@settings(max_examples=100, deadline=None)
def test_chunked_prefill_costs_the_same_compute(chunks: list[int], ctx: int) -> None:
    # Causal attention pairs add up exactly over chunks: chunking only adds overheads.
    done, total = ctx, 0.0
    for n in chunks:
        total += PAPER.prefill_s(n, done) - PAPER.overhead_s
        done += n
    whole = PAPER.prefill_s(sum(chunks), ctx) - PAPER.overhead_s
    assert total == pytest.approx(whole, rel=1e-9)


def test_decode_is_bandwidth_bound_and_grows_with_context() -> None:
    m = cm.B200_DP4_8B
    one = m.decode_step_s(1, 1_000)
    assert one == pytest.approx(m.overhead_s + m.weight_read_s + 1_000 * m.per_kv_token_read_s)
    big = m.decode_step_s(24, 24 * 100_000)
    assert big - one == pytest.approx(m.per_kv_token_read_s * (24 * 100_000 - 1_000))
    assert m.decode_step_s(0, 0) == 0.0
    # A mixed step costs at least the larger of its parts and less than their sum.
    mixed = m.step_s([(4096, 50_000)], decodes=24, decode_context=24 * 100_000)
    pre = m.prefill_s(4096, 50_000)
    assert max(pre, big) <= mixed <= pre + big


def test_kv_capacity_and_unknown_preset() -> None:
    # 90 % of 4 x 180 GB minus 16 GB of weights, at 128 KiB per token.
    assert PAPER.kv_capacity_tokens == math.floor((0.9 * 720e9 - 16.06e9) / 131072)
    with pytest.raises(KeyError, match="known"):
        cm.preset("nope")
    assert cm.preset(cm.DEFAULT_PRESET) is PAPER
