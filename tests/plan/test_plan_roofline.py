"""Decode and prefill lower bounds, checked against the formulas written out by hand."""
from __future__ import annotations

import pytest

from tokenmill.plan.capacity import Deployment
from tokenmill.plan.hardware import get_hardware
from tokenmill.plan.models import load_model, parse_weight_bits
from tokenmill.plan.planner import make_plan


def plan(model: str, hw: str = "h100", **kw):
    spec = load_model(model)
    bits = parse_weight_bits(kw.pop("weight_bits", None), spec.default_bits)
    return make_plan(spec, get_hardware(hw), Deployment(weight_bits=bits, **kw))


def test_dense_decode_bound_by_hand() -> None:
    p = plan("smollm2-135m", context=1000, batch=4)
    params = 134_515_008  # SmolLM2-135M, tied embeddings
    assert sum(g.params for g in p.weights.groups) == params
    kv_tok = 2 * 3 * 64 * 2 * 30
    assert p.kv.per_token_per_device == kv_tok
    # tied embeddings: the table is read whole as the LM head
    assert p.decode.weight_bytes_read == 2 * params
    assert p.decode.kv_bytes_read == 4 * 1000 * kv_tok
    mem = (2 * params + 4 * 1000 * kv_tok) / 3.35e12
    assert p.decode.memory_time_s == pytest.approx(mem)
    flops = 4 * (2 * params + 2 * 9 * 2 * 64 * 30 * 1000)
    assert p.decode.flops == pytest.approx(flops)
    assert p.decode.bound == "memory"
    assert p.decode.tokens_per_s_per_user == pytest.approx(1 / mem)
    assert p.decode.tokens_per_s_per_replica == pytest.approx(4 / mem)


def test_prefill_bound_by_hand() -> None:
    p = plan("llama-3.1-70b", tp=8, context=8192)
    h, vocab, c = 8192, 128256, 8192
    params = sum(g.params for g in p.weights.groups)
    active = params - 2 * vocab * h  # no embedding lookup, LM head only for the last token
    attn = 80 * 64 * (c * c / 2) * 2 * (128 + 128)
    flops = 2 * active * c + 2 * vocab * h + attn
    assert p.prefill.flops == pytest.approx(flops, rel=1e-9)
    assert p.prefill.compute_dtype == "bf16"
    assert p.prefill.compute_time_s == pytest.approx(flops / (8 * 989.5e12))
    assert p.prefill.tokens_per_s == pytest.approx(c / p.prefill.compute_time_s)
    fp8 = plan("llama-3.1-70b", tp=8, context=8192, compute_dtype="fp8")
    assert fp8.prefill.tokens_per_s == pytest.approx(2 * p.prefill.tokens_per_s)


def test_decode_slows_with_context_and_moe_reads_grow_with_batch() -> None:
    short, long = plan("llama-3.1-70b", tp=4, context=1000), plan("llama-3.1-70b", tp=4, context=100_000)
    assert long.decode.tokens_per_s_per_user < short.decode.tokens_per_s_per_user
    reads = [plan("deepseek-v3", "h200", tp=8, batch=b, context=4096).decode.weight_bytes_read
             for b in (1, 8, 64, 512)]
    assert reads == sorted(reads) and reads[0] < reads[-1]
    one = plan("deepseek-v3", "h200", tp=8, batch=1, context=4096)
    experts = next(g for g in one.weights.groups if g.group == "experts").bytes_per_device
    rest = sum(g.bytes_per_device for g in one.weights.groups if g.group != "experts")
    table = next(g for g in one.weights.groups if g.name == "embedding table").bytes_per_device
    assert one.decode.weight_bytes_read == pytest.approx(rest - table * (1 - 1 / 129280) + experts * 8 / 256)


def test_hybrid_decode_counts_state_traffic() -> None:
    p = plan("ling-2.6-1t", "tpu-v7x", tp=32, ep=32, batch=8, context=16_384)
    assert p.decode.state_bytes == 2 * 8 * p.kv.state_per_request_per_device
    assert p.kv.state_per_request_per_device == 70 * 2 * 128 * 128 * 4  # 64 heads / 32 ranks


def test_batch_beyond_capacity_is_flagged() -> None:
    p = plan("llama-3.1-70b", tp=2, context=128_000, batch=64)
    assert p.decode.notes and "exceeds" in p.decode.notes[0]
