"""Seed 000's KV capacity table for Kimi K2.6 on B200, under the seed's own assumptions:
180 GB per GPU, 595 GB of weights split evenly, all of HBM usable (mem-fraction 1), bf16 KV."""
from __future__ import annotations

import pytest

from tokenmill.plan.capacity import Deployment
from tokenmill.plan.hardware import get_hardware
from tokenmill.plan.models import load_model, parse_weight_bits
from tokenmill.plan.planner import make_plan


def seed_plan(tp: int, kv_dtype: str = "bf16", fp8_scales: str = "static"):
    spec = load_model("kimi-k2.6")
    hw = get_hardware("b200").with_overrides(hbm_bytes=180e9)
    dep = Deployment(tp=tp, kv_dtype=kv_dtype, kv_fp8_scales=fp8_scales, context=100_000, mem_fraction=1.0, weights_bytes=595e9,
                     weight_bits=parse_weight_bits(None, spec.default_bits))
    return make_plan(spec, hw, dep)


def test_kv_bytes_per_token_is_576_x_2_x_61() -> None:
    for tp in (1, 4, 8):
        plan = seed_plan(tp)
        assert plan.kv.per_token_per_device == 576 * 2 * 61 == 70_272  # the latent never shards


def test_tp1_and_tp2_do_not_fit() -> None:
    for tp in (1, 2):
        plan = seed_plan(tp)
        assert not plan.capacity.fits
        assert plan.capacity.kv_tokens_per_replica == 0
        assert plan.capacity.free_per_replica == pytest.approx(tp * 180e9 - 595e9)
        assert any("do not fit" in n for n in plan.notes)


def test_tp4_row() -> None:
    cap = seed_plan(4).capacity
    assert cap.free_per_replica == pytest.approx(125e9)
    assert cap.free_per_device == pytest.approx(31.25e9)
    assert f"{cap.free_per_device / 1e9 + 1e-9:.1f}" == "31.3"  # the seed rounds 31.25 up to "31.3 GB"
    assert cap.kv_tokens_per_replica == 31.25e9 // 70_272 == 444_700
    assert cap.kv_tokens_per_replica == pytest.approx(0.45e6, abs=0.01e6)  # the seed's "0.45 M"
    plan = seed_plan(4)
    assert any("TP4 row" in n and "agrees" in n for n in plan.notes)


def test_tp8_row_and_the_seeds_3m_figure() -> None:
    plan = seed_plan(8)
    cap = plan.capacity
    assert cap.free_per_replica == pytest.approx(845e9)
    assert cap.free_per_device == pytest.approx(105.625e9)
    assert round(cap.free_per_device / 1e9, 1) == 105.6
    # Every rank holds the full latent: the replica holds what one GPU holds.
    assert cap.kv_tokens_per_replica == int(105.625e9 // 70_272) == 1_503_088
    # Counting each token once over the whole replica overcounts 8x; the seed's 3.0 M is that / 4.
    assert cap.naive_tokens_per_replica == int(845e9 // 70_272) == 12_024_704
    assert cap.naive_tokens_per_replica / 4 == pytest.approx(3.0e6, rel=0.01)
    note = next(n for n in plan.notes if "TP8 row" in n)
    assert "3.0 M" in note and "1.50 M" in note and "full MLA latent" in note
    # TP8 holds 3.4x TP4's tokens, not the seed's "six times".
    ratio = cap.kv_tokens_per_replica / seed_plan(4).capacity.kv_tokens_per_replica
    assert ratio == pytest.approx(3.38, abs=0.01)


def test_fp8_kv_doubles_capacity() -> None:
    """Static fp8 scales (the default): 576 B per token and layer, exactly half of bf16; with
    per-token scales the latent carries one fp32 scale per token and layer: 580 B."""
    bf16, fp8 = seed_plan(4).capacity, seed_plan(4, "fp8").capacity
    assert seed_plan(4, "fp8").kv.per_token_per_device == 576 * 61 == 35_136
    assert fp8.kv_tokens_per_replica == 31.25e9 // 35_136
    assert fp8.kv_tokens_per_replica / bf16.kv_tokens_per_replica == pytest.approx(2, abs=1e-4)
    token = seed_plan(4, "fp8", "token")
    assert token.kv.per_token_per_device == (576 + 4) * 61 == 35_380
    assert token.capacity.kv_tokens_per_replica / bf16.kv_tokens_per_replica == pytest.approx(2 * 576 / 580, abs=1e-4)


def test_sessions_at_100k_context() -> None:
    cap = seed_plan(4).capacity
    # about 4 users of 100k tokens fit on TP4 (seed 000: "only about 4 users")
    assert cap.sessions_per_replica == int(31.25e9 // (100_000 * 70_272)) == 4


def test_architecture_weights_match_the_seeds_595_gb() -> None:
    """Without --weights-gb the preset's own arithmetic (INT4 experts + group scales, bf16 rest)
    lands within 1 GB of the seed's 595 GB."""
    spec = load_model("kimi-k2.6")
    dep = Deployment(tp=8, weight_bits=parse_weight_bits(None, spec.default_bits))
    plan = make_plan(spec, get_hardware("b200"), dep)
    assert plan.weights.total_bytes == pytest.approx(595e9, abs=1e9)
    params = sum(g.params for g in plan.weights.groups)
    assert params == pytest.approx(1.03e12, rel=0.01)
    # replicated MLA down-projections make per-device weights slightly more than total / tp
    assert plan.weights.per_device_bytes > plan.weights.total_bytes / 8
