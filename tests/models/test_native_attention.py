"""The native paged-attention kernel against the torch reference backend on the same pool.

Covers the kernel's own paths: AVX-512 (head_dim % 16 == 0, where the CPU has it), AVX2
(head_dim % 8 == 0, or AVX-512 switched off) and scalar (other head_dim), query
chunks longer than one task's row block, GQA groups of 1 to 8, and long single decodes that are
split over keys (split-K) and merged.
"""
from __future__ import annotations

import random

import pytest
import torch

from tokenmill._native import attention as kernel
from tokenmill.contracts.kv import KVCacheSpec
from tokenmill.layers.attention import select_attention_backend

from tests.models.paged_driver import chunks_batch

pytestmark = pytest.mark.skipif(not kernel.available(), reason=str(kernel.unavailable_reason()))


def _run(backend_name, spec, pool, shapes, page_size, q, k, v, tables):
    backend = select_attention_backend(spec, "cpu", torch.float32, backend_name)
    batch = chunks_batch(shapes, tables, page_size)
    cache = pool.clone()
    out = backend.forward(q, k, v, cache, backend.build_metadata(batch), spec.layers[0].head_dim ** -0.5)
    return out, cache


@pytest.mark.parametrize("isa", ["best", "no-avx512"])
@pytest.mark.parametrize("kv_dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("hq,hkv,d,page_size,shapes", [
    (9, 3, 64, 16, [(0, 1), (40, 1), (100, 70), (0, 130), (17, 5)]),      # SmolLM2-like heads
    (4, 4, 8, 4, [(3, 1), (0, 9), (11, 300)]),                              # MHA, chunk > row block
    (8, 1, 16, 1, [(50, 1), (0, 2), (7, 7)]),                               # group of 8, page of 1
    (6, 2, 12, 5, [(0, 1), (23, 1), (9, 33)]),                              # scalar path (12 % 8)
    (2, 1, 64, 16, [(3000, 1)]),                                            # one long decode: split-K
    (6, 3, 32, 16, [(1500, 1), (2100, 1), (0, 1)]),                         # several, some split
    (10, 2, 128, 16, [(2500, 1), (5, 1), (30, 3)]),                         # group of 5, wide heads, split
    # chunks of a few rows after a long context (verify steps) are split over keys too: 2-3
    # rows on the per-row bodies, 5 on the AVX2 tiles, 16 on the widest; 17 rows are not split
    (9, 3, 64, 16, [(2500, 2), (2045, 3), (3000, 5), (4100, 16), (2100, 17), (2600, 1)]),
])
def test_native_matches_torch_reference(hq, hkv, d, page_size, shapes, kv_dtype, isa, monkeypatch):
    if isa == "no-avx512":   # the AVX2 path on a CPU that also has AVX-512
        monkeypatch.setenv("TOKENMILL_NO_AVX512", "1")
    spec, pool, tables, q, k, v = _random_case(hq, hkv, d, page_size, shapes, kv_dtype, hq * 100 + d)
    ref, ref_cache = _run("torch", spec, pool, shapes, page_size, q, k, v, tables)
    out, cache = _run("native", spec, pool, shapes, page_size, q, k, v, tables)
    assert torch.equal(cache, ref_cache)
    assert out.shape == ref.shape
    assert (out - ref).abs().max().item() < 2e-5


def _random_case(hq, hkv, d, page_size, shapes, kv_dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    spec = KVCacheSpec.dense(1, hkv, d, kv_dtype)
    num_pages = sum(-(-(c + n) // page_size) for c, n in shapes) + 2
    free = list(range(1, num_pages))
    rng.shuffle(free)
    tables = [[free.pop() for _ in range(-(-(c + n) // page_size))] for c, n in shapes]
    pool = torch.randn(2, num_pages, page_size, hkv, d, generator=gen).to(getattr(torch, kv_dtype))
    t = sum(n for _, n in shapes)
    # q as a strided view, the way the model hands it over (a slice of the fused q/k tensor)
    q = torch.randn(t, hq + hkv, d, generator=gen)[:, :hq]
    k, v = torch.randn(t, hkv, d, generator=gen), torch.randn(t, hkv, d, generator=gen)
    if kv_dtype != "float32":
        # the reference attends a fresh chunk with its own unrounded K/V, the kernel reads every
        # key back from the bf16 / fp16 pool: give both values that the pool holds exactly
        k, v = k.to(getattr(torch, kv_dtype)).float(), v.to(getattr(torch, kv_dtype)).float()
    return spec, pool, tables, q, k, v


@pytest.mark.parametrize("isa", ["best", "no-avx512"])
@pytest.mark.parametrize("kv_dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("hq,hkv,d,page_size,shapes", [
    # SmolLM2 heads (group 3): odd chunks, chunks starting mid-page after cached context, a
    # chunk after 1k cached tokens whose rows span two tasks, decodes beside them
    (9, 3, 64, 16, [(0, 33), (37, 45), (1029, 77), (5, 1), (260, 1), (100, 2)]),
    (4, 4, 32, 16, [(0, 130), (19, 3), (64, 65)]),             # MHA: one row per group lane
    (8, 4, 64, 32, [(40, 31), (0, 7)]),                        # group 2
    (16, 2, 128, 16, [(300, 41), (1, 2)]),                     # group 8, head_dim 128
    (14, 2, 64, 8, [(12, 19)]),                                # group 7: lanes mix rows
    (5, 1, 16, 3, [(7, 11), (0, 2)]),                          # page of 3, group 5
    (6, 2, 12, 5, [(9, 33), (2, 6)]),                          # head_dim 12: AVX2 tile only
    (3, 1, 10, 4, [(21, 17), (0, 5)]),                         # head_dim 10: portable tile
])
def test_tiled_prefill_matches_torch_reference(hq, hkv, d, page_size, shapes, kv_dtype, isa, monkeypatch):
    """Prefill chunks take the tiled path (query groups x key blocks); the remainders of both,
    the diagonal blocks and every GQA layout come out as the reference's."""
    if isa == "no-avx512":
        monkeypatch.setenv("TOKENMILL_NO_AVX512", "1")
    spec, pool, tables, q, k, v = _random_case(hq, hkv, d, page_size, shapes, kv_dtype, hq * 31 + d)
    ref, ref_cache = _run("torch", spec, pool, shapes, page_size, q, k, v, tables)
    out, cache = _run("native", spec, pool, shapes, page_size, q, k, v, tables)
    assert torch.equal(cache, ref_cache)
    assert (out - ref).abs().max().item() < 2e-5
    # the per-row path, kept for A/B checks, agrees as well
    monkeypatch.setenv("TOKENMILL_NO_PREFILL_TILES", "1")
    rows, _ = _run("native", spec, pool, shapes, page_size, q, k, v, tables)
    assert (rows - ref).abs().max().item() < 2e-5


@pytest.mark.parametrize("isa", ["best", "no-avx512"])
def test_chunks_of_a_few_rows_skip_the_tiles(isa, monkeypatch):
    """Chunks are cut by how many query vectors they hold (head groups of 3 here): 2 and 3 rows
    (6 and 9 vectors, under 5/8 of an AVX2 tile group) take the decode bodies, bit for bit what
    TOKENMILL_NO_PREFILL_TILES=1 gives; 4 rows (12) take the AVX2 tiles (one group of 16) on any
    x86 CPU, AVX-512 ones included, bit for bit what TOKENMILL_NO_AVX512=1 gives; 40 rows take the
    CPU's widest tiles, where TOKENMILL_TILES_FOR_FEW_ROWS=1 also puts the few rows. The paths
    sum in different orders (so their bits differ) and all match the reference
    (test_tiled_prefill_matches_torch_reference)."""
    if isa == "no-avx512":
        monkeypatch.setenv("TOKENMILL_NO_AVX512", "1")
    shapes = [(300, 2), (0, 3), (57, 4), (90, 40), (12, 1)]
    spec, pool, tables, q, k, v = _random_case(9, 3, 64, 16, shapes, "float16", 21)

    def run(**env):
        with monkeypatch.context() as m:
            for name in env:
                m.setenv(name, "1")
            return _run("native", spec, pool, shapes, 16, q, k, v, tables)[0]

    out = run()
    rows = run(TOKENMILL_NO_PREFILL_TILES=1)
    narrow = run(TOKENMILL_NO_AVX512=1)
    widest = run(TOKENMILL_TILES_FOR_FEW_ROWS=1)
    few, four, many = slice(0, 5), slice(5, 9), slice(9, 49)
    assert torch.equal(out[few], rows[few]) and not torch.equal(out[few], widest[few])
    assert torch.equal(out[four], narrow[four]) and not torch.equal(out[four], rows[four])
    assert torch.equal(out[many], widest[many]) and not torch.equal(out[many], rows[many])
    for other in (rows, narrow, widest):
        assert (out - other).abs().max().item() < 2e-5


@pytest.mark.parametrize("isa", ["best", "no-avx512"])
def test_few_rows_take_the_decode_bodies_and_split_after_a_long_context(isa, monkeypatch):
    """Verify-step-shaped chunks (2 and 3 rows) run the decode bodies with every row's query
    vectors, each masked to its own keys, and after 2,048 keys they are split over keys like a
    decode row. Each switch off (TOKENMILL_NO_FEW_ROW_DECODE=1: the per-row bodies;
    TOKENMILL_NO_FEW_ROW_SPLIT=1: one task per kv head) changes the order of summation, so the
    bits, and every variant matches the torch reference."""
    if isa == "no-avx512":
        monkeypatch.setenv("TOKENMILL_NO_AVX512", "1")
    shapes = [(2500, 2), (3000, 3), (40, 2), (57, 3)]
    spec, pool, tables, q, k, v = _random_case(9, 3, 64, 16, shapes, "float16", 33)
    ref, _ = _run("torch", spec, pool, shapes, 16, q, k, v, tables)

    def run(**env):
        with monkeypatch.context() as m:
            for name in env:
                m.setenv(name, "1")
            return _run("native", spec, pool, shapes, 16, q, k, v, tables)[0]

    out, per_row, unsplit = run(), run(TOKENMILL_NO_FEW_ROW_DECODE=1), run(TOKENMILL_NO_FEW_ROW_SPLIT=1)
    long, short = slice(0, 5), slice(5, 10)
    for got in (out, per_row, unsplit):
        assert (got - ref).abs().max().item() < 2e-5
    assert not torch.equal(out[long], per_row[long]) and not torch.equal(out[short], per_row[short])
    assert not torch.equal(out[long], unsplit[long])
    assert torch.equal(out[short], unsplit[short])   # short contexts are never split

def test_tiled_prefill_after_long_cached_context():
    """A 256-token chunk after 4k cached tokens in mixed company: a fresh prompt, a decode."""
    shapes = [(4096 + 7, 256), (0, 97), (3000, 1)]
    spec, pool, tables, q, k, v = _random_case(9, 3, 64, 16, shapes, "float32", 5)
    ref, _ = _run("torch", spec, pool, shapes, 16, q, k, v, tables)
    out, _ = _run("native", spec, pool, shapes, 16, q, k, v, tables)
    assert (out - ref).abs().max().item() < 2e-5


def test_tiled_prefill_with_large_scores():
    """Scores of a few hundred (far beyond exp's range) keep the running max exact."""
    shapes = [(50, 40), (0, 9)]
    spec, pool, tables, q, k, v = _random_case(4, 2, 32, 16, shapes, "float32", 11)
    q = q * 50
    ref, _ = _run("torch", spec, pool, shapes, 16, q, k, v, tables)
    out, _ = _run("native", spec, pool, shapes, 16, q, k, v, tables)
    assert torch.isfinite(out).all()
    assert (out - ref).abs().max().item() < 1e-4


def test_native_result_does_not_depend_on_the_batch():
    """A sequence's rows come out bit-identical alone and beside other sequences."""
    gen = torch.Generator().manual_seed(7)
    spec = KVCacheSpec.dense(1, 3, 64)
    ps = 16
    shapes = [(200, 1), (0, 50), (2500, 1), (30, 20)]
    tables, nxt = [], 1
    for c, n in shapes:
        k = -(-(c + n) // ps)
        tables.append(list(range(nxt, nxt + k)))
        nxt += k
    pool = torch.randn(2, nxt, ps, 3, 64, generator=gen)
    t = sum(n for _, n in shapes)
    q, k, v = (torch.randn(t, h, 64, generator=gen) for h in (9, 3, 3))
    together, _ = _run("native", spec, pool, shapes, ps, q, k, v, tables)
    row = 0
    for i, (c, n) in enumerate(shapes):
        alone, _ = _run("native", spec, pool, [(c, n)], ps, q[row:row + n], k[row:row + n], v[row:row + n], [tables[i]])
        assert torch.equal(alone, together[row:row + n])
        row += n


def test_auto_falls_back_for_what_the_kernel_does_not_do():
    spec = KVCacheSpec.dense(2, 2, 16, "float16")
    assert select_attention_backend(spec, "cpu", torch.float16, "auto").name == "torch"   # fp16 activations
    with pytest.raises(ValueError, match="float32"):
        select_attention_backend(spec, "cpu", torch.float16, "native")
    assert select_attention_backend(spec, "cpu", torch.float32, "auto").name == "native"
    bf16 = KVCacheSpec.dense(2, 2, 16, "bfloat16")
    assert select_attention_backend(bf16, "cpu", torch.bfloat16, "auto").name == "torch"   # bf16 activations
    assert select_attention_backend(bf16, "cpu", torch.float32, "auto").name == "native"
    assert select_attention_backend(KVCacheSpec.dense(2, 2, 16), "cpu", torch.float32).name == "native"


def test_tiled_prefill_does_not_depend_on_threads_or_company():
    """Prefill rows come out bit-identical whatever the thread count (which changes how the rows
    are cut into tasks) and whatever else is in the batch."""
    shapes = [(700, 300), (3, 130), (0, 1), (1500, 1), (64, 9)]
    spec, pool, tables, q, k, v = _random_case(9, 3, 64, 16, shapes, "float32", 3)
    threads = torch.get_num_threads()
    try:
        results = []
        for n in (1, 2, 3, 8):
            torch.set_num_threads(n)
            results.append(_run("native", spec, pool, shapes, 16, q, k, v, tables)[0])
    finally:
        torch.set_num_threads(threads)
    for r in results[1:]:
        assert torch.equal(r, results[0])
    row = 0
    for i, (c, n) in enumerate(shapes):
        alone, _ = _run("native", spec, pool, [(c, n)], 16, q[row:row + n], k[row:row + n], v[row:row + n], [tables[i]])
        assert torch.equal(alone, results[0][row:row + n])
        row += n


@pytest.mark.parametrize("kv_dtype", ["float16", "float32"])
def test_decodes_do_not_depend_on_threads_or_on_the_head_jobs(kv_dtype, monkeypatch):
    """A long decode (or a verify step's few rows) is split over keys, and a chunk's kv heads run
    as one job on one thread where the chunks share out evenly over the threads (3 chunks on 2
    threads stay one task per head); so do a short decode row's heads where there are at least
    two such rows per thread (here: 2 threads). Neither the thread count nor the grouping
    (TOKENMILL_KV_HEADS_APART=1: every task claimed alone) may change a bit, and the result
    matches the torch reference."""
    # 3, 8 and 4 chunks of keys; four short decode rows and a prefill chunk
    shapes = [(3100, 1), (8200, 1), (4100, 3), (300, 1), (1500, 1), (40, 1), (900, 1), (20, 30)]
    spec, pool, tables, q, k, v = _random_case(9, 3, 64, 16, shapes, kv_dtype, 21)
    ref, _ = _run("torch", spec, pool, shapes, 16, q, k, v, tables)
    threads = torch.get_num_threads()
    results = []
    try:
        for apart in (False, True):
            if apart:
                monkeypatch.setenv("TOKENMILL_KV_HEADS_APART", "1")
            else:
                monkeypatch.delenv("TOKENMILL_KV_HEADS_APART", raising=False)
            for n in (1, 2, 3, 4):
                torch.set_num_threads(n)
                results.append(_run("native", spec, pool, shapes, 16, q, k, v, tables)[0])
    finally:
        torch.set_num_threads(threads)
    assert (results[0] - ref).abs().max().item() < 2e-5
    for r in results[1:]:
        assert torch.equal(r, results[0])
