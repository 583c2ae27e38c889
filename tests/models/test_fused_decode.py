"""The fused native decode path (``layers/quant/fused_decode.py``, ``_native/decoder.c``) against
the layer-by-layer path on the same weights (packed int4 / int8, and unquantized fp32, plain or
oneDNN-packed): logits, KV pages and captured hidden states, over mixed steps of several
sequences, fp32 and bf16 KV pages, every kernel set."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tokenmill._native import attention as attention_kernel
from tokenmill._native import quant as native
from tokenmill.contracts.kv import KVCacheSpec
from tokenmill.layers.attention import select_attention_backend
from tokenmill.layers.quant import packed as packed_mod
from tokenmill.layers.linear import OneDNNLinear, onednn_available, use_linear_backend
from tokenmill.layers.quant.fused_decode import FUSED_FP32_MAX_ROWS, DecoderLayerWeights, FusedDecodeStack
from tokenmill.loader import load_model

from paged_driver import PagedDriver

pytestmark = pytest.mark.skipif(not (native.available() and attention_kernel.available()),
                                reason=str(native.unavailable_reason() or attention_kernel.unavailable_reason()))

# Both paths feed the same int16-quantized activations to the same kernels; only RMSNorm's sum
# order differs, which can move an activation's int16 rounding by one step now and then.
ATOL, RTOL = 2e-3, 1e-3

# (sequence, token count) chunks per step: small prefills run fused too (mixed with decodes);
# the 40-token prefill is above every kernel set's row limit (packed.gemv_max_rows) and takes
# the dequantize + GEMM path; decodes follow
STEPS = [
    [("a", 7), ("b", 5)],
    [("a", 1), ("b", 1), ("c", 9)],
    [("a", 1), ("b", 1), ("c", 1)],
    [("d", 40)],
    [("a", 1), ("b", 1), ("c", 1), ("d", 1)],
    [("b", 1), ("d", 1)],
    [("a", 1)],
]


def _driver(model: Any, kv_dtype: str) -> PagedDriver:
    d = PagedDriver(model, num_pages=64, page_size=4, seed=3)
    if kv_dtype != "float32":
        spec = KVCacheSpec.dense(model.args.num_layers, model.args.num_kv_heads, model.args.head_dim, kv_dtype)
        d.attn = select_attention_backend(spec, "cpu", torch.float32, "native")
        d.kv = d.attn.allocate(64, 4)
    assert d.attn.name == "native"
    return d


def _run(model: Any, fused: bool, kv_dtype: str, capture: frozenset[int] = frozenset(), steps=STEPS):
    """STEPS through a fresh pool with the fused path on or off: per-step logits, the KV pages,
    captured hidden states, and whether each step ran the native call."""
    gen = torch.Generator().manual_seed(5)
    drv = _driver(model, kv_dtype)
    logits, captured, ran_fused = [], [], []
    orig = FusedDecodeStack.run
    calls = [0]

    def counting_run(self, *a, **k):
        calls[0] += 1
        return orig(self, *a, **k)

    FusedDecodeStack.run = counting_run  # type: ignore[method-assign]
    try:
        for chunks in steps:
            model.set_fused_decode(fused)
            toks = [(s, torch.randint(3, 2000, (n,), generator=gen).tolist()) for s, n in chunks]
            before = calls[0]
            logits.append(drv.step(toks, capture_layers=capture))
            captured.append({k: v.clone() for k, v in drv.last_ctx.captured.items()})
            ran_fused.append(calls[0] > before)
    finally:
        FusedDecodeStack.run = orig  # type: ignore[method-assign]
    return logits, [c.float().clone() for c in drv.kv], captured, ran_fused


@pytest.fixture(scope="module")
def packed(tiny_dirs: dict[str, Path]) -> dict[str, Any]:
    """Tiny Llama and Qwen2 (q/k/v bias) in int4 groups; Llama also in int8 per channel; Llama and
    Qwen2 unquantized (fp32 rows as loaded, and Qwen2's also oneDNN-packed as the runner does)."""
    out = {"llama-int4": load_model(str(tiny_dirs["LlamaForCausalLM"]), quantization="int4"),
           "qwen2-int4": load_model(str(tiny_dirs["Qwen2ForCausalLM"]), quantization="int4"),
           "llama-int8": load_model(str(tiny_dirs["LlamaForCausalLM"]), quantization="int8"),
           "llama-fp32": load_model(str(tiny_dirs["LlamaForCausalLM"]), quantization="none"),
           "qwen2-fp32-onednn": load_model(str(tiny_dirs["Qwen2ForCausalLM"]), quantization="none")}
    if onednn_available():
        assert use_linear_backend(out["qwen2-fp32-onednn"].model, "onednn") > 0
        assert isinstance(out["qwen2-fp32-onednn"].model.layers[0].qkv_proj, OneDNNLinear)
    return out


def _row_limit(name: str) -> int:
    return FUSED_FP32_MAX_ROWS if "fp32" in name else packed_mod.gemv_max_rows()


@pytest.mark.parametrize("kv_dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("name", ["llama-int4", "qwen2-int4", "llama-int8", "llama-fp32", "qwen2-fp32-onednn"])
def test_fused_decode_matches_layer_by_layer(packed, name, kv_dtype):
    model = packed[name].model
    assert model.fused_decode_stack() is not None
    got, kv_got, _, ran = _run(model, True, kv_dtype)
    want, kv_want, _, ran_ref = _run(model, False, kv_dtype)
    limit = _row_limit(name)
    assert ran == [sum(n for _, n in s) <= limit for s in STEPS]  # fused wherever a step fits the row limit
    assert any(ran) and not ran[3]  # the 40-row step is above every row limit
    assert not any(ran_ref)
    # fp32 weights: the same products in another summation order, so far closer than int16 rounding
    atol, rtol = (2e-5, 1e-4) if "fp32" in name else (ATOL, RTOL)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=atol * float(w.abs().max()), rtol=rtol)
    for g, w in zip(kv_got, kv_want):  # every K/V entry the steps wrote, in every layer
        scale = float(w.abs().max())
        torch.testing.assert_close(g, w, atol=(1e-3 if kv_dtype == "float32" else 1e-2) * scale, rtol=1e-2)


@pytest.mark.parametrize("kernel", native.supported_kernels())
def test_fused_decode_on_every_kernel_set(packed, kernel):
    best = native.best_kernel()
    model = packed["llama-int4"].model
    native.set_kernel(kernel)
    try:
        got, _, _, _ = _run(model, True, "float32")
        want, _, _, _ = _run(model, False, "float32")
    finally:
        native.set_kernel(best)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=ATOL * float(w.abs().max()), rtol=RTOL)


def test_fused_decode_captures_hidden_states(packed):
    """A drafter's captured layers split the native call; the captures equal the layer path's."""
    model = packed["llama-int4"].model
    capture = frozenset({-1, 0, 1})
    got, _, cap_got, ran = _run(model, True, "float32", capture)
    want, _, cap_want, _ = _run(model, False, "float32", capture)
    assert any(ran)
    for g, w in zip(cap_got, cap_want):
        assert set(g) == set(w) == capture
        for k in capture:
            torch.testing.assert_close(g[k], w[k], atol=1e-3 * float(w[k].abs().max()), rtol=1e-3)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=ATOL * float(w.abs().max()), rtol=RTOL)


def test_fused_decode_applies_only_where_it_can(tiny_dirs):
    dense = load_model(str(tiny_dirs["LlamaForCausalLM"]), quantization="none").model
    assert dense.fused_decode_stack() is not None   # fp32 rows take the fp32 kernel
    layers = [DecoderLayerWeights(l.input_layernorm.weight, l.post_attention_layernorm.weight, l.qkv_proj,
                                  l.qkv_bias, l.o_proj, l.gate_up_proj, l.down_proj) for l in dense.layers]
    assert FusedDecodeStack.unsupported_reason(layers, torch.float32) is None
    half = [DecoderLayerWeights(l.input_norm, l.post_norm, type(l.qkv)(l.qkv.dequantize().to(torch.bfloat16)),
                                l.qkv_bias, l.o, l.gate_up, l.down) for l in layers]
    assert "layer 0 qkv is dense, not a packed int4/int8 or fp32 matrix" in FusedDecodeStack.unsupported_reason(
        half, torch.float32)
    assert "fp32 models only" in FusedDecodeStack.unsupported_reason(layers, torch.bfloat16)
    qwen3 = load_model(str(tiny_dirs["Qwen3ForCausalLM"]), quantization="int4").model
    assert qwen3.fused_decode_stack() is None   # per-head q/k norms stay layer by layer


def test_fused_decode_refuses_a_wrong_shape(packed):
    """A layer table that does not fit the stated sizes is refused before any work, naming the matrix."""
    model = packed["llama-int4"].model
    a = model.args
    layers = [DecoderLayerWeights(l.input_layernorm.weight, l.post_attention_layernorm.weight, l.qkv_proj,
                                  l.qkv_bias, l.o_proj, l.gate_up_proj, l.down_proj) for l in model.layers]
    bad = FusedDecodeStack(layers, hidden=a.hidden_size, num_heads=a.num_heads, num_kv_heads=a.num_kv_heads,
                           head_dim=a.head_dim, intermediate=a.intermediate_size * 2, eps=a.rms_norm_eps, scale=0.25)
    drv = _driver(model, "float32")
    model.set_fused_decode(True)
    drv.step([("x", [5, 6, 7])])   # a real pool and metadata to call with
    from tokenmill.contracts.batch import ForwardBatch
    from tokenmill.layers.attention import ForwardContext
    batch = ForwardBatch(input_ids=torch.tensor([9]), positions=torch.tensor([3]), slot_mapping=torch.tensor([3]),
                         query_start_loc=torch.tensor([0, 1]), seq_lens=torch.tensor([4]),
                         block_tables=torch.tensor([[drv.pages["x"][0]]]), logits_indices=torch.tensor([0]),
                         page_size=4, max_seq_len=4)
    ctx = ForwardContext.prepare(drv.attn, batch, drv.kv)
    h = torch.zeros(1, a.hidden_size)
    cs = torch.ones(1, a.head_dim)
    with pytest.raises(ValueError, match="layer 0 gate_up_proj is not a packed"):
        bad.run(h, cs, cs, drv.kv, ctx.meta)


@pytest.mark.parametrize("name", ["llama-int4", "llama-fp32"])
@pytest.mark.parametrize("kernel", native.supported_kernels())
def test_fused_decode_is_the_same_bits_on_any_thread_count(packed, kernel, name):
    """The step runs in one parallel region whose threads split matmul rows and attention tasks;
    no row's sum depends on the split, so 1, 2 and 3 threads give identical logits and KV. (For
    fp32 only the steps that run fused: torch's GEMM on the larger ones may split by threads.)"""
    best = native.best_kernel()
    model = packed[name].model
    steps = STEPS if "fp32" not in name else [s for s in STEPS if sum(n for _, n in s) <= _row_limit(name)]
    before = torch.get_num_threads()
    native.set_kernel(kernel)
    try:
        runs = []
        for nt in (1, 2, 3):
            torch.set_num_threads(nt)
            logits, kv, _, ran = _run(model, True, "float32", steps=steps)
            assert any(ran)
            runs.append((logits, kv))
    finally:
        torch.set_num_threads(before)
        native.set_kernel(best)
    for logits, kv in runs[1:]:
        for g, w in zip(logits, runs[0][0]):
            assert torch.equal(g, w)
        for g, w in zip(kv, runs[0][1]):
            assert torch.equal(g, w)
