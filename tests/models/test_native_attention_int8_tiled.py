"""Tiled int8 pages (``FP8Pages(tiled=True)``, kernel kind ``TM_KV_INT8T``).

* The layout holds the codes and scales of a rows-order int8 pool: the C write and the torch
  reference's ``write_fp8`` store the same bytes, and ``untile_pages`` gives back the rows-order
  pool's codes and scales (the fused decode's own write: ``test_fused_decode.py``).
* Attention over tiled pages matches the exact result over the dequantized pool on every path:
  prefill chunks and decode rows through the tiled prefill path (bit for bit what a rows-order
  pool gives there), decode rows through the tiled VNNI body where the CPU has it (a 16-bit
  query and 8-bit softmax weights with each block's largest weight exact: close, not equal).
* The backend picks the layout (``TOKENMILL_KV_INT8_LAYOUT``), results do not depend on the
  batch, and an engine serves the same greedy tokens on either layout.
"""
from __future__ import annotations

import pytest
import torch

from tokenmill._native import attention as kernel
from tokenmill.contracts.kv import KVCacheSpec
from tokenmill.layers.attention import FP8Pages, select_attention_backend
from tokenmill.layers.attention.fp8 import untile_pages, write_fp8
from tokenmill.layers.attention.native import int8_tiled_layout, kv_kind

from tests.models.paged_driver import chunks_batch
from tests.models.test_native_attention_fp8 import CASES, _clone, _forward, assert_batch_invariant
from tests.models.test_native_attention_int8 import _int8_case

pytestmark = pytest.mark.skipif(not kernel.available(), reason=str(kernel.unavailable_reason()))

# the layout needs page_size and head_dim divisible by 4
TILED_CASES = [c for c in CASES if c[2] % 4 == 0 and c[3] % 4 == 0]


def _tile(pool: FP8Pages) -> FP8Pages:
    """A rows-order int8 pool in the tiled order (the inverse of untile_pages)."""
    two, n, ps, hkv, d = pool.data.shape
    k = torch.bitwise_xor(pool.data[0], torch.tensor(-128, dtype=torch.int8))
    k = k.reshape(n, ps, hkv, d // 4, 4).permute(0, 2, 3, 1, 4).reshape(n, ps, hkv, d)
    v = pool.data[1].reshape(n, ps // 4, 4, hkv, d).permute(0, 3, 1, 4, 2).reshape(n, ps, hkv, d)
    sc = pool.scale.reshape(two, n, ps, hkv).transpose(2, 3).reshape(two, n, ps, hkv)
    return FP8Pages(torch.stack((k, v)).contiguous(), sc.contiguous(), True, tiled=True)


def _exact(pool: FP8Pages, shapes, tables, q, k, v, hkv, d, page_size):
    """Attention over the pool's dequantized values (fp32 pool, torch reference), once the step's
    K/V are in it."""
    batch = chunks_batch(shapes, tables, page_size)
    data, scale = untile_pages(pool.data, pool.scale, page_size) if pool.tiled else (pool.data, pool.scale)
    deq = data.float() * scale.unsqueeze(-1)
    kq, vq = (deq[i].view(-1, hkv, d)[batch.slot_mapping] for i in (0, 1))
    return _forward("torch", KVCacheSpec.dense(1, hkv, d), deq.clone(), batch, q, kq, vq)


@pytest.mark.parametrize("ps,hkv,d", [(16, 3, 64), (32, 2, 128), (4, 1, 8), (8, 4, 12)])
def test_tiled_writes_hold_the_rows_codes(ps, hkv, d):
    """C and torch writes store the same tiled bytes and scales; untiled, they are the rows write's."""
    gen = torch.Generator().manual_seed(ps * d)
    pages, t = 7, 23
    slots = torch.randperm(pages * ps, generator=gen)[:t]
    x = torch.randn(t, hkv, d, generator=gen) * torch.rand(t, hkv, 1, generator=gen) * 4
    x[0, 0] = 0.0   # an all-zero vector
    shape = (2, pages, ps, hkv, d)
    rows = FP8Pages(torch.zeros(shape, dtype=torch.int8), torch.zeros(shape[:-1]), True)
    by_torch, by_c = _tile(rows), _tile(rows)
    for i in (0, 1):
        xi = (x * (1 + i)).contiguous()
        write_fp8(rows.half(i), slots, xi)
        write_fp8(by_torch.half(i), slots, xi)
        kernel.fp8_write(xi.data_ptr(), hkv * d, slots.data_ptr(), t, hkv, d, by_c.data[i].data_ptr(),
                         by_c.scale[i].data_ptr(), True, True, ps, i == 0)
    assert torch.equal(by_c.data, by_torch.data) and torch.equal(by_c.scale, by_torch.scale)
    data, scale = untile_pages(by_c.data, by_c.scale, ps)
    for i in (0, 1):
        assert torch.equal(data[i].view(-1, hkv, d)[slots], rows.data[i].view(-1, hkv, d)[slots])
        assert torch.equal(scale[i].view(-1, hkv)[slots], rows.scale[i].view(-1, hkv)[slots])
    back = untile_pages(_tile(rows).data, _tile(rows).scale, ps)
    assert torch.equal(back[0], rows.data) and torch.equal(back[1], rows.scale)
    with pytest.raises(ValueError, match="divisible by 4"):
        kernel.fp8_write(x.data_ptr(), hkv * d, slots.data_ptr(), t, hkv, d, by_c.data[0].data_ptr(),
                         by_c.scale[0].data_ptr(), True, True, 6, True)


def _vnni_tiled(d: int, page_size: int) -> bool:
    return kernel.int8_tiled_decode() and d in (64, 128) and page_size % 16 == 0


@pytest.mark.parametrize("isa", ["best", "no-vnni", "no-avx512"])
@pytest.mark.parametrize("hq,hkv,d,page_size,shapes", TILED_CASES)
def test_native_tiled_int8_matches_exact_and_rows(hq, hkv, d, page_size, shapes, isa, monkeypatch):
    if isa == "no-avx512":
        monkeypatch.setenv("TOKENMILL_NO_AVX512", "1")
    elif isa == "no-vnni":   # decode rows through the tiled prefill path
        monkeypatch.setenv("TOKENMILL_NO_INT8_VNNI", "1")
    spec, rows, tables, q, k, v = _int8_case(hq, hkv, d, page_size, shapes, hq * 100 + d)
    pool = _tile(rows)
    assert kv_kind(pool) == 6 and kv_kind(rows) == 5
    batch = chunks_batch(shapes, tables, page_size)
    cache = _clone(pool)
    out = _forward("native", spec, cache, batch, q, k, v)
    ref_cache = _clone(pool)
    ref = _forward("torch", spec, ref_cache, batch, q, k, v)   # the reference reads tiled pages too
    assert torch.equal(cache.data, ref_cache.data) and torch.equal(cache.scale, ref_cache.scale)
    rows_out = _forward("native", spec, _clone(rows), batch, q, k, v)
    exact = _exact(cache, shapes, tables, q, k, v, hkv, d, page_size)
    assert torch.isfinite(out).all()
    top = max(1.0, float(exact.abs().max()))
    body = isa == "best" and _vnni_tiled(d, page_size)
    row = 0
    for cached, n in shapes:
        sl = slice(row, row + n)
        err = (out[sl] - exact[sl]).abs().max().item()
        if body and n <= 16 and (n == 1 or n * hq // hkv < 20):   # decode rows / few-row chunks: the VNNI body
            # 16-bit query, 8-bit weights (each block's largest exact): measured at most 3e-4 of the largest output
            assert err < 2e-3 * top, (cached, n, err)
        else:   # widened in the tiled prefill path: the rows pool's bits there
            assert err < 2e-5 * top, (cached, n, err)
            if not (isa == "best" and kernel.int8_tiled_decode() and n <= 16):
                assert (out[sl] - rows_out[sl]).abs().max().item() < 2e-5 * top
        if cached > 0 or n == 1:
            assert (out[sl] - ref[sl]).abs().max().item() < (2e-3 if body else 2e-5) * top
        row += n


def test_tiled_body_on_long_contexts_and_its_switches(monkeypatch):
    """Decode rows over 300-6000 keys (split-K, a first key inside a page) on the VNNI body against
    the widening path over the same pages, relative to each output vector's norm. Random keys give
    flat weights and outputs that nearly cancel, the hardest case for 8-bit weights: measured
    6.6e-3 (16-bit weights, TOKENMILL_I8T_W16: 8e-5; an 8-bit query, TOKENMILL_I8T_Q8: 1.0e-2)."""
    if not _vnni_tiled(64, 16):
        pytest.skip("no tiled int8 VNNI body on this CPU")
    shapes = [(300, 1), (2047, 1), (6000, 1), (4100, 1), (90, 3)]
    spec, rows, tables, q, k, v = _int8_case(9, 3, 64, 16, shapes, 11)
    pool = _tile(rows)
    batch = chunks_batch(shapes, tables, 16)
    runs = {}
    for name, env in [("default", {}), ("q8", {"TOKENMILL_I8T_Q8": "1"}), ("w16", {"TOKENMILL_I8T_W16": "1"}),
                      ("wide", {"TOKENMILL_NO_INT8_VNNI": "1"})]:
        for key, val in env.items():
            monkeypatch.setenv(key, val)
        runs[name] = _forward("native", spec, _clone(pool), batch, q, k, v)
        for key in env:
            monkeypatch.delenv(key)
    rel = {n: ((o - runs["wide"]).norm(dim=-1) / runs["wide"].norm(dim=-1)).max().item() for n, o in runs.items()}
    assert rel["default"] < 2e-2 and rel["w16"] < 1e-3 and rel["q8"] < 5e-2, rel


def test_tiled_int8_result_does_not_depend_on_the_batch():
    shapes = [(200, 1), (0, 50), (2500, 1), (30, 3)]
    spec, rows, tables, q, k, v = _int8_case(9, 3, 64, 16, shapes, 7)
    assert_batch_invariant(spec, _tile(rows), tables, shapes, q, k, v)


def test_the_backend_picks_the_layout(monkeypatch):
    spec = KVCacheSpec.dense(2, 3, 64, "int8")
    native = select_attention_backend(spec, "cpu", torch.float32, "native")
    monkeypatch.setenv("TOKENMILL_KV_INT8_LAYOUT", "tiled")
    assert all(c.tiled for c in native.allocate(4, 16)) and int8_tiled_layout(12, 4)
    assert not int8_tiled_layout(10, 16) and not int8_tiled_layout(64, 6)   # not divisible by 4: rows
    monkeypatch.setenv("TOKENMILL_KV_INT8_LAYOUT", "rows")
    assert not any(c.tiled for c in native.allocate(4, 16))
    monkeypatch.setenv("TOKENMILL_KV_INT8_LAYOUT", "auto")
    assert all(c.tiled == kernel.int8_tiled_decode() for c in native.allocate(4, 16))
    assert not any(c.tiled for c in native.allocate(4, 8))   # auto: pages of a multiple of 16 only
    monkeypatch.setenv("TOKENMILL_KV_INT8_LAYOUT", "diagonal")
    with pytest.raises(ValueError, match="TOKENMILL_KV_INT8_LAYOUT"):
        native.allocate(4, 16)
    # the torch reference keeps the rows order
    monkeypatch.setenv("TOKENMILL_KV_INT8_LAYOUT", "tiled")
    ref = select_attention_backend(spec, "cpu", torch.float32, "torch")
    assert not any(c.tiled for c in ref.allocate(4, 16))
