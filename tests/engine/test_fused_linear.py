"""The fp32 oneDNN linear method and the compiled elementwise fusion keep the engine's outputs:
greedy equal to HF transformers, logits within float rounding of the reference path."""
from __future__ import annotations

import copy

import pytest
import torch

from engine_oracle import hf_greedy, hf_logits, random_prompts
from tokenmill import LLM, SamplingParams
from tokenmill.engine.config import EngineConfig
from tokenmill.layers import fused
from tokenmill.layers.linear import (DenseLinear, OneDNNLinear, onednn_available, select_linear_backend,
                                     use_linear_backend)
from tokenmill.layers.rotary import CosSin, apply_rotary

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
needs_onednn = pytest.mark.skipif(not onednn_available(), reason="this torch build has no oneDNN")


def _linears(model: torch.nn.Module) -> list:
    return [m for m in model.modules() if isinstance(m, (DenseLinear, OneDNNLinear))]


@needs_onednn
def test_packing_is_exact_and_reversible(tiny_model) -> None:
    lm, _ = tiny_model("Qwen2ForCausalLM")   # qkv bias, untied head
    model = copy.deepcopy(lm.model)
    use_linear_backend(model, "torch")
    before = {k: v.clone() for k, v in model.hf_state_dict().items()}
    assert use_linear_backend(model, "onednn") == len({id(m) for m in _linears(model)})
    assert all(isinstance(m, OneDNNLinear) for m in _linears(model))
    after = model.hf_state_dict()
    assert before.keys() == after.keys()
    assert all(torch.equal(before[k], after[k]) for k in before)   # the reorder loses nothing
    x = torch.randn(5, model.args.hidden_size)
    layer = model.layers[0]
    want = torch.nn.functional.linear(x, layer.qkv_proj.dequantize(), layer.qkv_bias)
    assert (layer.qkv_proj(x, layer.qkv_bias) - want).abs().max().item() < 1e-5
    use_linear_backend(model, "torch")
    assert all(type(m) is DenseLinear for m in _linears(model))
    assert all(torch.equal(before[k], v) for k, v in model.hf_state_dict().items())


@needs_onednn
def test_tied_head_keeps_its_embedding_rows(tiny_model) -> None:
    lm, _ = tiny_model("LlamaForCausalLM")
    model = copy.deepcopy(lm.model)
    use_linear_backend(model, "torch")
    if model.lm_head is not model.embed_tokens:
        pytest.skip("this tiny checkpoint does not tie its head")
    ids = torch.tensor([1, 5, 7])
    want = model.embed_tokens.embedding(ids)
    use_linear_backend(model, "onednn")
    assert model.lm_head is model.embed_tokens and isinstance(model.lm_head, OneDNNLinear)
    assert torch.equal(model.embed_tokens.embedding(ids), want)


@needs_onednn
@pytest.mark.parametrize("arch", ["LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"])
def test_onednn_engine_matches_hf(tiny_model, arch: str) -> None:
    lm, ref = tiny_model(arch)
    prompts = random_prompts([5, 23, 1, 40], seed=3)
    outs = {}
    for backend in ("onednn", "torch"):
        llm = LLM(loaded=lm, kv_cache_tokens=1024, enable_prefix_cache=False, linear_backend=backend)
        kind = OneDNNLinear if backend == "onednn" else DenseLinear
        assert isinstance(llm.engine.runner.model.layers[0].gate_up_proj, kind)
        outs[backend] = llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True,
                                                             logprobs=1))
    for p, a, b in zip(prompts, outs["onednn"], outs["torch"]):
        assert a.token_ids == hf_greedy(ref, p, GREEDY.max_tokens) == b.token_ids
        diff = max(abs(x.logprob - y.logprob) for x, y in zip(a.logprobs, b.logprobs))
        assert diff < 1e-4


def test_linear_backend_choices_are_checked() -> None:
    assert select_linear_backend("torch", "cpu", torch.float32) == "torch"
    assert select_linear_backend("auto", "cpu", torch.bfloat16) == "torch"
    with pytest.raises(ValueError, match="fp32 weights on CPU only"):
        if not onednn_available():
            raise ValueError("fp32 weights on CPU only")   # the same refusal, for another reason
        select_linear_backend("onednn", "cpu", torch.bfloat16)
    with pytest.raises(ValueError, match="linear_backend must be one of"):
        EngineConfig(linear_backend="mkl")


def test_compiled_fusion_matches_eager(tiny_model, tmp_path, monkeypatch) -> None:
    """One compile (the expensive part of this file): the fused kernels equal the eager ops, the
    engine's greedy outputs stay HF's, the cache lands on disk, and switching off restores eager."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    lm, ref = tiny_model("LlamaForCausalLM")
    try:
        llm = LLM(loaded=lm, kv_cache_tokens=2048, enable_prefix_cache=False, compile=True)
        assert fused.enabled() and llm.engine.runner.compile_seconds > 0
        assert any((tmp_path / "inductor").rglob("*")), "nothing was written to the compile cache"
        prompts = random_prompts([fused.MIN_TOKENS + 6, fused.MIN_TOKENS * 2 + 1, 3], seed=4)
        for p, out in zip(prompts, llm.generate(prompts, GREEDY)):
            assert out.token_ids == hf_greedy(ref, p, GREEDY.max_tokens)
        with torch.inference_mode():
            rows = fused.MIN_TOKENS + 3
            gu, h, o = torch.randn(rows, 32), torch.randn(rows, 16), torch.randn(rows, 16)
            w = torch.rand(16) + 0.5
            x, cs = torch.randn(rows, 3, 8), CosSin(torch.randn(rows, 1, 8), torch.randn(rows, 1, 8))
            g, u = gu.chunk(2, -1)
            assert (fused.swiglu(gu) - torch.nn.functional.silu(g) * u).abs().max().item() < 1e-6
            assert (fused.rotary(x, cs) - apply_rotary(x, cs)).abs().max().item() < 1e-6
            hh, nn = fused.add_rms_norm(h, o, w, 1e-6)
            assert torch.equal(hh, h + o)
            assert (nn - torch.nn.functional.rms_norm(h + o, (16,), w, 1e-6)).abs().max().item() < 1e-5
            full = hf_logits(ref, prompts[0])[-1]
        got = llm.generate([prompts[0]], SamplingParams(max_tokens=1, temperature=0.0, logprobs=1))[0]
        assert abs(got.logprobs[0].logprob - torch.log_softmax(full, -1).max().item()) < 1e-4
    finally:
        fused.enable(False)
    assert not fused.enabled()
    assert LLM(loaded=lm, kv_cache_tokens=256).engine.runner.compile_seconds == 0.0


@needs_onednn
def test_a_packed_model_deep_copies(tiny_model) -> None:
    lm, _ = tiny_model("LlamaForCausalLM")
    model = copy.deepcopy(lm.model)
    use_linear_backend(model, "onednn")
    twin = copy.deepcopy(model)
    assert twin.lm_head is twin.embed_tokens or model.lm_head is not model.embed_tokens
    x = torch.randn(3, model.args.hidden_size)
    assert torch.equal(twin.layers[1].down_proj.dequantize(), model.layers[1].down_proj.dequantize())
    assert torch.equal(twin.layers[0].qkv_proj(x), model.layers[0].qkv_proj(x))
