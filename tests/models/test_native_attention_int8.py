"""The native paged-attention kernel over int8 pages (one fp32 scale per stored vector).

* The C write (``fp8_write(..., int8=True)``, the fused decode path's too) stores the same codes
  and scales as the torch reference's ``quantize_int8``, ties rounded to even.
* The widening bodies (scalar rows, AVX2, AVX-512, prefill tiles) compute attention over the
  dequantized pool to float rounding, as they do for fp8.
* The AVX-512 VNNI decode body (integer scores and V sums) also rounds the query (to int16)
  and the softmax weights (to 16 bits against each block's bound): its decode rows stay within
  1e-3 of the exact result (measured: at most 1.2e-4 of the largest output), and it is still
  batch invariant.
"""
from __future__ import annotations

import pytest
import torch

from tokenmill._native import attention as kernel
from tokenmill.contracts.kv import KVCacheSpec
from tokenmill.layers.attention import FP8Pages
from tokenmill.layers.attention.fp8 import quantize_int8

from tests.models.paged_driver import chunks_batch
from tests.models.test_native_attention_fp8 import CASES, _clone, _fp8_case, _forward, assert_batch_invariant

pytestmark = pytest.mark.skipif(not kernel.available(), reason=str(kernel.unavailable_reason()))


def _int8_case(hq, hkv, d, page_size, shapes, seed):
    """The fp8 test's pool and batch, quantized to int8 instead."""
    _, fp8_pool, tables, q, k, v = _fp8_case(hq, hkv, d, page_size, shapes, "token", seed)
    x = fp8_pool.data.view(torch.float8_e4m3fn).float() * fp8_pool.scale.unsqueeze(-1)
    data, scale = quantize_int8(x)
    spec = KVCacheSpec.dense(1, hkv, d, "int8")
    return spec, FP8Pages(data, scale, True), tables, q, k, v


def _vnni_rows(shapes, d) -> bool:
    """Whether this CPU runs the VNNI body for these shapes' decode rows (and few-row chunks)."""
    return kernel.simd() == "avx512" and d % 64 == 0 and "avx512_vnni" in open("/proc/cpuinfo").read()


def test_int8_write_rounds_as_torch():
    """Codes and scales of the C write equal quantize_int8's, ties to even, the largest exact."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(37, 3, 64, generator=gen) * torch.rand(37, 3, 1, generator=gen) * 5
    x[0, 0, :8] = torch.tensor([127.0, 0.5, 1.5, 2.5, -0.5, -2.5, 126.5, -127.0])   # scale 1: ties
    x[1, 1] = 0.0                                                                   # an all-zero vector
    slots = torch.randperm(40, generator=gen)[:37].sort().values
    data = torch.zeros(40, 3, 64, dtype=torch.int8)
    scale = torch.zeros(40, 3)
    kernel.fp8_write(x.data_ptr(), x.stride(0), slots.data_ptr(), 37, 3, 64, data.data_ptr(), scale.data_ptr(), True,
                     True)
    want, wscale = quantize_int8(x)
    assert torch.equal(data[slots], want) and torch.equal(scale[slots], wscale)
    assert data[slots][0, 0, :8].tolist() == [127, 0, 2, 2, 0, -2, 126, -127]
    assert (data[slots].abs() <= 127).all()
    with pytest.raises(ValueError, match="per-token"):
        kernel.fp8_write(x.data_ptr(), x.stride(0), slots.data_ptr(), 37, 3, 64, data.data_ptr(), scale.data_ptr(),
                         False, True)


@pytest.mark.parametrize("isa", ["best", "no-vnni", "no-avx512"])
@pytest.mark.parametrize("hq,hkv,d,page_size,shapes", CASES)
def test_native_int8_matches_reference(hq, hkv, d, page_size, shapes, isa, monkeypatch):
    if isa == "no-avx512":
        monkeypatch.setenv("TOKENMILL_NO_AVX512", "1")
    elif isa == "no-vnni":   # int8 decode rows on the widening AVX-512 body
        monkeypatch.setenv("TOKENMILL_NO_INT8_VNNI", "1")
    spec, pool, tables, q, k, v = _int8_case(hq, hkv, d, page_size, shapes, hq * 100 + d)
    batch = chunks_batch(shapes, tables, page_size)
    cache = _clone(pool)
    out = _forward("native", spec, cache, batch, q, k, v)
    ref_cache = _clone(pool)
    ref = _forward("torch", spec, ref_cache, batch, q, k, v)
    assert torch.equal(cache.data, ref_cache.data) and torch.equal(cache.scale, ref_cache.scale)
    assert torch.isfinite(out).all()
    deq = cache.data.float() * cache.scale.unsqueeze(-1)
    kq, vq = (deq[i].view(-1, hkv, d)[batch.slot_mapping] for i in (0, 1))
    exact = _forward("torch", KVCacheSpec.dense(1, hkv, d), deq.clone(), batch, q, kq, vq)
    top = max(1.0, float(exact.abs().max()))
    vnni = isa == "best" and _vnni_rows(shapes, d)
    row = 0
    for cached, n in shapes:
        err = (out[row:row + n] - exact[row:row + n]).abs().max().item()
        if vnni and n <= 16 and (n == 1 or n * hq // hkv < 20):   # decode rows / few-row chunks: integer body
            # the rounded query and weights: measured at most 1.2e-4 of the largest output here
            assert err < 1e-3 * top, (cached, n, err)
        else:
            assert err < 2e-5 * top, (cached, n, err)
        if cached > 0 or n == 1:   # the reference reads the pool here too
            assert (out[row:row + n] - ref[row:row + n]).abs().max().item() < (1e-3 if vnni else 2e-5) * top
        row += n


def test_vnni_body_is_close_to_the_widening_body_on_long_contexts(monkeypatch):
    """Decode rows over 300-6000 keys, split-K included: the integer body against the widening
    one, relative to each output vector's norm (measured at most 1.3e-4)."""
    if not _vnni_rows([], 64):
        pytest.skip("no AVX-512 VNNI on this CPU")
    shapes = [(300, 1), (2047, 1), (6000, 1), (90, 3)]
    spec, pool, tables, q, k, v = _int8_case(9, 3, 64, 16, shapes, 11)
    batch = chunks_batch(shapes, tables, 16)
    fast = _forward("native", spec, _clone(pool), batch, q, k, v)
    monkeypatch.setenv("TOKENMILL_NO_INT8_VNNI", "1")
    wide = _forward("native", spec, _clone(pool), batch, q, k, v)
    rel = ((fast - wide).norm(dim=-1) / wide.norm(dim=-1)).max().item()
    assert rel < 1e-3, rel


def test_native_int8_result_does_not_depend_on_the_batch():
    """As for fp8 pages, with decode rows on the integer body (where the CPU has it)."""
    shapes = [(200, 1), (0, 50), (2500, 1), (30, 3)]
    spec, pool, tables, q, k, v = _int8_case(9, 3, 64, 16, shapes, 7)
    assert_batch_invariant(spec, pool, tables, shapes, q, k, v)
