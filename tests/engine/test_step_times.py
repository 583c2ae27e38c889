"""The engine's step-time record: kinds of step for the cost model, and the histogram /metrics shows."""
from __future__ import annotations

import argparse

import pytest

from tokenmill.contracts.sampling import SamplingParams
from tokenmill.engine.cli import add_engine_arguments, engine_config_from_args
from tokenmill.engine.config import EngineConfig
from tokenmill.engine.engine import Engine
from tokenmill.engine.step_cost import PACKED_HOLD_BELOW, PACKED_LONE_SLOWDOWN, STEP_SECONDS_BUCKETS
from tokenmill.layers.quant.fused_decode import fused_fp32_max_rows
from tokenmill.layers.quant.packed import gemv_max_rows, gemv_row_group
from tokenmill.server.metrics import ServerMetrics


def _engine(path: str, **kw) -> Engine:
    return Engine(EngineConfig(model=path, page_size=16, kv_cache_tokens=1024, max_batch_tokens=64,
                               num_threads=1, **kw))


def test_packed_weights_give_the_cost_model_two_kinds_of_step(tiny_dir):
    path = str(tiny_dir("LlamaForCausalLM"))
    # fp32: fused decode steps up to the stack's limit, oneDNN GEMM steps above it
    assert _engine(path).step_cost.split_rows == fused_fp32_max_rows()
    int4 = _engine(path, quantization="int4").step_cost
    assert int4.split_rows == gemv_max_rows()
    # and the kernels' row groups (16 on the amx set, 1 elsewhere); fp32 weights have none
    assert int4.row_group == gemv_row_group() and _engine(path).step_cost.row_group == 1
    # a lone decode step is a kind of its own on packed weights (their one-row kernels), not at fp32
    assert int4.single_row and not _engine(path).step_cost.single_row
    # and there the lone cap and the prefill hold are on unless set (0: off); at fp32 both are off
    assert (int4.lone_slowdown, int4.hold_below) == (PACKED_LONE_SLOWDOWN, PACKED_HOLD_BELOW) == (2.0, 16)
    off = _engine(path, quantization="int4", decode_slowdown_lone=0, prefill_hold_below=0).step_cost
    assert (off.lone_slowdown, off.hold_below) == (None, 0)
    fp32 = _engine(path).step_cost
    assert (fp32.lone_slowdown, fp32.hold_below) == (None, 0)
    # no fused stack (per-head q/k norms), or fused decode turned off, fp32: one kind
    assert _engine(str(tiny_dir("Qwen3ForCausalLM"))).step_cost.split_rows is None
    off = _engine(path, fused_decode=False)
    assert off.step_cost.split_rows is None and off.runner.model._fused is False   # the stack never built
    assert _engine(path, quantization="int4", decode_slowdown=None).step_cost is None


def test_step_seconds_by_kind_reach_metrics(tiny_dir):
    engine = _engine(str(tiny_dir("LlamaForCausalLM")))
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    engine.add_request("a", list(range(10, 30)), params)
    kinds = []
    while engine.has_unfinished_requests():
        if len(kinds) == 2:   # "a" decodes now: a long prompt arrives beside it
            engine.add_request("b", list(range(100, 300)), params)
        before = {k: v[2] for k, v in engine.stats().step_seconds.items()}
        engine.step()
        after = engine.stats().step_seconds
        kinds += [k for k in after if after[k][2] > before[k]]
    assert kinds[0] == "prefill" and kinds[1] == "decode" and kinds[2] == "mixed"
    stats = engine.stats()
    for kind, (cumulative, total, count) in stats.step_seconds.items():
        assert count == kinds.count(kind) and len(cumulative) == len(STEP_SECONDS_BUCKETS)
        assert cumulative == sorted(cumulative) and cumulative[-1] <= count and total >= 0.0
    text = ServerMetrics("m").render(stats)
    n = stats.step_seconds["mixed"][2]
    assert f'tokenmill:engine_step_seconds_count{{kind="mixed",model_name="m"}} {float(n)}' in text
    assert 'tokenmill:engine_step_seconds_bucket{kind="decode",le="+Inf",model_name="m"}' in text


def test_prefill_stagger_reaches_the_scheduler_and_is_checked(tiny_dir):
    """``--prefill-stagger-tokens`` (off by default) is the scheduler's setting; with it, two
    streamed prompts admitted together finish one step apart, and both answers are the ones they
    get alone (scheduling never changes a request's tokens)."""
    path = str(tiny_dir("LlamaForCausalLM"))
    assert _engine(path).scheduler.prefill_stagger_tokens == 0
    with pytest.raises(ValueError, match="prefill_stagger_tokens must be >= 0"):
        EngineConfig(model=path, prefill_stagger_tokens=-1)
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    cfg = engine_config_from_args(parser.parse_args(["--model", path, "--prefill-stagger-tokens", "8"]))
    assert cfg.prefill_stagger_tokens == 8
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    prompts = {"a": list(range(10, 40)), "b": list(range(50, 80))}
    alone = {}
    for rid, ids in prompts.items():
        e = _engine(path)
        e.add_request(rid, ids, params)
        while e.has_unfinished_requests():
            for o in e.step():
                alone[rid] = list(o.token_ids)
    engine = _engine(path, prefill_stagger_tokens=8)
    for rid, ids in prompts.items():
        engine.add_request(rid, ids, params)
    first, got, step = {}, {}, 0
    while engine.has_unfinished_requests():
        step += 1
        for o in engine.step():
            first.setdefault(o.request_id, step)
            got[o.request_id] = list(o.token_ids)
    assert got == alone
    assert first["b"] > first["a"]                    # b stopped 8 tokens short in the first step


def test_the_lone_cap_reaches_the_cost_model_and_is_checked(tiny_dir):
    """``--decode-slowdown-lone`` (off by default) is the step-cost model's ``lone_slowdown``;
    0 on the command line turns it off, and a cap of 1x or less is refused."""
    path = str(tiny_dir("LlamaForCausalLM"))
    assert _engine(path).step_cost.lone_slowdown is None
    assert _engine(path, decode_slowdown_lone=2.0).step_cost.lone_slowdown == 2.0
    with pytest.raises(ValueError, match="decode_slowdown_lone must be > 1"):
        EngineConfig(model=path, decode_slowdown_lone=1.0)
    with pytest.raises(ValueError, match="decode_slowdown_lone must be > 1"):
        EngineConfig(model=path, decode_slowdown_lone=0.5)
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    assert engine_config_from_args(parser.parse_args(["--model", path, "--decode-slowdown-lone", "2"])).decode_slowdown_lone == 2.0
    assert engine_config_from_args(parser.parse_args(["--model", path, "--decode-slowdown-lone", "0"])).decode_slowdown_lone == 0
    assert _engine(path, decode_slowdown_lone=0).step_cost.lone_slowdown is None
    assert engine_config_from_args(parser.parse_args(["--model", path])).decode_slowdown_lone is None


def test_the_prefill_hold_reaches_the_cost_model_and_is_checked(tiny_dir):
    """``--prefill-hold-below`` / ``--prefill-hold-steps`` (off by default) are the step-cost
    model's ``hold_below`` / ``hold_steps``; negative values are refused."""
    path = str(tiny_dir("LlamaForCausalLM"))
    cost = _engine(path).step_cost                     # fp32: off unless set
    assert (cost.hold_below, cost.hold_steps) == (0, 32)
    cost = _engine(path, prefill_hold_below=16, prefill_hold_steps=8).step_cost
    assert (cost.hold_below, cost.hold_steps) == (16, 8)
    for bad in ({"prefill_hold_below": -1}, {"prefill_hold_steps": -1}):
        with pytest.raises(ValueError, match="prefill_hold_below and prefill_hold_steps must be >= 0"):
            EngineConfig(model=path, **bad)
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    cfg = engine_config_from_args(parser.parse_args(["--model", path, "--prefill-hold-below", "16",
                                                     "--prefill-hold-steps", "4"]))
    assert (cfg.prefill_hold_below, cfg.prefill_hold_steps) == (16, 4)
