"""KV storage dtypes: capacity at equal memory, agreement with the planner, fp8 errors."""
from __future__ import annotations

import json
import logging
import subprocess
import sys

import pytest
import torch

from engine_oracle import random_prompts
from tokenmill import LLM, SamplingParams
from tokenmill.contracts.kv import KVCacheSpec
from tokenmill.engine.config import EngineConfig
from tokenmill.engine.engine import Engine
from tokenmill.layers.attention import select_attention_backend

MEMORY_GIB = 0.002
DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp8_e4m3": "float8_e4m3fn"}


def _engine(lm, kv_dtype: str, caplog, scales: str = "static") -> tuple[Engine, str]:
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="tokenmill.engine.engine"):
        eng = Engine(EngineConfig(model=str(lm.source), kv_cache_memory_gib=MEMORY_GIB, kv_cache_dtype=kv_dtype,
                                  kv_cache_fp8_scales=scales), loaded=lm)
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("KV cache:"))
    return eng, line


def _plan(config_json, kv_dtype: str, scales: str = "static") -> dict:
    cli = "import sys; from tokenmill.cli import main; sys.exit(main(sys.argv[1:]))"
    out = subprocess.run([sys.executable, "-c", cli, "plan", "--model", str(config_json), "--hardware", "h100",
                          "--kv-dtype", kv_dtype, "--kv-fp8-scales", scales, "--kv-cache-memory", str(MEMORY_GIB),
                          "--page-size", "16", "--json"],
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


@pytest.mark.parametrize("arch", ["DeepseekV3ForCausalLM", "LlamaForCausalLM"])
def test_capacity_logged_and_equal_to_the_planner(tiny_model, arch, caplog) -> None:
    """Static fp8 scales (the default): exactly a quarter of fp32's bytes per token, so 4x the
    tokens (2x bf16) at the same --kv-cache-memory, up to the rounding to whole pages."""
    lm, _ = tiny_model(arch)
    tokens = {}
    for flag, storage in DTYPES.items():
        eng, line = _engine(lm, flag, caplog)
        s = eng.stats()
        assert s.kv_cache_dtype == storage
        assert s.kv_cache_fp8_scales == ("static" if flag == "fp8_e4m3" else "")
        assert s.kv_bytes_per_token == eng.kv_spec.bytes_per_token()
        assert f"{s.kv_bytes_per_token} B/token" in line
        assert f"= {s.kv_capacity_tokens} tokens" in line
        assert s.kv_capacity_tokens == s.kv_pages_total * 16
        plan_dtype = {"fp8_e4m3": "fp8"}.get(flag, flag)
        if flag != "bf16":  # one subprocess per dtype kind is enough
            plan = _plan(lm.source / "config.json", plan_dtype)
            assert plan["kv"]["per_token_per_device_bytes"] == s.kv_bytes_per_token
            assert plan["capacity"]["kv_tokens_for_memory"] == s.kv_capacity_tokens
        tokens[flag] = s.kv_capacity_tokens
    spec = lm.model.kv_cache_spec()
    assert spec.with_dtype("float32").bytes_per_token() == 4 * spec.with_dtype("float8_e4m3fn").bytes_per_token()
    pages = {k: v // 16 for k, v in tokens.items()}
    assert pages["fp8_e4m3"] // 4 == pages["fp32"] and pages["fp8_e4m3"] // 2 == pages["bf16"]
    assert 4 <= tokens["fp8_e4m3"] / tokens["fp32"] < 4.02


@pytest.mark.parametrize("arch", ["DeepseekV3ForCausalLM", "LlamaForCausalLM"])
def test_per_token_fp8_scales_cost_bytes_and_match_the_planner(tiny_model, arch, caplog) -> None:
    lm, _ = tiny_model(arch)
    eng, line = _engine(lm, "fp8_e4m3", caplog, scales="token")
    s = eng.stats()
    assert s.kv_cache_fp8_scales == "token" and "(token scales)" in line
    plan = _plan(lm.source / "config.json", "fp8", scales="token")
    assert plan["kv"]["per_token_per_device_bytes"] == s.kv_bytes_per_token
    assert plan["capacity"]["kv_tokens_for_memory"] == s.kv_capacity_tokens
    # 4 B per vector: 40 + 4 B vs 160 B for the tiny MLA latent (580 vs 2304 for Kimi K2), 3.2x
    # fp32 for the tiny Llama's 16-dim heads (3.76x for SmolLM2's 64-dim heads)
    ratio = lm.model.kv_cache_spec().with_dtype("float32").bytes_per_token() / s.kv_bytes_per_token
    assert ratio == pytest.approx(160 / 44 if arch == "DeepseekV3ForCausalLM" else 512 / 160)
    with pytest.raises(ValueError, match="kv_cache_fp8_scales must be one of"):
        EngineConfig(kv_cache_fp8_scales="page")


def test_long_dtype_names_are_aliases(tiny_model) -> None:
    lm, _ = tiny_model("LlamaForCausalLM")
    for alias, storage in (("float32", "float32"), ("bfloat16", "bfloat16"), ("float16", "float16"),
                           ("fp8", "float8_e4m3fn"), ("auto", "float32")):
        eng = Engine(EngineConfig(model=str(lm.source), kv_cache_tokens=64, kv_cache_dtype=alias), loaded=lm)
        assert eng.kv_spec.dtype == storage
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        EngineConfig(kv_cache_dtype="int4")


def test_kv_memory_too_small_for_one_request(tiny_model) -> None:
    lm, _ = tiny_model("DeepseekV3ForCausalLM")
    with pytest.raises(ValueError, match="too small for one request"):
        Engine(EngineConfig(model=str(lm.source), kv_cache_memory_gib=1e-6, kv_cache_dtype="fp8_e4m3"), loaded=lm)


def test_fp8_on_a_device_without_float8_is_refused() -> None:
    spec = KVCacheSpec.dense(2, 2, 16, "float8_e4m3fn")
    with pytest.raises(ValueError, match="float8_e4m3fn is not supported on device meta"):
        select_attention_backend(spec, "meta")


@pytest.mark.parametrize("arch,scales", [("DeepseekV3ForCausalLM", "static"), ("LlamaForCausalLM", "static"),
                                         ("LlamaForCausalLM", "token")])
def test_fp8_engine_serves_with_prefix_cache_and_chunks(tiny_model, arch, scales) -> None:
    """fp8 pages through the whole engine: chunked prefill, prefix hits, preemption-free decodes;
    the same prompt gives the same tokens whether its pages were written now or found in the
    cache (accuracy against fp32 is tests/models/test_kv_fp8_accuracy.py)."""
    lm, _ = tiny_model(arch)
    prompts = random_prompts([30, 12, 45], seed=9)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    llm = LLM(loaded=lm, kv_cache_tokens=1024, kv_cache_dtype="fp8_e4m3", max_batch_tokens=16, debug_checks=True,
              kv_cache_fp8_scales=scales)
    got = [o.token_ids for o in llm.generate(prompts + prompts[:1], params)]
    assert got[3] == got[0] and len(got[0]) == 8  # a prefix hit reads the pages the first request wrote
    assert llm.engine.stats().cached_tokens_total >= 16
    assert isinstance(llm.engine.runner.kv_caches[0], tuple) and llm.engine.runner.kv_caches[0].data.dtype == torch.uint8
    entry = llm.engine.runner.kv_caches[0]
    assert entry.per_token == (scales == "token")
    if scales == "static":  # calibrated at start-up: one scale per head (K, V) or latent / rope key
        assert entry.scale.numel() < 200 and (entry.scale != 1).all() and (entry.scale > 0).all()


def test_static_fp8_scales_calibrate_to_the_largest_value_written(tiny_model) -> None:
    """The calibration prefill sets each head's scale to headroom x amax / 448, where amax is the
    largest |K| (|V|) that head wrote; an fp32 pool fed the same prompt holds those values."""
    from tokenmill.engine.kv_calibration import calibration_tokens
    from tokenmill.engine.model_runner import ModelRunner
    from tokenmill.layers.attention.fp8 import FP8_MAX, STATIC_HEADROOM

    lm, _ = tiny_model("LlamaForCausalLM")
    toks = calibration_tokens(lm.tokenizer, lm.model.args.vocab_size, 200)
    spec = lm.model.kv_cache_spec()
    fp8 = ModelRunner(lm.model, 16, 16, lm.model.args.vocab_size, kv_spec=spec.with_dtype("float8_e4m3fn"),
                      calibration_tokens=toks)
    exact = ModelRunner(lm.model, 16, 16, lm.model.args.vocab_size, kv_spec=spec)
    with torch.inference_mode():
        exact.forward(exact.calibration_batch(toks))   # the same prefill into an fp32 pool
    for f, e in zip(fp8.kv_caches, exact.kv_caches):
        amax = e.view(2, -1, e.shape[-2], e.shape[-1]).abs().amax(dim=(1, 3))       # [2, heads]
        assert torch.allclose(f.scale.view(2, -1), amax * STATIC_HEADROOM / FP8_MAX, rtol=1e-6)
        assert not f.data.any()   # the calibration ran on a scratch pool


def test_auto_is_fp16_for_packed_weights_of_standard_attention(tiny_dir, tiny_model, caplog) -> None:
    """``auto`` is the model's dtype for dense weights, fp16 for an fp32 Llama whose weights are
    served packed (int8 here, GGUF blocks for the default model); an explicit dtype wins."""
    from tokenmill.loader import load_model

    dense, _ = tiny_model("LlamaForCausalLM")
    packed = load_model(str(tiny_dir("LlamaForCausalLM")), quantization="int8")
    assert _engine(dense, "auto", caplog)[0].kv_spec.dtype == "float32"
    eng, line = _engine(packed, "auto", caplog)
    assert eng.kv_spec.dtype == "float16" and line.startswith("KV cache: float16")
    assert eng.stats().kv_bytes_per_token * 2 == _engine(packed, "fp32", caplog)[0].stats().kv_bytes_per_token
    out = LLM(loaded=packed, kv_cache_tokens=256).generate([[5, 6, 7, 8]], SamplingParams(max_tokens=6, temperature=0))
    assert len(out[0].token_ids) == 6


@pytest.mark.parametrize("arch", ["DeepseekV3ForCausalLM", "LlamaForCausalLM"])
def test_int8_costs_its_scales_and_matches_the_planner(tiny_model, arch, caplog) -> None:
    """int8 pages: a byte per element plus a 4-byte scale per vector, as fp8's token scheme; the
    engine's capacity and the planner's agree."""
    lm, _ = tiny_model(arch)
    eng, line = _engine(lm, "int8", caplog)
    s = eng.stats()
    assert eng.kv_spec.dtype == "int8" and eng.kv_spec.per_token_scales and "int8" in line
    plan = _plan(lm.source / "config.json", "int8")
    assert plan["kv"]["per_token_per_device_bytes"] == s.kv_bytes_per_token
    assert plan["capacity"]["kv_tokens_for_memory"] == s.kv_capacity_tokens
    fp8_token = lm.model.kv_cache_spec().with_dtype("float8_e4m3fn").with_fp8_scales("token")
    assert s.kv_bytes_per_token == fp8_token.bytes_per_token()


@pytest.mark.parametrize("arch", ["DeepseekV3ForCausalLM", "LlamaForCausalLM"])
def test_int8_engine_serves_with_prefix_cache_and_chunks(tiny_model, arch) -> None:
    """int8 pages through the whole engine (MLA latents on the torch path, standard attention on
    the native kernel): chunked prefill, prefix hits (accuracy against fp32 is
    tests/models/test_kv_fp8_accuracy.py)."""
    lm, _ = tiny_model(arch)
    prompts = random_prompts([30, 12, 45], seed=9)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    llm = LLM(loaded=lm, kv_cache_tokens=1024, kv_cache_dtype="int8", max_batch_tokens=16, debug_checks=True)
    got = [o.token_ids for o in llm.generate(prompts + prompts[:1], params)]
    assert got[3] == got[0] and len(got[0]) == 8
    assert llm.engine.stats().cached_tokens_total >= 16
    entry = llm.engine.runner.kv_caches[0]
    assert entry.data.dtype == torch.int8 and entry.per_token and entry.is_int8
    assert entry.data.abs().max() <= 127 and (entry.scale >= 0).all()


def test_int8_refuses_static_scales_and_is_not_calibrated() -> None:
    spec = KVCacheSpec.dense(2, 2, 16, "int8")
    assert spec.is_int8 and spec.is_scaled and spec.per_token_scales and not spec.is_fp8
    assert spec.bytes_per_token() == 2 * (2 * 2 * 16 + 2 * 2 * 4)
    from tokenmill.layers.attention.fp8 import allocate_fp8
    with pytest.raises(ValueError, match="scale per vector"):
        allocate_fp8((2, 1, 4, 2, 16), torch.device("cpu"), (2, 1, 1, 2, 1), int8=True)
