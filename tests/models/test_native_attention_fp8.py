"""The native paged-attention kernel over fp8 (float8_e4m3fn) pages, both scale schemes.

* The kernel's byte -> float32 widening (scalar table, AVX2+F16C, AVX-512) is exact for all 254
  non-NaN bytes.
* On the same pool the native backend stores the same bytes (and per-vector scales) as the torch
  reference, and its output equals attention over the dequantized pool (computed by the fp32
  reference) to float rounding: decode rows, split-K decodes, prefill chunks on the tiled and
  the per-row path, fresh and after cached context, GQA, pages of 1 to 16, every ISA path.
* Where the reference itself reads the pool (decode rows, chunks after cached context) the two
  backends agree as closely; a fresh prefill differs only by the fp8 rounding of its own K/V.
"""
from __future__ import annotations

import random

import pytest
import torch

from tokenmill._native import attention as kernel
from tokenmill.contracts.kv import KVCacheSpec
from tokenmill.layers.attention import FP8Pages, select_attention_backend
from tokenmill.layers.attention.fp8 import FP8, quantize, quantize_static

from tests.models.paged_driver import chunks_batch

pytestmark = pytest.mark.skipif(not kernel.available(), reason=str(kernel.unavailable_reason()))


def _paths() -> list[int]:
    simd = kernel.simd()
    return [0] + ([1] if simd in ("avx2+fma", "avx512") else []) + ([2] if simd == "avx512" else [])


@pytest.mark.parametrize("path", _paths())
def test_e4m3_widening_is_exact_for_every_byte(path):
    b = torch.arange(256, dtype=torch.uint8)
    ok = torch.tensor([i not in (0x7F, 0xFF) for i in range(256)])
    # an odd length and an offset start exercise each routine's tail as well
    for start, n in ((0, 256), (3, 253)):
        src = b[start:start + n].contiguous()
        out = torch.full((n,), float("nan"))
        kernel.e4m3_to_float(src.data_ptr(), out.data_ptr(), n, path)
        want = src.view(FP8).float()
        keep = ok[start:start + n]
        assert torch.equal(out[keep], want[keep])
        assert torch.equal(torch.signbit(out[keep]), torch.signbit(want[keep]))   # -0.0 stays -0.0


def test_e4m3_table_widening_is_exact_for_every_byte():
    """The AVX-512 decode body's 64-byte table widening (vpermi2b; dims put back in order here)."""
    b = torch.arange(256, dtype=torch.uint8)
    src = torch.cat([b, b.flip(0), b[:37]]).contiguous()   # 64-byte blocks and a tail
    out = torch.full((src.numel(),), float("nan"))
    try:
        kernel.e4m3_to_float(src.data_ptr(), out.data_ptr(), src.numel(), 3)
    except ValueError:
        pytest.skip("no AVX-512 VBMI on this CPU")
    keep = (src != 0x7F) & (src != 0xFF)
    want = src.view(FP8).float()
    assert torch.equal(out[keep], want[keep])
    assert torch.equal(torch.signbit(out[keep]), torch.signbit(want[keep]))


_batch = chunks_batch


def _forward(backend_name, spec, cache, batch, q, k, v):
    backend = select_attention_backend(spec, "cpu", torch.float32, backend_name)
    assert backend.name == backend_name
    return backend.forward(q, k, v, cache, backend.build_metadata(batch), spec.layers[0].head_dim ** -0.5)


def _clone(c: FP8Pages) -> FP8Pages:
    return c._replace(data=c.data.clone(), scale=c.scale.clone())


def _dequantized(c: FP8Pages) -> torch.Tensor:
    if c.per_token:
        return c.data.view(FP8).float() * c.scale.unsqueeze(-1)
    return c.data.view(FP8).float() * c.scale


def _fp8_case(hq, hkv, d, page_size, shapes, scheme, seed):
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    num_pages = sum(-(-(c + n) // page_size) for c, n in shapes) + 2
    free = list(range(1, num_pages))
    rng.shuffle(free)
    tables = [[free.pop() for _ in range(-(-(c + n) // page_size))] for c, n in shapes]
    x = torch.randn(2, num_pages, page_size, hkv, d, generator=gen) * (0.5 + torch.rand(2, 1, 1, hkv, 1, generator=gen))
    if scheme == "token":
        data, scale = quantize(x)
        pool = FP8Pages(data, scale, True)
    else:   # static scales as calibration would set them: headroom over each head's amax
        scale = x.abs().amax(dim=(1, 2, 4), keepdim=True) * 4.0 / 448.0
        pool = FP8Pages(quantize_static(x, scale), scale.contiguous(), False)
    t = sum(n for _, n in shapes)
    q = torch.randn(t, hq + hkv, d, generator=gen)[:, :hq]   # a strided view, as the model hands it
    k, v = torch.randn(t, hkv, d, generator=gen), torch.randn(t, hkv, d, generator=gen)
    spec = KVCacheSpec.dense(1, hkv, d, "float8_e4m3fn").with_fp8_scales(scheme)
    return spec, pool, tables, q, k, v


CASES = [
    (9, 3, 64, 16, [(0, 1), (40, 1), (100, 70), (0, 33), (17, 5), (1029, 77)]),   # SmolLM2-like heads
    (4, 4, 8, 4, [(3, 1), (0, 9), (11, 150)]),                                      # MHA, page of 4
    (8, 1, 16, 1, [(50, 1), (0, 2), (7, 7)]),                                       # group of 8, page of 1
    (6, 2, 12, 5, [(0, 1), (23, 1), (9, 33)]),                                      # head_dim 12: scalar rows
    (3, 1, 10, 4, [(21, 17), (0, 5), (6, 1)]),                                      # head_dim 10: portable tile
    (2, 1, 64, 16, [(2500, 1)]),                                                    # one long decode: split-K
    (16, 2, 128, 16, [(300, 41), (1, 2), (1500, 1)]),                               # group 8, head_dim 128
]


@pytest.mark.parametrize("isa", ["best", "no-avx512"])
@pytest.mark.parametrize("scheme", ["static", "token"])
@pytest.mark.parametrize("hq,hkv,d,page_size,shapes", CASES)
def test_native_fp8_matches_reference(hq, hkv, d, page_size, shapes, scheme, isa, monkeypatch):
    if isa == "no-avx512":   # the AVX2 path on a CPU that also has AVX-512
        monkeypatch.setenv("TOKENMILL_NO_AVX512", "1")
    spec, pool, tables, q, k, v = _fp8_case(hq, hkv, d, page_size, shapes, scheme, hq * 100 + d)
    batch = _batch(shapes, tables, page_size)
    cache = _clone(pool)
    out = _forward("native", spec, cache, batch, q, k, v)
    ref8_cache = _clone(pool)
    ref8 = _forward("torch", spec, ref8_cache, batch, q, k, v)
    # the same bytes and scales written
    assert torch.equal(cache.data, ref8_cache.data)
    assert torch.equal(cache.scale, ref8_cache.scale)
    assert torch.isfinite(out).all()
    # attention over the dequantized pool, by the fp32 reference (fed the K/V as stored)
    deq = _dequantized(cache)
    slots = batch.slot_mapping
    kq = deq[0].view(-1, hkv, d)[slots]
    vq = deq[1].view(-1, hkv, d)[slots]
    exact = _forward("torch", KVCacheSpec.dense(1, hkv, d), deq.clone(), batch, q, kq, vq)
    assert (out - exact).abs().max().item() < 2e-5 * max(1.0, float(exact.abs().max()))
    # the fp8 reference reads the pool for decode rows and chunks after context: the same there
    row = 0
    for cached, n in shapes:
        if cached > 0 or n == 1:
            assert (out[row:row + n] - ref8[row:row + n]).abs().max().item() < 2e-5 * max(1.0, float(ref8.abs().max()))
        else:   # a fresh prefill: the reference attends its own unrounded K/V (fp8 rounding apart)
            assert (out[row:row + n] - ref8[row:row + n]).abs().max().item() < 0.1 * max(1.0, float(ref8.abs().max()))
        row += n
    if any(n > 1 for _, n in shapes):   # prefill chunks on the per-row path (kept for A/B) agree too
        monkeypatch.setenv("TOKENMILL_NO_PREFILL_TILES", "1")
        rows = _forward("native", spec, _clone(pool), batch, q, k, v)
        assert (rows - exact).abs().max().item() < 2e-5 * max(1.0, float(exact.abs().max()))


def assert_batch_invariant(spec, pool, tables, shapes, q, k, v) -> None:
    """Each sequence's rows, run alone, equal its rows in the whole batch bit for bit (pages of 16)."""
    together = _forward("native", spec, _clone(pool), _batch(shapes, tables, 16), q, k, v)
    row = 0
    for i, (c, n) in enumerate(shapes):
        alone = _forward("native", spec, _clone(pool), _batch([(c, n)], [tables[i]], 16),
                         q[row:row + n], k[row:row + n], v[row:row + n])
        assert torch.equal(alone, together[row:row + n])
        row += n


def test_native_fp8_result_does_not_depend_on_the_batch():
    """A sequence's rows come out bit-identical alone and beside other sequences (fp8 pages)."""
    shapes = [(200, 1), (0, 50), (2500, 1), (30, 20)]
    spec, pool, tables, q, k, v = _fp8_case(9, 3, 64, 16, shapes, "static", 7)
    assert_batch_invariant(spec, pool, tables, shapes, q, k, v)


def test_auto_takes_fp8_pools_natively():
    fp8 = KVCacheSpec.dense(2, 2, 16, "float8_e4m3fn")
    assert select_attention_backend(fp8, "cpu", torch.float32, "auto").name == "native"
    assert select_attention_backend(fp8.with_fp8_scales("token"), "cpu", torch.float32, "auto").name == "native"
    assert select_attention_backend(fp8, "cpu", torch.bfloat16, "auto").name == "torch"   # bf16 activations


@pytest.mark.parametrize("kind,dtype", [(2, torch.uint8), (3, torch.uint8), (5, torch.int8)])
def test_kernel_refuses_scaled_pages_without_scales(kind, dtype):
    """fp8 (static, per-vector) and int8 pages need their scale pointers."""
    q = torch.zeros(1, 2, 16)
    out = torch.empty(1, 32)
    pages = torch.zeros(2, 1, 4, 1, 16, dtype=dtype)
    meta = [torch.zeros(1, 1, dtype=torch.long), torch.tensor([0, 1]), torch.tensor([1])]
    with pytest.raises(ValueError, match="scale"):
        kernel.paged_attention(q.data_ptr(), q.stride(0), out.data_ptr(), pages[0].data_ptr(), pages[1].data_ptr(),
                               meta[0].data_ptr(), 1, meta[1].data_ptr(), meta[2].data_ptr(), 1, 4, 2, 1, 16,
                               0.25, 1, kind)
