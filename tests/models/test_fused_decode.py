"""The fused native decode path (``layers/quant/fused_decode.py``, ``_native/decoder.c``) against
the layer-by-layer path on the same weights (packed int4 / int8, and unquantized fp32, plain or
oneDNN-packed): logits, KV pages and captured hidden states, over mixed steps of several
sequences, fp32, bf16 and fp8 KV pages (static and per-token scales), every kernel set."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tokenmill._native import attention as attention_kernel
from tokenmill._native import quant as native
from tokenmill.contracts.kv import KVCacheSpec
from tokenmill.layers.attention import FP8Pages, select_attention_backend
from tokenmill.layers.attention.base import to_kv_dtype
from tokenmill.layers.attention.fp8 import FP8, calibrate_static_scales, quantize, quantize_static, untile_pages
from tokenmill.layers.quant import packed as packed_mod
from tokenmill.layers.linear import OneDNNLinear, onednn_available, use_linear_backend
from tokenmill.layers.quant.fused_decode import fused_fp32_max_rows, DecoderLayerWeights, FusedDecodeStack
from tokenmill.loader import load_model

from paged_driver import PagedDriver

pytestmark = pytest.mark.skipif(not (native.available() and attention_kernel.available()),
                                reason=str(native.unavailable_reason() or attention_kernel.unavailable_reason()))

# Both paths feed the same int16-quantized activations to the same kernels; only RMSNorm's sum
# order differs, which can move an activation's int16 rounding by one step now and then.
ATOL, RTOL = 2e-3, 1e-3

# (sequence, token count) chunks per step: small prefills run fused too (mixed with decodes);
# the 72-token prefill is above the row limit (packed.gemv_max_rows; at most 64 in this module,
# see _row_limit_at_most_64) and takes the dequantize + GEMM path; decodes follow
STEPS = [
    [("a", 7), ("b", 5)],
    [("a", 1), ("b", 1), ("c", 9)],
    [("a", 1), ("b", 1), ("c", 1)],
    [("d", 72)],
    [("a", 1), ("b", 1), ("c", 1), ("d", 1)],
    [("b", 1), ("d", 1)],
    [("a", 1)],
]


@pytest.fixture(autouse=True)
def _row_limit_at_most_64():
    """A kernel set whose row limit is above 72 (amx: 2048) runs this module at 64, so that the
    72-row step still takes the other path."""
    if packed_mod.gemv_max_rows() <= 64:
        yield
        return
    packed_mod.set_gemv_max_rows(64)
    try:
        yield
    finally:
        packed_mod.set_gemv_max_rows(None)


def _driver(model: Any, kv_dtype: str) -> PagedDriver:
    """kv_dtype: a pool dtype, or ``fp8-static`` / ``fp8-token`` (static scales calibrated by one
    prefill of a sequence no step reads)."""
    d = PagedDriver(model, num_pages=64, page_size=4, seed=3)
    if kv_dtype != "float32":
        scheme = kv_dtype.removeprefix("fp8-") if kv_dtype.startswith("fp8-") else "static"
        spec = KVCacheSpec.dense(model.args.num_layers, model.args.num_kv_heads, model.args.head_dim,
                                 "float8_e4m3fn" if kv_dtype.startswith("fp8-") else kv_dtype).with_fp8_scales(scheme)
        d.attn = select_attention_backend(spec, "cpu", torch.float32, "native")
        d.kv = d.attn.allocate(64, 4)
        if kv_dtype == "fp8-static":
            model.set_fused_decode(False)
            assert calibrate_static_scales(d.kv, lambda: d.step([("calibration", list(range(3, 23)))])) > 0
    assert d.attn.name == "native"
    return d


def _kv_copy(c: Any) -> Any:
    return c._replace(data=c.data.clone(), scale=c.scale.clone()) if isinstance(c, FP8Pages) else c.float().clone()


def _run(model: Any, fused: bool, kv_dtype: str, capture: frozenset[int] = frozenset(), steps=STEPS):
    """STEPS through a fresh pool with the fused path on or off: per-step logits, the KV pages,
    captured hidden states, and whether each step ran the native call."""
    gen = torch.Generator().manual_seed(5)
    drv = _driver(model, kv_dtype)
    logits, captured, ran_fused = [], [], []
    orig = FusedDecodeStack._run
    calls = [0]

    def counting_run(self, *a, **k):
        calls[0] += 1
        return orig(self, *a, **k)

    FusedDecodeStack._run = counting_run  # type: ignore[method-assign]
    try:
        for chunks in steps:
            model.set_fused_decode(fused)
            toks = [(s, torch.randint(3, 2000, (n,), generator=gen).tolist()) for s, n in chunks]
            before = calls[0]
            logits.append(drv.step(toks, capture_layers=capture))
            captured.append({k: v.clone() for k, v in drv.last_ctx.captured.items()})
            ran_fused.append(calls[0] > before)
    finally:
        FusedDecodeStack._run = orig  # type: ignore[method-assign]
    return logits, [_kv_copy(c) for c in drv.kv], captured, ran_fused


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
    return fused_fp32_max_rows() if "fp32" in name else packed_mod.gemv_max_rows()


def test_a_fused_step_that_samples_no_row(packed):
    """A prefill chunk that does not finish its prompt samples nothing: the fused call then runs
    the layers without the head (which refuses zero rows) and the step returns no logits; the
    next step's logits and the KV match the layer-by-layer path."""
    model = packed["llama-int4"].model
    assert model.fused_decode_stack().has_head
    out = {}
    for fused in (True, False):
        model.set_fused_decode(fused)
        drv = _driver(model, "float32")
        gen = torch.Generator().manual_seed(9)
        first = drv.step([("a", torch.randint(3, 2000, (6,), generator=gen).tolist())], sample=False)
        second = drv.step([("a", torch.randint(3, 2000, (1,), generator=gen).tolist())])
        out[fused] = (first, second, [_kv_copy(c) for c in drv.kv])
    model.set_fused_decode(True)
    assert out[True][0].shape == out[False][0].shape == (0, out[True][1].shape[-1])
    torch.testing.assert_close(out[True][1], out[False][1], atol=ATOL, rtol=RTOL)
    for a, b in zip(out[True][2], out[False][2]):
        torch.testing.assert_close(a, b, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("kv_dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("name", ["llama-int4", "qwen2-int4", "llama-int8", "llama-fp32", "qwen2-fp32-onednn"])
def test_fused_decode_matches_layer_by_layer(packed, name, kv_dtype):
    model = packed[name].model
    assert model.fused_decode_stack() is not None
    # packed heads end the native call with the final norm and the head (set_head): the logits
    # compared below come from it; fp32 heads stay in torch
    assert model.fused_decode_stack().has_head == ("fp32" not in name)
    got, kv_got, _, ran = _run(model, True, kv_dtype)
    want, kv_want, _, ran_ref = _run(model, False, kv_dtype)
    limit = _row_limit(name)
    assert ran == [sum(n for _, n in s) <= limit for s in STEPS]  # fused wherever a step fits the row limit
    assert any(ran) and not ran[3]  # the 72-row step is above every row limit
    assert not any(ran_ref)
    # fp32 weights: the same products in another summation order, so far closer than int16 rounding;
    # with a 16-bit pool, K/V that differ in their last fp32 bits may round to neighbouring 16-bit
    # values (more so with the 512-bit sets' larger fused row limit), which the logits then carry
    atol, rtol = ((2e-5 if kv_dtype == "float32" else 5e-4), 1e-4) if "fp32" in name else (ATOL, RTOL)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=atol * float(w.abs().max()), rtol=rtol)
    for g, w in zip(kv_got, kv_want):  # every K/V entry the steps wrote, in every layer
        scale = float(w.abs().max())
        torch.testing.assert_close(g, w, atol=(1e-3 if kv_dtype == "float32" else 1e-2) * scale, rtol=1e-2)


@pytest.mark.parametrize("kernel", native.supported_kernels())
def test_fused_decode_on_every_kernel_set(packed, kernel):
    before_kernel = native.kernel()
    model = packed["llama-int4"].model
    native.set_kernel(kernel)
    try:
        got, _, _, _ = _run(model, True, "float32")
        want, _, _, _ = _run(model, False, "float32")
    finally:
        native.set_kernel(before_kernel)
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
    good = model.fused_decode_stack()
    with pytest.raises(ValueError, match="run_to_logits needs set_head"):
        FusedDecodeStack(layers, hidden=a.hidden_size, num_heads=a.num_heads, num_kv_heads=a.num_kv_heads,
                         head_dim=a.head_dim, intermediate=a.intermediate_size, eps=a.rms_norm_eps,
                         scale=0.25).run_to_logits(h, cs, cs, drv.kv, ctx.meta, torch.tensor([0]))
    with pytest.raises(ValueError, match="bad output head .* 1 logits rows of 1"):   # row 1 of a 1-row step
        good.run_to_logits(h, cs, cs, drv.kv, ctx.meta, torch.tensor([1]))
    _, logits, argmax = good.run_to_logits(h.clone(), cs, cs, drv.kv, ctx.meta, torch.tensor([0]))
    assert logits.shape == (1, a.vocab_size) and torch.isfinite(logits).all()
    assert argmax.tolist() == logits.argmax(dim=-1).tolist()
    # rotary tables read in place by position: the same bits as the gathered rows
    table = torch.randn(8, a.head_dim)
    want = good.run(h.clone(), table[[3]], table[[3]].neg(), drv.kv, ctx.meta)
    got = good.run(h.clone(), table, table.neg(), drv.kv, ctx.meta, positions=torch.tensor([3]))
    assert torch.equal(got, want)
    with pytest.raises(ValueError, match="positions must be int64"):
        good.run(h.clone(), table, table, drv.kv, ctx.meta, positions=torch.tensor([3], dtype=torch.int32))
    with pytest.raises(ValueError, match="positions must be int64"):
        good.run(h.clone(), table[:, :4], table[:, :4], drv.kv, ctx.meta, positions=torch.tensor([3]))


def _argmax_steps(model: Any, threads: int) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    """(logits, ctx.logits_argmax) of every step of STEPS, fused, on ``threads`` threads."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        drv = _driver(model, "float16")
        model.set_fused_decode(True)
        out = []
        for step in STEPS:
            logits = drv.step([(seq, [(7 * len(seq) + i) % 50 + 1 for i in range(n)]) for seq, n in step])
            out.append((logits, drv.last_ctx.logits_argmax))
        return out
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_fused_head_gives_each_rows_argmax(packed, threads):
    """The fused head hands back each logits row's argmax, found by the threads that wrote the row
    (each over its share, joined in thread order): the same index as ``argmax(-1)`` of the
    logits, with 1, 2 or 3 threads, on one-row and several-row steps. The 72-row step runs layer
    by layer and has none."""
    model = packed["llama-int4"].model
    steps = _argmax_steps(model, threads)
    fused = [(l, a) for l, a in steps if a is not None]
    assert len(fused) == len(STEPS) - 1
    for logits, argmax in fused:
        assert argmax.dtype == torch.int64 and argmax.tolist() == logits.argmax(dim=-1).tolist()


def test_fused_head_argmax_ties_and_nans(packed):
    """Ties go to the first index, even where the tied rows lie in different threads' shares, and
    a NaN counts as larger than any number (the first NaN wins), as in torch and numpy. The head
    here is made for it: rows +w at 37, 120 and 199, rows -w at 55 and 130, zero rows elsewhere,
    so the largest logit is tied between the +w rows or between the -w rows; then NaN scales on
    rows 160 and 90 make those two NaN."""
    model = packed["llama-int4"].model
    stack = model.fused_decode_stack()
    hidden, vocab = model.args.hidden_size, 211
    w = torch.randint(-100, 100, (hidden,), generator=torch.Generator().manual_seed(5), dtype=torch.int8)
    qs = torch.zeros(vocab, (hidden + 31) // 32 * 32, dtype=torch.int8)
    for r in (37, 120, 199):
        qs[r, :hidden] = w
    for r in (55, 130):
        qs[r, :hidden] = -w
    scales = torch.full((vocab, 1), 0.01)
    nan_scales = scales.clone()
    nan_scales[[160, 90]] = float("nan")
    before = torch.get_num_threads()
    try:
        for sc, want in ((scales, None), (nan_scales, 90)):
            assert stack.set_head(model.norm.weight, packed_mod.Int8Linear(qs, sc, hidden, hidden))
            for threads in (1, 2, 3):
                torch.set_num_threads(threads)
                drv = _driver(model, "float32")
                drv.step([("a", [3, 4, 5]), ("b", [6, 7])])
                logits = drv.step([("a", [8]), ("b", [9])])
                got = drv.last_ctx.logits_argmax.tolist()
                assert got == logits.argmax(dim=-1).tolist()
                for g, row in zip(got, logits):
                    assert g == want if want is not None else (g == 37 if row[37] > 0 else g == 55)
    finally:
        torch.set_num_threads(before)
        stack.set_head(model.norm.weight, model.lm_head)


@pytest.mark.parametrize("name", ["llama-int4", "llama-fp32"])
@pytest.mark.parametrize("kernel", native.supported_kernels())
def test_fused_decode_is_the_same_bits_on_any_thread_count(packed, kernel, name, monkeypatch):
    """The step runs in one parallel region whose threads claim matmul rows as they go (two
    threads each from its own half first; with TOKENMILL_SHARED_CLAIMS=1 from one counter; with
    TOKENMILL_STATIC_ROWS=1 split evenly up front) and take attention tasks; no row's sum depends
    on the split, so 1, 2 and 3 threads, claimed or static, give identical logits and KV.
    (For fp32 only the steps that run fused: torch's GEMM on the larger ones may split by threads.)"""
    before_kernel = native.kernel()
    model = packed[name].model
    steps = STEPS if "fp32" not in name else [s for s in STEPS if sum(n for _, n in s) <= _row_limit(name)]
    before = torch.get_num_threads()
    native.set_kernel(kernel)
    try:
        runs = []
        for nt, static, shared in ((1, "", ""), (2, "", ""), (3, "", ""), (2, "", "1"), (2, "1", ""), (3, "1", "")):
            torch.set_num_threads(nt)
            monkeypatch.setenv("TOKENMILL_STATIC_ROWS", static)
            monkeypatch.setenv("TOKENMILL_SHARED_CLAIMS", shared)
            logits, kv, _, ran = _run(model, True, "float32", steps=steps)
            assert any(ran)
            runs.append((logits, kv))
    finally:
        torch.set_num_threads(before)
        native.set_kernel(before_kernel)
    for logits, kv in runs[1:]:
        for g, w in zip(logits, runs[0][0]):
            assert torch.equal(g, w)
        for g, w in zip(kv, runs[0][1]):
            assert torch.equal(g, w)


@pytest.mark.parametrize("kv_dtype", ["float16", "fp8-token"])
@pytest.mark.parametrize("name", ["llama-int4", "llama-fp32"])
def test_kv_prefetch_changes_no_bits(packed, name, kv_dtype, monkeypatch):
    """decoder.c prefetches each layer's KV pages during the previous layer's gate_up and down,
    cutting those matmuls into slices of output rows. Neither may change a result: with the
    prefetch on and off (TOKENMILL_KV_PREFETCH / TOKENMILL_NO_KV_PREFETCH, whatever this CPU's
    default), and with prefetcht0 instead of prefetcht1 there and in the attention kernel
    (TOKENMILL_KV_PREFETCH_T0), on 1 and 3 threads, the logits and the KV pages are identical."""
    model = packed[name].model
    steps = STEPS if "fp32" not in name else [s for s in STEPS if sum(n for _, n in s) <= _row_limit(name)]
    before = torch.get_num_threads()
    runs = []
    try:
        for nt in (1, 3):
            torch.set_num_threads(nt)
            for on, off, t0 in (("1", "", ""), ("", "1", ""), ("1", "", "1")):
                monkeypatch.setenv("TOKENMILL_KV_PREFETCH", on)
                monkeypatch.setenv("TOKENMILL_NO_KV_PREFETCH", off)
                monkeypatch.setenv("TOKENMILL_KV_PREFETCH_T0", t0)
                assert native.decode_kv_prefetch()[1] == bool(on)
                logits, kv, _, ran = _run(model, True, kv_dtype, steps=steps)
                assert any(ran)
                runs.append((logits, [c.data if isinstance(c, FP8Pages) else c for c in kv]))
    finally:
        torch.set_num_threads(before)
    for logits, kv in runs[1:]:
        for g, w in zip(logits, runs[0][0]):
            assert torch.equal(g, w)
        for g, w in zip(kv, runs[0][1]):
            assert torch.equal(g.view(torch.uint8) if g.dtype == FP8 else g, w.view(torch.uint8) if w.dtype == FP8 else w)


def test_kv_prefetch_default_follows_the_cpu_vendor(monkeypatch):
    """The fused step's KV prefetch is off by default on Intel CPUs, where it measured slower at
    every context from 2k tokens on, and on elsewhere (it gained 4-8% on an AVX2 Zen 3 host); the
    two switches override the default either way."""
    monkeypatch.delenv("TOKENMILL_KV_PREFETCH", raising=False)
    monkeypatch.delenv("TOKENMILL_NO_KV_PREFETCH", raising=False)
    vendors = {line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
               if line.startswith("vendor_id")}
    default, now = native.decode_kv_prefetch()
    assert default == now == (vendors != {"GenuineIntel"})
    monkeypatch.setenv("TOKENMILL_KV_PREFETCH", "1")
    assert native.decode_kv_prefetch() == (default, True)
    monkeypatch.setenv("TOKENMILL_NO_KV_PREFETCH", "1")   # off wins over on
    assert native.decode_kv_prefetch() == (default, False)


def _fp8_values(c: FP8Pages) -> torch.Tensor:
    return c.data.view(FP8).float() * (c.scale.unsqueeze(-1) if c.per_token else c.scale)


def _assert_quantized_pool_logits(got, want, name: str) -> None:
    """Fused against layer-path logits over an 8-bit pool: close (see test_fused_decode_with_fp8_kv
    for the bounds), the same greedy tokens."""
    atol, rtol = (2e-4, 1e-3) if "fp32" in name else (1e-2, RTOL)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=atol * float(w.abs().max()), rtol=rtol)
        assert torch.equal(g.argmax(-1), w.argmax(-1))


@pytest.mark.parametrize("name", ["llama-int4", "llama-fp32"])
def test_fused_decode_with_tiled_int8_kv(packed, name, monkeypatch):
    """Tiled int8 pages (TOKENMILL_KV_INT8_LAYOUT=tiled) on the fused path: decoder.c's kv_write
    stores the step's codes and scales in the tiled order as the layer path's C write does, and
    the kernel reads them back (decode rows through the tiled prefill path at this page size of 4).
    Close logits, the same greedy tokens, and after untiling the same codes (a code may sit one
    step away where the two paths' K/V differ in their last float bits)."""
    monkeypatch.setenv("TOKENMILL_KV_INT8_LAYOUT", "tiled")
    model = packed[name].model
    got, kv_got, _, ran = _run(model, True, "int8")
    want, kv_want, _, ran_ref = _run(model, False, "int8")
    assert any(ran) and not any(ran_ref)
    _assert_quantized_pool_logits(got, want, name)
    same = total = 0
    for g, w in zip(kv_got, kv_want):
        assert isinstance(g, FP8Pages) and g.tiled and w.tiled
        (gd, gs), (wd, ws) = untile_pages(g.data, g.scale, 4), untile_pages(w.data, w.scale, 4)
        written = ws != 0
        assert torch.equal(written, gs != 0)
        torch.testing.assert_close(gs, ws, atol=0, rtol=1e-3)
        codes_g, codes_w = gd[written].int(), wd[written].int()
        assert (codes_g - codes_w).abs().max() <= 1
        same += int((codes_g == codes_w).sum())
        total += codes_w.numel()
    assert total > 0 and same >= 0.99 * total


@pytest.mark.parametrize("isa", ["best", "no-avx512"])
@pytest.mark.parametrize("scheme", ["static", "token"])
@pytest.mark.parametrize("name", ["llama-int4", "llama-fp32"])
def test_fused_decode_with_fp8_kv(packed, name, scheme, isa, monkeypatch):
    """fp8 pages on the fused path: decoder.c quantizes the step's K/V itself and the kernel reads
    the bytes. Against the layer path on the same pool (torch's write_fp8, then the kernel):
    close logits, the same greedy tokens, and the same bytes (an entry may sit one e4m3 step away
    where the two paths' K/V differ in the last float bits and straddle a rounding midpoint)."""
    if isa == "no-avx512":   # the attention kernel's AVX2 path on a CPU that also has AVX-512
        monkeypatch.setenv("TOKENMILL_NO_AVX512", "1")
    model = packed[name].model
    kv = f"fp8-{scheme}"
    got, kv_got, _, ran = _run(model, True, kv)
    want, kv_want, _, ran_ref = _run(model, False, kv)
    assert ran == [sum(n for _, n in s) <= _row_limit(name) for s in STEPS] and any(ran) and not any(ran_ref)
    # The two paths agree to float rounding before the pool (C and torch rotary and norms differ
    # in the last bits), and a K/V entry that lands on an e4m3 rounding midpoint in one path moves
    # by a whole e4m3 step (about 6%) in the other; one such flip in an int4 model moved a logit
    # by 0.6% of the largest, so packed weights get 1% (a wrong scale or row moves them by ~100%).
    _assert_quantized_pool_logits(got, want, name)
    same = total = 0
    for g, w in zip(kv_got, kv_want):
        assert isinstance(g, FP8Pages) and g.per_token == (scheme == "token")
        written = (g.data != 0) | (w.data != 0)
        same += int((g.data == w.data)[written].sum())
        total += int(written.sum())
        gv, wv = _fp8_values(g), _fp8_values(w)
        torch.testing.assert_close(gv, wv, atol=1e-3 * float(wv.abs().max()), rtol=0.13)   # <= one e4m3 step
        if scheme == "token":
            torch.testing.assert_close(g.scale, w.scale, atol=0, rtol=1e-3)
    assert total > 0 and same >= 0.99 * total


def test_fused_fp8_kv_write_is_torchs_rounding():
    """decoder.c's fp32 -> e4m3 write (saturation, round to nearest even on the float32 bits,
    subnormals, -0) gives torch's bytes for every e4m3 value, every midpoint between two and the
    floats either side of it, values beyond 448, and 100k random values over 24 binades; with
    per-token scales, the scale too."""
    vals = torch.arange(256, dtype=torch.uint8).view(FP8).float()
    v = torch.sort(torch.unique(vals[~torch.isnan(vals)])).values
    mid = (v[1:] + v[:-1]) / 2
    inf = torch.tensor(float("inf"))
    gen = torch.Generator().manual_seed(0)
    rand = torch.randn(100_000, generator=gen) * torch.exp2(torch.randint(-14, 10, (100_000,), generator=gen).float())
    x = torch.cat([v, -v, mid, -mid, torch.nextafter(mid, inf), torch.nextafter(mid, -inf), rand,
                   torch.tensor([449.0, 463.0, 464.0, 465.0, 1e30, -1e30, float("inf"), -float("inf"), 1e-40, -1e-40,
                                 0.0, -0.0])]).contiguous()
    out = torch.empty(x.numel(), dtype=torch.uint8)
    for s in (1.0, 0.0123, 3.7):
        scale = torch.tensor([s])
        native.fp8_quantize(x.data_ptr(), out.data_ptr(), x.numel(), scale.data_ptr(), False)
        assert torch.equal(out, quantize_static(x, scale))
    for i in range(50):
        xv = (torch.randn(64, generator=gen) * 10.0 ** (i % 12 - 8)).contiguous() if i else torch.zeros(64)
        scale = torch.zeros(1)
        native.fp8_quantize(xv.data_ptr(), out.data_ptr(), 64, scale.data_ptr(), True)
        q, s = quantize(xv[None])
        assert torch.equal(out[:64], q[0]) and torch.equal(scale, s)


def test_fused_fp16_kv_write_is_torchs_rounding_saturated():
    """decoder.c's fp32 -> fp16 write gives the bits of torch's x.clamp(-65504, 65504).to(float16)
    (what ``to_kv_dtype`` stores) for every finite half, every midpoint between two neighbours and
    the floats either side of it (normals and subnormals), values beyond the range, infinities,
    NaN and 100k random values over 40 binades."""
    halves = torch.arange(65536, dtype=torch.int32).to(torch.int16).view(torch.float16).float()
    v = torch.sort(torch.unique(halves[torch.isfinite(halves)])).values
    mid = (v[1:] + v[:-1]) / 2
    inf = torch.tensor(float("inf"))
    gen = torch.Generator().manual_seed(1)
    rand = torch.randn(100_000, generator=gen) * torch.exp2(torch.randint(-28, 12, (100_000,), generator=gen).float())
    x = torch.cat([v, mid, torch.nextafter(mid, inf), torch.nextafter(mid, -inf), rand,
                   torch.tensor([65504.0, 65519.0, 65520.0, 1e6, -1e30, float("inf"), -float("inf"), 1e-40, -0.0,
                                 2.0 ** -25, -(2.0 ** -25), 2.0 ** -24 * 1.5])]).contiguous()
    out = torch.empty(x.numel(), dtype=torch.float16)
    native.f16_quantize(x.data_ptr(), out.data_ptr(), x.numel())
    want = to_kv_dtype(x, torch.float16)
    assert torch.equal(out.view(torch.int16), want.view(torch.int16))
    assert float(out.float().abs().max()) == 65504.0
    nan = torch.tensor([float("nan")])
    native.f16_quantize(nan.data_ptr(), out.data_ptr(), 1)
    assert torch.isnan(out[0])


def _chain_then_singles(model: Any, kv_dtype: str, steps: int, threads: int):
    """Three sequences prefilled, then ``steps`` greedy decode steps twice over, in two pools:
    chained in one native call, and one step at a time feeding each argmax back. Returns the
    tokens [steps, 3], last logits and each sequence's KV rows of both."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = []
        for chained in (True, False):
            drv = _driver(model, kv_dtype)
            model.set_fused_decode(True)
            prompts = {"a": [5, 9, 11], "b": [7, 3, 8, 21, 4, 6], "c": [13]}
            first = drv.step(list(prompts.items())).argmax(dim=-1).tolist()
            chunks = [(s, [t]) for s, t in zip(prompts, first)]
            if chained:
                logits = drv.step(chunks, decode_steps=steps)
                tokens = drv.last_ctx.step_tokens
                assert drv.last_ctx.logits_argmax.tolist() == tokens[-1].tolist()
            else:
                rows = []
                for _ in range(steps):
                    logits = drv.step(chunks)
                    rows.append(drv.last_ctx.logits_argmax.tolist())
                    chunks = [(s, [t]) for s, t in zip(prompts, rows[-1])]
                tokens = torch.tensor(rows)
            out.append((tokens, logits, {s: drv.seq_kv(s) for s in prompts}))
        return out
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("name,kv_dtype", [("llama-int4", "float32"), ("llama-int4", "float16"),
                                           ("qwen2-int4", "fp8-token"), ("llama-int8", "bfloat16")])
@pytest.mark.parametrize("threads", [1, 2])
def test_chained_decode_steps_equal_one_step_at_a_time(packed, name, kv_dtype, threads):
    """``decode_steps`` greedy steps in one native call (each step's input the last one's argmax,
    embedded in C) give the same tokens, the same last logits bit for bit and the same K/V bytes
    at every position as the steps run one at a time from Python."""
    model = packed[name].model
    model.set_fused_decode(True)   # (other tests leave it off)
    assert model.chains_decode_steps(3, select_attention_backend(model.kv_cache_spec(), "cpu", torch.float32,
                                                                 "native"), _driver(model, "float32").kv)
    (t1, l1, kv1), (t2, l2, kv2) = _chain_then_singles(model, kv_dtype, 5, threads)
    assert t1.shape == (5, 3) and t1.tolist() == t2.tolist()
    assert torch.equal(l1, l2)
    for seq in kv1:
        assert len(kv1[seq][0][0]) == len(kv2[seq][0][0])
        for (k1, v1), (k2, v2) in zip(kv1[seq], kv2[seq]):
            assert torch.equal(k1, k2) and torch.equal(v1, v2)


def test_chained_decode_steps_refusals(packed):
    """Chains need the packed head and an embedding (an fp32 model's head is torch's, so it says
    no), one row per sequence, and at least one step."""
    fp32 = packed["llama-fp32"].model
    drv = _driver(fp32, "float32")
    fp32.set_fused_decode(True)
    assert fp32.fused_decode_stack() is not None and not fp32.fused_decode_stack().has_head
    assert not fp32.chains_decode_steps(1, drv.attn, drv.kv)
    model = packed["llama-int4"].model
    stack = model.fused_decode_stack()
    drv = _driver(model, "float32")
    model.set_fused_decode(True)
    drv.step([("a", [3, 4, 5])])
    h = torch.zeros(2, model.args.hidden_size)
    drv.step([("a", [6, 7])], sample=False)
    ctx = drv.last_ctx
    model.rotary.ensure(64)
    cos, sin = model.rotary.cos_table, model.rotary.sin_table
    with pytest.raises(ValueError, match="one row per sequence"):   # two rows of one sequence
        stack.run_steps(h, cos, sin, drv.kv, ctx.meta, torch.tensor([3, 4]), 3)
    with pytest.raises(ValueError, match="steps must be >= 1"):
        stack.run_steps(h[:1], cos, sin, drv.kv, ctx.meta, torch.tensor([3]), 0)
    emb = stack._embed
    try:
        stack._embed = None
        with pytest.raises(ValueError, match="set_embedding"):
            stack.run_steps(h[:1], cos, sin, drv.kv, ctx.meta, torch.tensor([3]), 2)
        assert not model.chains_decode_steps(1, drv.attn, drv.kv)
    finally:
        stack._embed = emb


def test_chained_steps_with_an_fp32_embedding(packed):
    """An embedding of plain fp32 rows (a GGUF whose token table is f32 / f16) is read in place
    by the chain: with the packed int8 table's own values as fp32 rows, the same tokens and
    logits as with the packed table."""
    from tokenmill.layers.linear import DenseLinear

    model = packed["llama-int4"].model
    stack = model.fused_decode_stack()
    assert isinstance(model.embed_tokens, packed_mod.Int8Linear)
    (t1, l1, _), _ = _chain_then_singles(model, "float32", 4, 1)
    try:
        assert stack.set_embedding(DenseLinear(model.embed_tokens.dequantize().contiguous()))
        (t2, l2, _), _ = _chain_then_singles(model, "float32", 4, 1)
    finally:
        assert stack.set_embedding(model.embed_tokens)
    assert t1.tolist() == t2.tolist() and torch.equal(l1, l2)


def test_a_set_stop_flag_ends_the_chain_after_its_step(packed):
    """The stop flag (set by the engine from another thread when work arrives) is read after
    each step: set before the call, the chain runs one step, whose token is the first of the
    whole chain's; cleared, all steps run."""
    model = packed["llama-int4"].model
    (whole, _, _), _ = _chain_then_singles(model, "float32", 4, 1)
    drv = _driver(model, "float32")
    model.set_fused_decode(True)
    first = drv.step([("a", [5, 9, 11]), ("b", [7, 3, 8, 21, 4, 6]), ("c", [13])]).argmax(dim=-1).tolist()
    stack = model.fused_decode_stack()
    run = stack.run_steps
    stop = torch.ones(1, dtype=torch.int32)
    try:
        stack.run_steps = lambda *a: run(*a[:7], stop)   # type: ignore[method-assign]
        drv.step([(s, [t]) for s, t in zip("abc", first)], decode_steps=4)
    finally:
        del stack.run_steps
    assert drv.last_ctx.step_tokens.tolist() == whole[:1].tolist()
    with pytest.raises(ValueError, match="stop must be an int32"):
        run(torch.zeros(1, model.args.hidden_size), model.rotary.cos_table, model.rotary.sin_table, drv.kv,
            drv.last_ctx.meta, torch.tensor([3]), 2, torch.ones(1, dtype=torch.int64))
