"""The native int8 / int4 kernels against plain dequantize-then-matmul references.

Error bounds (documented in docs/quantization.md):
- dequantization is exact up to one float rounding (fma vs. multiply-then-add): |err| <= 2^-22 |w|max;
- the int16-activation kernel (<= gemv_max_rows() rows) equals dequant(W) @ dequant(q16(x))^T up to float
  summation order: |err| <= 1e-5 * sum_k |w_nk * xhat_mk| + 1e-6;
- the many-rows path (packed.prefill_gemm()) is either the tiled integer GEMM, which equals
  dequant(W) @ dequant(q16(x))^T within the same bound, or dequantize + fp32 GEMM, which keeps fp32
  activations and equals x @ dequant(W)^T within it.
"""
from __future__ import annotations

import os
import subprocess
import sys
from typing import Iterator

import pytest
import torch

from tokenmill._native import quant as native
from tokenmill.layers.quant import packed
from tokenmill.layers.quant.packed import Int4Linear, Int8Linear, gemv_max_rows, pack_nibbles, unpack_nibbles

pytestmark = pytest.mark.skipif(not native.available(), reason=str(native.unavailable_reason()))

ORDER = ["scalar", "avx2", "avxvnni", "avx512vnni", "amx"]
KERNELS = native.supported_kernels()   # every set this CPU runs (each is tested against the reference)
# (N, K, group): odd row counts, K not a multiple of 32, and groups whose last one is short
SHAPES = [(1, 32, 32), (7, 100, 32), (33, 576, 64), (5, 45, 32), (9, 96, 64), (64, 1536, 128), (3, 200, 128),
          (17, 300, 96), (6, 544, 32), (2, 1000, 32), (4, 600, 608)]


@pytest.fixture(autouse=True, scope="module")
def _one_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(params=KERNELS)
def kernel(request) -> Iterator[str]:
    before = native.kernel()
    native.set_kernel(request.param)
    yield request.param
    native.set_kernel(before)


def q16_reference(x: torch.Tensor) -> torch.Tensor:
    """The activation quantizer written out in torch: blocks of 32, scale amax/32639, round half to even."""
    m, k = x.shape
    kp = (k + 31) // 32 * 32
    blocks = torch.nn.functional.pad(x, (0, kp - k)).view(m, -1, 32)
    d = blocks.abs().amax(-1, keepdim=True) / 32639
    q = torch.round(blocks * torch.where(d > 0, 1 / d, torch.zeros_like(d)))
    return (q * d).view(m, kp)[:, :k]


def _prefill_x(x: torch.Tensor) -> torch.Tensor:
    """The activations a matmul of more than gemv_max_rows() rows computes with."""
    return q16_reference(x) if packed.prefill_gemm() == "int16" else x


@pytest.fixture(params=["int16", "fp32"])
def prefill(request) -> Iterator[str]:
    packed.set_prefill_gemm(request.param)
    yield request.param
    packed.set_prefill_gemm(None)


def _methods(w: torch.Tensor, group: int):
    return {"int4-asym": Int4Linear.from_float(w, group), "int4-sym": Int4Linear.from_float(w, group, symmetric=True),
            "int8-channel": Int8Linear.from_float(w), "int8-group": Int8Linear.from_float(w, group),
            "int4-fp16": _fp16_scales(Int4Linear.from_float(w, group))}


def _fp16_scales(m: Int4Linear) -> Int4Linear:
    return Int4Linear(m.qs, m.scales.half(), m.mins.half(), m.in_features, m.group_size)


def _check(y: torch.Tensor, x_used: torch.Tensor, wd: torch.Tensor, bias: torch.Tensor | None = None) -> None:
    ref = x_used.double() @ wd.double().T
    if bias is not None:
        ref = ref + bias.double()
    bound = 1e-5 * (x_used.double().abs() @ wd.double().abs().T) + 1e-6
    err = (y.double() - ref).abs()
    assert (err <= bound).all(), f"max err {err.max().item():.3g}, bound there {bound.flatten()[err.argmax()]:.3g}"


@pytest.mark.parametrize("n,k,group", SHAPES)
def test_kernels_match_dequantize_then_matmul(kernel, prefill, n, k, group):
    gen = torch.Generator().manual_seed(n * 1000 + k)
    w = torch.randn(n, k, generator=gen) * 0.1
    limit = gemv_max_rows()  # the kernel set's own crossover
    for name, method in _methods(w, group).items():
        wd = method.dequantize()
        torch.testing.assert_close(wd, method._dequantize_torch(), rtol=2 ** -22, atol=2 ** -22 * w.abs().max().item())
        for m in sorted({r for r in (1, 2, 3, 5, limit) if r <= limit}):  # the int16-activation kernel
            x = torch.randn(m, k, generator=gen) * 3
            _check(method(x), q16_reference(x), wd)
        for m in (limit + 1, limit + 24):  # the prefill GEMM (int16 tiles or dequantize + fp32)
            x = torch.randn(m, k, generator=gen)
            _check(method(x), _prefill_x(x), wd)
        bias = torch.randn(n, generator=gen)
        x = torch.randn(3, k, generator=gen)
        _check(method(x, bias), q16_reference(x), wd, bias)
        x = torch.randn(limit + 3, k, generator=gen)
        _check(method(x, bias), _prefill_x(x), wd, bias)


def test_zero_rows_compute_nothing(kernel):
    """A matmul of no rows (the head of a prefill chunk that samples nothing) returns an empty
    result on every kernel set, through the linear methods and through the native entry points
    with null pointers (the one-row kernels must not read or write a row 0 that is not there)."""
    w = torch.randn(40, 576) * 0.1
    for name, method in _methods(w, 32).items():
        y = method(torch.empty(0, 576))
        assert y.shape == (0, 40), name
        assert method(torch.empty(2, 0, 576)).shape == (2, 0, 40), name
    q4, q8 = Int4Linear.from_float(w, 32), Int8Linear.from_float(w, 32)
    native.gemm_u4(0, 0, 576, q4.qs.data_ptr(), q4.scales.data_ptr(), q4.mins.data_ptr(), 0, 40, 32, 0, 0, 1)
    native.gemm_s8(0, 0, 576, q8.qs.data_ptr(), q8.scales.data_ptr(), 0, 40, 32, 0, 0, 1)


def test_activation_quantizer_matches_reference(kernel):
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(5, 77, generator=gen) * 10
    x[1] = 0  # an all-zero row: scale 0, no division by zero
    x[2, :32] = torch.arange(32) - 15.5  # exact halves after scaling exercise round-half-even
    xq, xd, xs = native.quantize_act(x)
    deq = (xq.float().view(5, -1, 32) * xd.unsqueeze(-1)).view(5, -1)[:, :77]
    assert torch.equal(deq, q16_reference(x))
    assert (xq[:, 77:] == 0).all()
    torch.testing.assert_close(xs, xd * xq.float().view(5, -1, 32).sum(-1))


def test_kernel_sets_agree_with_each_other():
    gen = torch.Generator().manual_seed(11)
    w, x = torch.randn(29, 160, generator=gen), torch.randn(4, 160, generator=gen)
    method = Int4Linear.from_float(w, 64)
    before, outs = native.kernel(), []
    try:
        for k in KERNELS:
            native.set_kernel(k)
            outs.append(method(x))
    finally:
        native.set_kernel(before)
    for o in outs[1:]:
        torch.testing.assert_close(o, outs[0], rtol=1e-5, atol=1e-5)


def _cpuinfo() -> tuple[list[str], str, int | None]:
    """(flags, vendor, family) of the first CPU in /proc/cpuinfo; ([], "", None) without it."""
    if not os.path.exists("/proc/cpuinfo"):
        return [], "", None
    text = open("/proc/cpuinfo").read()
    fields = dict(line.split(":", 1) for line in text.split("\n\n")[0].splitlines() if ":" in line)
    fields = {k.strip(): v.strip() for k, v in fields.items()}
    family = fields.get("cpu family")
    return fields.get("flags", "").split(), fields.get("vendor_id", ""), int(family) if family else None


def test_kernel_is_chosen_from_the_cpu():
    assert native.best_kernel() in ORDER
    flags, vendor, family = _cpuinfo()
    if flags and "avx2" not in flags:
        assert native.best_kernel() == "scalar"
    with pytest.raises(ValueError, match="unknown kernel set"):
        native.set_kernel("sse9")
    assert KERNELS[0] == "scalar" and KERNELS[-1] == native.best_kernel() and set(KERNELS) <= set(ORDER)
    if flags:  # each set is offered exactly when the CPU reports its instructions
        assert ("avx2" in KERNELS) == ("avx2" in flags and "fma" in flags and "f16c" in flags)
        assert ("avxvnni" in KERNELS) <= ("avx_vnni" in flags)
        assert ("avx512vnni" in KERNELS) <= all(f in flags for f in ("avx512f", "avx512bw", "avx512vl", "avx512_vnni"))
        assert ("amx" in KERNELS) <= ("avx512vnni" in KERNELS and "amx_tile" in flags and "amx_int8" in flags)
    # the set in use at start-up: the widest, but the best 256-bit one on Zen 4 (AMD family 19h
    # with AVX-512), whose 512-bit units are double-pumped
    if os.environ.get(native.KERNELS_ENV, "").strip():
        pytest.skip(f"{native.KERNELS_ENV} picks the kernel set of this run")
    assert native.kernel() == native.default_kernel()
    if vendor == "AuthenticAMD" and family == 0x19 and native.best_kernel() == "avx512vnni":
        assert native.default_kernel() == ("avxvnni" if "avxvnni" in KERNELS else "avx2")
    elif vendor:
        assert native.default_kernel() == native.best_kernel()
    # ... and there an AVX-512 GEMM is no wider than an AVX2 one, so the row limit is an AVX2 machine's
    if vendor:
        half = vendor == "AuthenticAMD" and family == 0x19 and "avx512f" in flags
        assert native.avx512_half_width() == half
        if half:
            assert not packed._wide_gemm()
            packed.set_prefill_gemm("fp32")
            try:
                assert gemv_max_rows() == packed.GEMV_MAX_ROWS_BY_KERNEL[native.kernel()]
            finally:
                packed.set_prefill_gemm(None)


def _check_env_setting(var: str, code: str, good: str, bad: str, message: str) -> None:
    """A fresh interpreter with ``var=good`` prints ``good`` from ``code``; with ``var=bad`` it
    fails at import with ``message`` (which names the variable) on stderr."""
    env = {**os.environ, var: good}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == good, out.stderr
    env[var] = bad
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode != 0 and message in out.stderr, out.stderr


def test_kernel_set_from_the_environment():
    """TOKENMILL_QUANT_KERNELS picks a supported set when the module loads; an unknown or
    unsupported one fails at once with a message that names the variable."""
    _check_env_setting(native.KERNELS_ENV, "from tokenmill._native import quant as q; print(q.kernel())",
                       "scalar", "sse9", f"{native.KERNELS_ENV}=sse9: unknown kernel set sse9")


def test_quantizers_stay_within_half_a_step():
    gen = torch.Generator().manual_seed(5)
    w = torch.randn(13, 200, generator=gen)
    w[0, :64] = 0  # a constant group: scale 0
    for group in (32, 64, 128):
        m = Int4Linear.from_float(w, group)
        step = m._expand(m.scales)
        assert ((m.dequantize() - w).abs() <= step / 2 + 1e-6 * (1 + w.abs())).all()
        s = Int4Linear.from_float(w, group, symmetric=True)
        sstep = s._expand(s.scales).abs()
        # Q4_0 rule: the peak maps to -8 exactly, the other end clamps at +7: within one step
        assert ((s.dequantize() - w).abs() <= sstep + 1e-6 * (1 + w.abs())).all()
        assert (s.dequantize()[w == 0] == 0).all()  # zero is exact in the symmetric form
    c = Int8Linear.from_float(w)
    assert c.scales.shape == (13, 1)
    assert ((c.dequantize() - w).abs() <= c._expand(c.scales) / 2 + 1e-6 * (1 + w.abs())).all()


def test_nibble_packing_round_trips_and_rows_select_and_concatenate():
    gen = torch.Generator().manual_seed(9)
    q = torch.randint(0, 16, (6, 96), generator=gen, dtype=torch.uint8)
    assert torch.equal(unpack_nibbles(pack_nibbles(q)), q)
    w = torch.randn(10, 96, generator=gen)
    for m in (Int4Linear.from_float(w, 32), Int8Linear.from_float(w, 64)):
        idx = torch.tensor([3, 0, 9])
        assert torch.equal(m.select_rows(idx).dequantize(), m.dequantize()[idx])
        both = type(m).cat_rows([m, m.select_rows(idx)])
        assert torch.equal(both.dequantize(), torch.cat([m.dequantize(), m.dequantize()[idx]]))
        ids = torch.tensor([[1, 2], [9, 9]])
        assert torch.equal(m.embedding(ids), m.dequantize()[ids])
    w = torch.randn(7, 70, generator=gen)   # a row length off the block size, fp16 scales
    i4 = Int4Linear.from_float(w, 64)
    for m in (Int4Linear(i4.qs, i4.scales.half(), i4.mins.half(), 70, 64), Int8Linear.from_float(w)):
        ids = torch.tensor([6, 0, 6, 3])
        assert torch.equal(m.embedding(ids), m.dequantize()[ids])
        # a decode step's few ids are read in place (packed.EMBED_IN_PLACE), more are gathered
        for ids in (torch.tensor([5]), torch.tensor([[2], [6]]), torch.tensor([1, 2, 3, 4, 5, 6, 0])):
            assert torch.equal(m.embedding(ids), m.dequantize()[ids])
        assert m.embedding(torch.tensor([2]), torch.bfloat16).dtype == torch.bfloat16
        for bad in (torch.tensor([7]), torch.tensor([-1]), torch.tensor([0, 1, 2, 3, 4, 5, 99])):
            with pytest.raises(IndexError):
                m.embedding(bad)


def test_bad_layouts_are_refused():
    w = torch.randn(4, 64)
    with pytest.raises(ValueError, match="multiple of 32"):
        Int4Linear.from_float(w, 48)
    m = Int4Linear.from_float(w, 32)
    with pytest.raises(ValueError, match="qs must be uint8"):
        Int4Linear(m.qs[:, :-1], m.scales, m.mins, 64, 32)
    with pytest.raises(ValueError, match="scales must be"):
        Int8Linear(torch.zeros(4, 64, dtype=torch.int8), torch.zeros(4, 3), 64, 32)


def test_prefill_gemm_reuses_one_scratch_buffer_without_stale_weights():
    """The prefill path dequantizes every matrix into the same scratch buffer before the fp32 GEMM
    (oneDNN's when available): each call must see its own weights."""
    packed.set_prefill_gemm("fp32")
    try:
        _scratch_reuse()
    finally:
        packed.set_prefill_gemm(None)


def _scratch_reuse() -> None:
    gen = torch.Generator().manual_seed(21)
    x = torch.randn(gemv_max_rows() + 9, 96, generator=gen)
    mats = [Int4Linear.from_float(torch.randn(40, 96, generator=gen), 32) for _ in range(3)]
    for _ in range(2):
        for m in mats:
            torch.testing.assert_close(m(x), x @ m.dequantize().t(), rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(packed.fp32_gemm(x, mats[0].dequantize()), x @ mats[0].dequantize().t(),
                               rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("n,k,group", [(7, 100, 32), (33, 576, 64), (6, 544, 32), (2, 1000, 32), (64, 1536, 128),
                                       (9, 96, 64), (5, 45, 32)])
def test_a_row_gives_the_same_result_alone_or_with_others(kernel, n, k, group):
    """Up to gemv_max_rows() rows (a decode with speculative drafts, a small batch), every row's
    result equals that row computed alone up to float summation order: the one-row kernel
    reduces eight blocks at a time, the multi-row kernels share each decoded weight block
    between up to four rows (avx2, avxvnni) or six (avx512vnni, whose Q4 kernel reads two
    blocks per load against pair-order activations) and sum block by block (docs/quantization.md).
    Row counts 5, 9 and 16 exercise uneven tiles (5 = one tile of 5 on avx512vnni, 9 = 5 + 4)."""
    gen = torch.Generator().manual_seed(n + k)
    w = torch.randn(n, k, generator=gen) * 0.1
    for name, method in _methods(w, group).items():
        for m in sorted({r for r in (2, 3, 4, 5, 8, 9, gemv_max_rows()) if r <= gemv_max_rows()}):
            x = torch.randn(m, k, generator=gen) * 2
            together = method(x)
            alone = torch.cat([method(x[i:i + 1]) for i in range(m)])
            torch.testing.assert_close(together, alone, rtol=1e-5, atol=1e-4, msg=lambda e: f"{name} rows={m}: {e}")


def test_row_limit_follows_the_kernel_set_in_use(prefill):
    """One place decides the integer kernels' row limit: the crossover measured for the kernel set
    in use (chosen from the CPU at start-up, or by set_kernel) against the prefill GEMM in use
    (the tiled int16 GEMM, or dequantize + fp32 GEMM), unless overridden."""
    before = native.kernel()
    try:
        for k in KERNELS:
            native.set_kernel(k)
            if prefill == "int16":
                want = packed.GEMV_MAX_ROWS_BY_KERNEL[k]
            else:
                want = packed.GEMV_MAX_ROWS_BY_KERNEL[k]
                if k in ("avx2", "avxvnni") and packed._wide_gemm():  # an AVX-512 GEMM wins from fewer rows
                    want = packed.GEMV_MAX_ROWS_WIDE_GEMM
            assert gemv_max_rows() == want >= 1
    finally:
        native.set_kernel(before)
    assert set(packed.GEMV_MAX_ROWS_BY_KERNEL) == set(ORDER)


def test_row_limit_override_moves_the_split(monkeypatch):
    gen = torch.Generator().manual_seed(5)
    method = Int4Linear.from_float(torch.randn(24, 64, generator=gen), 32)
    x = torch.randn(4, 64, generator=gen) * 3
    wd = method.dequantize()
    try:
        packed.set_gemv_max_rows(3)
        assert gemv_max_rows() == 3
        assert packed.gemv_row_group() == 1   # no step of more than one group reaches the integer kernels
        _check(method(x[:3]), q16_reference(x[:3]), wd)   # 3 rows: still the integer kernel
        _check(method(x), _prefill_x(x), wd)              # 4 rows: the prefill GEMM
        packed.set_gemv_max_rows(0)
        _check(method(x[:1]), _prefill_x(x[:1]), wd)      # 0: every matmul takes the prefill GEMM
        for bad in (-1, 2.5, "8"):
            with pytest.raises(ValueError, match="non-negative integer"):
                packed.set_gemv_max_rows(bad)  # type: ignore[arg-type]
    finally:
        packed.set_gemv_max_rows(None)
    assert gemv_max_rows() >= 1
    assert packed.gemv_row_group() == packed.GEMV_ROW_GROUP_BY_KERNEL.get(native.kernel(), 1)
    monkeypatch.setenv(packed.GEMV_ROWS_ENV, " 24 ")
    assert packed._rows_from_env() == 24
    monkeypatch.setenv(packed.GEMV_ROWS_ENV, "")
    assert packed._rows_from_env() is None
    for bad in ("-2", "many", "1.5"):
        monkeypatch.setenv(packed.GEMV_ROWS_ENV, bad)
        with pytest.raises(ValueError, match=packed.GEMV_ROWS_ENV):
            packed._rows_from_env()


@pytest.mark.parametrize("n,k", [(37, 576), (29, 544), (11, 96), (13, 45), (40, 1024)])
def test_one_row_q4_block_stream_is_exact_for_any_thread_split(kernel, n, k, monkeypatch):
    """One x row against a Q4 (or Q8) matrix with a scale per block (GGUF Q4_0 / Q4_1 / Q8_0) runs,
    on AVX2 and AVX-VNNI, as one stream of blocks across row ends (block_stream256_avx2 with
    u4_stream_group or s8_stream_group: 576 = 18 blocks a row,
    4 rows a group of 8-block loads; 544 = 17 blocks, 8 rows). Each row's bits must not depend on
    how many threads split the rows (a group is cut where a thread's rows end), a bias
    must land on its own row, and the result must equal the one-row kernel without the stream
    (TOKENMILL_NO_BLOCK_STREAM=1) up to float summation order."""
    gen = torch.Generator().manual_seed(n * 7 + k)
    w = torch.randn(n, k, generator=gen) * 0.1
    q8 = Int8Linear.from_float(w, 32)
    q8_f16 = Int8Linear(q8.qs, q8.scales.half(), k, 32)   # GGUF Q8_0 keeps fp16 scales
    for method in (Int4Linear.from_float(w, 32), _fp16_scales(Int4Linear.from_float(w, 32)), q8, q8_f16):
        wd = method.dequantize()
        x = torch.randn(1, k, generator=gen) * 3
        bias = torch.randn(n, generator=gen)
        runs = {}
        for threads in (1, 2, 3, 5):
            y = torch.empty(1, n)
            method._gemm(x, y, bias.data_ptr(), threads)
            runs[threads] = y
        for threads, y in runs.items():
            assert torch.equal(y, runs[1]), f"{threads} threads changed the bits"
        _check(runs[1], q16_reference(x), wd, bias)
        monkeypatch.setenv("TOKENMILL_NO_BLOCK_STREAM", "1")
        y = torch.empty(1, n)
        method._gemm(x, y, bias.data_ptr(), 1)
        monkeypatch.delenv("TOKENMILL_NO_BLOCK_STREAM")
        _check(y, q16_reference(x), wd, bias)
        torch.testing.assert_close(y, runs[1], rtol=1e-5, atol=1e-5)


def _rows_have_their_bits_alone(method, row_counts, gen):
    """For each count m: m random x rows through `method` on 2 threads match the q16 reference,
    and each row's output has the bits of that row run alone."""
    n, k = method.out_features, method.in_features
    wd = method.dequantize()
    for m in row_counts:
        x = torch.randn(m, k, generator=gen) * 3
        together = torch.empty(m, n)
        method._gemm(x, together, 0, 2)
        _check(together, q16_reference(x), wd)
        for i in range(m):
            alone = torch.empty(1, n)
            method._gemm(x[i:i + 1].contiguous(), alone, 0, 1)
            assert torch.equal(together[i], alone[0]), f"rows={m}, row {i}"


@pytest.mark.parametrize("n,k,group", [(37, 576, 32), (29, 544, 32), (13, 45, 32), (40, 1024, 32), (21, 576, 64)])
def test_a_q4_row_has_the_same_bits_alone_or_with_others_on_avx2(n, k, group):
    """On the avx2 set, 2 to 64 x rows against a Q4 matrix run the one-row kernel's arithmetic per
    row (u4_quad256_tile): the block stream's block values and row sum where one row runs the
    stream (a scale per block, rows not a multiple of 8 blocks), the one-row accumulation
    elsewhere. Q8 with a scale per block runs the same stream. So a speculative verify row gets
    the bits of the same row decoded alone."""
    if "avx2" not in KERNELS:
        pytest.skip("no AVX2 on this CPU")
    before = native.kernel()
    native.set_kernel("avx2")
    try:
        gen = torch.Generator().manual_seed(n * 11 + k)
        w = torch.randn(n, k, generator=gen) * 0.1
        methods = [Int4Linear.from_float(w, group), _fp16_scales(Int4Linear.from_float(w, group))]
        if group == 32 and ((k + 31) // 32) % 8:   # Q8_0's blocks run the same stream (s8_stream_group)
            methods.append(Int8Linear.from_float(w, group))
        for method in methods:
            _rows_have_their_bits_alone(method, (2, 3, 5, 8, 9), gen)
    finally:
        native.set_kernel(before)


@pytest.mark.parametrize("n,k,group", [(37, 576, 32), (29, 544, 32), (40, 1536, 32), (21, 576, 64), (13, 45, 32)])
@pytest.mark.parametrize("kernel", [k for k in ("avx512vnni", "amx") if k in KERNELS])
def test_a_q4_row_has_the_same_bits_alone_or_with_others_on_avx512(kernel, n, k, group):
    """On the avx512vnni set 2 to 4 x rows, on amx 2 and 3 (from 4 the tiles), against a Q4 matrix
    run the one-row kernels' arithmetic per row (u4_rows_quad512): the block stream where one row runs it (a scale per
    block, rows not whole 16-block chunks), quad order elsewhere. So a decode row of a batch of a
    few sequences, or a verify row, gets the bits of the same row decoded alone; with the quad
    kernels switched off (TOKENMILL_QUAD_ROWS_MAX=1: pair order or AMX tiles) it would not."""
    before = native.kernel()
    native.set_kernel(kernel)
    try:
        gen = torch.Generator().manual_seed(n * 13 + k)
        w = torch.randn(n, k, generator=gen) * 0.1
        for method in (Int4Linear.from_float(w, group), _fp16_scales(Int4Linear.from_float(w, group))):
            _rows_have_their_bits_alone(method, (2, 3) if kernel == "amx" else (2, 3, 4), gen)
    finally:
        native.set_kernel(before)


GEMMS = [k for k in native.GEMM_KERNELS
         if k == "scalar" or (k == "avx2" and "avx2" in KERNELS) or (k == "avx512vnni" and "avx512vnni" in KERNELS)]


@pytest.mark.parametrize("gemm", GEMMS)
@pytest.mark.parametrize("n,k,group", [(7, 100, 32), (33, 576, 64), (5, 45, 32), (64, 1536, 128), (17, 300, 96),
                                       (6, 544, 32), (4, 600, 608)])
def test_tiled_prefill_gemm_matches_dequantize_then_matmul(gemm, n, k, group):
    """The tiled integer GEMM (qgemm.c), each of its kernels, against dequant(W) @ dequant(q16(x))^T:
    row counts that fill no tile, one tile, and a tile and a part (16 rows per AVX2 tile, 32 per
    AVX-512 one), weight-row counts off the 6-row panel, every packed format, with and without bias."""
    gen = torch.Generator().manual_seed(7 * n + k)
    w = torch.randn(n, k, generator=gen) * 0.1
    bias = torch.randn(n, generator=gen)
    for name, method in _methods(w, group).items():
        wd = method.dequantize()
        for m in (1, 5, 16, 33, 70):
            x = torch.randn(m, k, generator=gen) * 3
            y = torch.empty(m, n)
            method._gemm_tiled(x, y, 0, 1, kernel=gemm)
            _check(y, q16_reference(x), wd)
            method._gemm_tiled(x, y, bias.data_ptr(), 1, kernel=gemm)
            _check(y, q16_reference(x), wd, bias)


def test_tiled_prefill_gemm_gives_the_same_bits_on_any_thread_count_and_tile():
    """A result of the tiled GEMM never depends on which thread computes it, how the weight rows
    are shared out, or whether its row ran in a whole tile or a last half tile (every lane runs
    the same instructions in a fixed sum order)."""
    gen = torch.Generator().manual_seed(4)
    method = Int4Linear.from_float(torch.randn(131, 320, generator=gen) * 0.1, 32)
    x = torch.randn(75, 320, generator=gen)
    for gemm in GEMMS:
        outs = []
        for threads in (1, 2, 3):
            y = torch.empty(75, 131)
            method._gemm_tiled(x, y, 0, threads, kernel=gemm)
            outs.append(y)
        assert all(torch.equal(outs[0], o) for o in outs[1:]), gemm
        for lo, hi in ((64, 75), (0, 5), (40, 75)):   # rows that ran in whole tiles, now in other tiles
            part = torch.empty(hi - lo, 131)
            method._gemm_tiled(x[lo:hi].contiguous(), part, 0, 2, kernel=gemm)
            assert torch.equal(part, outs[0][lo:hi]), (gemm, lo, hi)


def test_prefill_gemm_is_chosen_from_the_cpu_and_can_be_set():
    """auto: the tiled int16 GEMM where its AVX-512 VNNI or AVX2 kernels run, else dequantize +
    fp32 GEMM; set_prefill_gemm and TOKENMILL_PREFILL_GEMM override it, set_gemm_kernel and
    TOKENMILL_GEMM_KERNELS pick the GEMM's kernels, and a bad value names its source."""
    assert native.gemm_kernel() == ("avx512vnni" if "avx512vnni" in KERNELS else "avx2" if "avx2" in KERNELS else "scalar")
    assert packed.prefill_gemm() == ("int16" if native.gemm_kernel() != "scalar" else "fp32")
    before = native.kernel()
    try:
        native.set_kernel("scalar")   # the portable decode kernels: the portable GEMM, so fp32 prefill
        assert native.gemm_kernel() == "scalar" and packed.prefill_gemm() == "fp32"
    finally:
        native.set_kernel(before)
    try:
        native.set_gemm_kernel("scalar")
        assert native.gemm_kernel() == "scalar"
        with pytest.raises(ValueError, match="unknown GEMM kernels"):
            native.set_gemm_kernel("sse9")
    finally:
        native.set_gemm_kernel(None)
    try:
        for mode in ("int16", "fp32"):
            packed.set_prefill_gemm(mode)
            assert packed.prefill_gemm() == mode
        with pytest.raises(ValueError, match="prefill GEMM must be one of"):
            packed.set_prefill_gemm("bf16")
    finally:
        packed.set_prefill_gemm(None)
    with pytest.raises(ValueError, match="unknown GEMM kernels"):
        Int4Linear.from_float(torch.randn(6, 32), 32)._gemm_tiled(torch.randn(40, 32), torch.empty(40, 6), 0, 1,
                                                                  kernel="sse9")
    _check_env_setting(packed.PREFILL_ENV, "from tokenmill.layers.quant import packed; print(packed.prefill_gemm())",
                       "fp32", "fp8", f"{packed.PREFILL_ENV} must be one of auto, int16, fp32, got 'fp8'")
    _check_env_setting(native.GEMM_KERNELS_ENV, "from tokenmill._native import quant as q; print(q.gemm_kernel())",
                       "scalar", "sse9", f"{native.GEMM_KERNELS_ENV}=sse9: unknown GEMM kernels sse9")
