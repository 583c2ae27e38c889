"""Seed 003: the MoE kernel cost model for Ling-2.6-1T on TPU v7x and the hybrid memory pools."""
from __future__ import annotations

import math

import pytest

from tokenmill.plan.capacity import Deployment
from tokenmill.plan.hardware import get_hardware
from tokenmill.plan.models import load_model, parse_weight_bits
from tokenmill.plan.moe import MoEBoundsInput
from tokenmill.plan.planner import make_plan

MIB, GIB = 2 ** 20, 2 ** 30


def ling_plan(tp: int, ep: int = 1, context: int = 16_384, moe: MoEBoundsInput | None = None):
    spec = load_model("ling-2.6-1t")
    dep = Deployment(tp=tp, ep=ep, context=context, weight_bits=parse_weight_bits(None, spec.default_bits))
    return make_plan(spec, get_hardware("tpu-v7x"), dep, moe)


@pytest.fixture(scope="module")
def moe():
    plan = ling_plan(32, 32, moe=MoEBoundsInput(tokens=16_384, tile_rows=160))
    assert plan.moe is not None
    return plan.moe


def test_hardware_is_per_device_half_a_chip() -> None:
    hw = get_hardware("tpu-v7x")
    assert hw.flops("fp8") == 2.307e15 == 4.614e15 / 2
    assert hw.hbm_bw == pytest.approx(7.38e12 / 2)


def test_routed_rows_and_flops(moe) -> None:
    assert moe.routed_rows == 16_384 * 8 / 32 == 4_096
    assert moe.local_experts == 8 and moe.rows_per_expert == 512
    assert moe.routed_flops == 6 * 4096 * 8192 * 2048
    assert round(moe.routed_flops / 1e9, 1) == 412.3
    assert round(moe.shared_flops / 1e9, 1) == 412.3
    assert round(moe.total_flops / 1e9, 1) == 824.6
    assert moe.compute_dtype == "fp8"
    assert moe.compute_time_s == pytest.approx(824.6e9 / 2.307e15, rel=1e-3)
    assert round(moe.compute_time_s * 1e3, 2) == 0.36


def test_scatter_payload_and_all_to_all(moe) -> None:
    assert moe.payload_bytes["bf16"] == 4096 * 8192 * 2 == 67_108_864
    assert moe.payload_bytes["fp8"] == 33_554_432
    assert round(moe.payload_bytes["bf16"] / 1e6, 1) == 67.1
    assert math.floor(moe.payload_bytes["fp8"] / 1e5) / 10 == 33.5  # the seed truncates 33.55
    assert moe.avg_hops == 2.0  # 2x2x4 torus: 0.5 + 0.5 + 1.0
    # seed: fp8 scatter + gather topology bound about 0.67 ms
    assert moe.scatter_gather_s["fp8"] == pytest.approx(2 * 33_554_432 * 2 / 200e9)
    assert round(moe.scatter_gather_s["fp8"] * 1e3, 2) == 0.67
    assert moe.scatter_gather_s["bf16"] == pytest.approx(2 * moe.scatter_gather_s["fp8"])


def test_expert_weight_reads(moe) -> None:
    assert moe.expert_weight_bytes == 8 * 3 * 8192 * 2048  # fp8: one byte per weight
    assert round(moe.expert_weight_bytes / 1e6) in (402, 403)  # 402.65 MB; the seed writes 402
    assert round(moe.weight_read_pass_s * 1e3, 2) == 0.11
    assert moe.passes == math.ceil(512 / 160) == 4
    assert round(moe.weight_read_s * 1e3, 2) == 0.44


def test_moe_bounds_scale_with_tokens_and_ep() -> None:
    small = ling_plan(32, 32, moe=MoEBoundsInput(tokens=512)).moe
    assert small.routed_rows == 128 and small.passes == 1
    half_ep = ling_plan(16, 16, moe=MoEBoundsInput(tokens=16_384)).moe
    assert half_ep.routed_rows == 8192 and half_ep.local_experts == 16
    assert half_ep.expert_weight_bytes == 2 * 8 * 3 * 8192 * 2048


def test_hybrid_pools_tp4() -> None:
    p16 = ling_plan(4, context=16_384)
    # 10 MLA layers x 640-element latent x 2 B = 12.5 KiB per token per device
    assert p16.kv.per_token_per_device == 12_800 == 12.5 * 1024
    assert p16.capacity.kv_bytes_per_session == 16_384 * 12_800
    assert p16.capacity.kv_bytes_per_session / MIB == pytest.approx(200, abs=0.5)
    p256 = ling_plan(4, context=262_144)
    assert p256.capacity.kv_bytes_per_session / GIB == pytest.approx(3.1, abs=0.05)
    # 70 linear layers x 64/4 heads x 128 x 128 x 4 B = 70 MiB, the same at any length
    assert p16.kv.state_per_request_per_device == 70 * 16 * 128 * 128 * 4 == 70 * MIB
    assert p256.kv.state_per_request_per_device == p16.kv.state_per_request_per_device
    assert p16.capacity.memory_per_session == 16_384 * 12_800 + 70 * MIB


def test_hybrid_state_shards_with_tp_but_latent_does_not() -> None:
    p8 = ling_plan(8)
    assert p8.kv.per_token_per_device == 12_800
    assert p8.kv.state_per_request_per_device == 35 * MIB
