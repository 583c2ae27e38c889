"""Group-wise 8-bit and 4-bit weights, run by the native kernels (``tokenmill/_native/quant.c``).

Layouts (one row per output channel, ``K = in_features`` padded with zeros to ``Kp``, a multiple
of 32):

- :class:`Int8Linear`: ``qs int8 [N, Kp]``, ``scales [N, G]``; ``w = scale * q``.
- :class:`Int4Linear`: ``qs uint8 [N, Kp/2]`` (per block of 32 values, byte ``i`` holds value
  ``i`` in its low nibble and value ``i+16`` in its high one, GGML's order), ``scales`` and
  ``mins [N, G]``; ``w = scale * q + min`` with ``q`` in 0..15.

``G = ceil(K / group_size)``; ``group_size`` is a multiple of 32, and the last group of a row may
be shorter (a "group remainder"). Scales are fp16 (GGUF's own, exact) or fp32.

How a matmul runs:

- up to :func:`gemv_max_rows` rows of ``x`` (decode steps): the kernel quantizes ``x`` to int16 in
  blocks of 32 (scale absmax/32639) and does integer dot products; the result equals
  ``dequant(W) @ dequant(xq)^T`` up to float summation order. (int8 activations, llama.cpp's
  choice, were measured first: 3% of teacher-forced top-1 tokens flipped on the default model;
  int16 keeps >99.9%.) :func:`fp32_activations` and :func:`int16_activations` force one path (the
  teacher-forced accuracy check compares both).
- more rows (prefill), by :func:`prefill_gemm`:
  - ``"int16"``: the tiled integer GEMM (``tokenmill/_native/qgemm.c``): the same int16
    activations and per-block integer sums as the decode kernels, with x rows in the vector lanes
    so a block's scaling is shared by 8 or 16 rows; the default wherever its AVX-512 VNNI or AVX2
    kernels run (on a Zen 4 host 1.5x-2.4x dequantize + oneDNN's fp32 GEMM per matrix with
    AVX-512 VNNI, 1.1x-2.5x with AVX2 against oneDNN capped at AVX2; docs/benchmarks.md);
  - ``"fp32"``: ``W`` is dequantized into a reused fp32 buffer, a slab of rows at a time, and
    multiplied with an fp32 GEMM (:func:`fp32_gemm`: oneDNN's, else ``F.linear``), so prefill keeps
    fp32 activations; the default with the portable kernels.
  ``TOKENMILL_PREFILL_GEMM={auto,int16,fp32}`` (read at import) or :func:`set_prefill_gemm`
  overrides the choice.

Where the two paths meet is decided in one place, :func:`gemv_max_rows`: the largest row count at
which the integer kernels of the kernel set in use (``tokenmill._native.quant.kernel()``, chosen
from the CPU at start-up) still beat dequantize + fp32 GEMM on the default model's matrices, from
:data:`GEMV_MAX_ROWS_BY_KERNEL` (measured on the whole decode step with
``benchmarks/quant_verify_rows.py --paths int,dequant`` and per matrix with
``benchmarks/quant_kernel_rows.py --dequant``; numbers in docs/results/quant.md): 2048 rows for
``amx`` (AVX-512 VNNI plus the AMX tiles, faster than the tiled GEMM at every size measured,
1.07x-1.49x at 128-2048 rows, so every step of a server's default 512-token budget runs fused),
24 for ``avx512vnni``, 28 for ``avx2`` and ``avxvnni`` (whose CPUs' fp32 GEMM is 256-bit too; 16
where it is AVX-512), 4 for ``scalar``. The environment variable ``TOKENMILL_GEMV_MAX_ROWS`` (read at
import) or :func:`set_gemv_max_rows` overrides it. The fused decode path
(:mod:`~tokenmill.layers.quant.fused_decode`) and the engine's step-cost kinds
(``engine.model_runner.step_kind_rows``) ask the same function.
"""
from __future__ import annotations

import abc
import contextlib
import os
import threading
from typing import Callable, Iterator, Sequence

import torch
import torch.nn.functional as F

from tokenmill._native import quant as native
from tokenmill.layers.linear import LinearMethod, onednn_linear

QK = 32
SLAB_BYTES = 16 << 20       # fp32 scratch for one slab of dequantized weight rows

# x rows up to which the integer kernels beat dequantize + fp32 GEMM on the whole decode step of
# the default model, per kernel set, on the CPUs that pick that set (avx2 / avxvnni: no AVX-512,
# so the fp32 GEMM is AVX2 too; scalar: no AVX2). Measured in docs/results/quant.md.
GEMV_MAX_ROWS_BY_KERNEL = {"amx": 2048, "avx512vnni": 24, "avxvnni": 28, "avx2": 28, "scalar": 4}
# avx2 / avxvnni on a CPU whose fp32 GEMM runs AVX-512 (AVX-512 without VNNI, or a lower set
# picked with set_kernel): the GEMM is twice as wide and wins from fewer rows
GEMV_MAX_ROWS_WIDE_GEMM = 16
GEMV_MAX_ROWS_DEFAULT = 16  # a kernel set without its own entry
GEMV_ROWS_ENV = "TOKENMILL_GEMV_MAX_ROWS"
EMBED_IN_PLACE = 4          # embedding lookups of up to this many ids read rows in place (_Packed._embed)
PREFILL_ENV = "TOKENMILL_PREFILL_GEMM"
PREFILL_GEMMS = ("auto", "int16", "fp32")

_state = threading.local()


def _rows_from_env() -> int | None:
    raw = os.environ.get(GEMV_ROWS_ENV, "").strip()
    if not raw:
        return None
    try:
        rows = int(raw)
    except ValueError:
        rows = -1
    if rows < 0:
        raise ValueError(f"{GEMV_ROWS_ENV} must be a non-negative integer (x rows up to which the packed "
                         f"integer kernels run), got {raw!r}")
    return rows


_rows_override: int | None = _rows_from_env()


_WIDE_GEMM: bool | None = None


def _wide_gemm() -> bool:
    """Whether the fp32 GEMM runs AVX-512 at full width here: torch's CPU capability, capped by
    oneDNN's own ``ONEDNN_MAX_CPU_ISA`` (``DNNL_MAX_CPU_ISA``) when set, and not on a CPU whose
    AVX-512 runs on 256-bit units (Zen 4: there the avx2 kernels beat dequantize + GEMM up to 28
    rows, as on an AVX2 machine; docs/benchmarks.md, "A Zen 4 host"). Decided once."""
    global _WIDE_GEMM
    if _WIDE_GEMM is None:
        cap = torch.backends.cpu.get_cpu_capability().upper()
        cap_env = (os.environ.get("ONEDNN_MAX_CPU_ISA") or os.environ.get("DNNL_MAX_CPU_ISA") or "ALL").upper()
        _WIDE_GEMM = (cap.startswith("AVX512") and (cap_env == "ALL" or cap_env.startswith(("AVX512", "AVX10")))
                      and not native.avx512_half_width())
    return _WIDE_GEMM


def gemv_max_rows() -> int:
    """x rows up to which a packed matmul (and a fused decode step) runs the integer decode
    kernels; more rows take the prefill GEMM (:func:`prefill_gemm`). The override
    (``TOKENMILL_GEMV_MAX_ROWS``, :func:`set_gemv_max_rows`) if set, else the measured crossover
    of the kernel set in use (:data:`GEMV_MAX_ROWS_BY_KERNEL`; against dequantize + fp32 GEMM,
    :data:`GEMV_MAX_ROWS_WIDE_GEMM` for the 256-bit sets where that GEMM is AVX-512)."""
    if _rows_override is not None:
        return _rows_override
    kern = native.kernel()
    if prefill_gemm() == "int16":
        # The same limits against the tiled GEMM. Its AVX2 kernels stayed behind the fused decode
        # path up to 28 rows (1.45x there). Its AVX-512 ones overtake it on the whole step from 20
        # rows (avx2 set) or 16 (avx512vnni set) on a Zen 4 host, but in three served runs with
        # those lower limits single-stream decode read 0.87x-0.92x, and level with 28 (unexplained:
        # one row never reaches the limit; docs/benchmarks.md), so the measured-safe limits stay.
        return GEMV_MAX_ROWS_BY_KERNEL.get(kern, GEMV_MAX_ROWS_DEFAULT)
    if kern in ("avx2", "avxvnni") and _wide_gemm():
        return GEMV_MAX_ROWS_WIDE_GEMM
    return GEMV_MAX_ROWS_BY_KERNEL.get(kern, GEMV_MAX_ROWS_DEFAULT)


# x rows the integer kernels of a set handle together, where a step's cost rises in steps of them:
# the amx set's wide layout puts 16 x rows across a tile's columns, so 17 rows cost what 32 do
# (docs/quantization.md, "AMX tiles")
GEMV_ROW_GROUP_BY_KERNEL = {"amx": 16}


def gemv_row_group() -> int:
    """Rows per group of the integer kernels in use (:data:`GEMV_ROW_GROUP_BY_KERNEL`; 1 where the
    cost of a row does not come in steps): a step that spills a few rows into a new group pays
    for the whole group. The engine's prefill bound cuts chunks to whole groups
    (``engine.step_cost.StepCost.row_group``). 1 as well where the row limit keeps steps of more
    than one group off the integer kernels."""
    group = GEMV_ROW_GROUP_BY_KERNEL.get(native.kernel(), 1)
    return group if gemv_max_rows() > group else 1


def set_gemv_max_rows(rows: int | None) -> None:
    """Override :func:`gemv_max_rows` for this process (``None``: back to the per-kernel value).
    Set it before an engine starts: the step-cost model reads it once."""
    global _rows_override
    if rows is not None and (not isinstance(rows, int) or rows < 0):
        raise ValueError(f"gemv max rows must be a non-negative integer or None, got {rows!r}")
    _rows_override = rows


def _prefill_from_env() -> str:
    raw = os.environ.get(PREFILL_ENV, "").strip().lower() or "auto"
    if raw not in PREFILL_GEMMS:
        raise ValueError(f"{PREFILL_ENV} must be one of {', '.join(PREFILL_GEMMS)}, got {raw!r}")
    return raw


_prefill_setting: str = _prefill_from_env()


def prefill_gemm() -> str:
    """How a packed matmul of more than :func:`gemv_max_rows` rows runs: ``"int16"`` (the tiled
    integer GEMM, int16 activations) or ``"fp32"`` (dequantize + fp32 GEMM). ``auto`` (the
    default) is ``"int16"`` where its AVX-512 VNNI or AVX2 kernels run on this CPU
    (``tokenmill._native.quant.gemm_kernel()``), else (the portable kernels) ``"fp32"``."""
    if _prefill_setting != "auto":
        return "fp32" if _prefill_setting == "fp32" or not native.available() else "int16"
    return "int16" if native.gemm_kernel() in ("avx512vnni", "avx2") else "fp32"


def set_prefill_gemm(mode: str | None) -> None:
    """Override :func:`prefill_gemm` for this process: ``"int16"``, ``"fp32"``, or ``"auto"`` /
    ``None`` (back to the per-CPU choice). Set it before an engine starts."""
    global _prefill_setting
    mode = "auto" if mode is None else mode
    if mode not in PREFILL_GEMMS:
        raise ValueError(f"prefill GEMM must be one of {', '.join(PREFILL_GEMMS)} or None, got {mode!r}")
    _prefill_setting = mode


def _activation_mode() -> str:
    return getattr(_state, "act_mode", "auto")


@contextlib.contextmanager
def _mode(mode: str) -> Iterator[None]:
    before = _activation_mode()
    _state.act_mode = mode
    try:
        yield
    finally:
        _state.act_mode = before


def fp32_activations() -> "contextlib.AbstractContextManager[None]":
    """Within this block (this thread) every quantized matmul keeps fp32 activations
    (dequantize + fp32 GEMM), whatever the number of rows."""
    return _mode("fp32")


def int16_activations() -> "contextlib.AbstractContextManager[None]":
    """Within this block (this thread) every quantized matmul uses the int16-activation kernel,
    whatever the number of rows (to measure that kernel's accuracy on long sequences)."""
    return _mode("int16")


def _scratch(numel: int) -> torch.Tensor:
    buf = getattr(_state, "scratch", None)
    if buf is None or buf.numel() < numel:
        buf = torch.empty(numel, dtype=torch.float32)
        _state.scratch = buf
    return buf[:numel]


def _probe_onednn() -> bool:
    try:
        x, w = torch.randn(3, 40), torch.randn(5, 40)
        return bool(torch.allclose(onednn_linear(x, w), F.linear(x, w), rtol=1e-4, atol=1e-5))
    except (AttributeError, RuntimeError):  # torch built without oneDNN, or the op is gone
        return False


_ONEDNN: bool | None = None


def fp32_gemm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``x [M, K] @ w [N, K]^T`` in fp32: oneDNN's matmul when this torch has it, else ``F.linear``."""
    global _ONEDNN
    if _ONEDNN is None:
        _ONEDNN = torch.backends.mkldnn.is_available() and _probe_onednn()
    return onednn_linear(x, w) if _ONEDNN else F.linear(x, w)


def _padded(k: int) -> int:
    return (k + QK - 1) // QK * QK


def _check_group(k: int, group_size: int) -> None:
    if group_size <= 0 or group_size % QK:
        raise ValueError(f"group size must be a positive multiple of {QK}, got {group_size}")
    if group_size > _padded(k):
        raise ValueError(f"group size {group_size} exceeds the padded row length {_padded(k)}")


def _pad_cols(w: torch.Tensor, kp: int) -> torch.Tensor:
    """``w [N, K]`` widened to ``kp`` columns by repeating its last column (so padding changes no
    group's min/max)."""
    k = w.shape[1]
    if kp == k:
        return w
    return torch.cat([w, w[:, -1:].expand(-1, kp - k)], dim=1)


def _group_view(w: torch.Tensor, group_size: int) -> tuple[torch.Tensor, int]:
    """``w [N, Kp]`` as ``[N, G, group_size]`` (the ragged last group padded by edge values)."""
    n, kp = w.shape
    g = (kp + group_size - 1) // group_size
    return _pad_cols(w, g * group_size).reshape(n, g, group_size), g


class _Packed(LinearMethod):
    """Shared matmul driver of the packed formats."""

    group_size: int
    _native_kind: int   # the native layout: 0 = u4 (scale and min), 1 = s8 (scale)

    def _scale_f16(self) -> int:
        return int(self.scales.dtype == torch.float16)

    @abc.abstractmethod
    def _gemm(self, x2: torch.Tensor, y: torch.Tensor, bias_ptr: int, threads: int) -> None:
        """The native integer kernel: ``y = x2 @ W^T (+ bias)``."""

    def _gemm_tiled(self, x2: torch.Tensor, y: torch.Tensor, bias_ptr: int, threads: int,
                    kernel: str | None = None) -> None:
        """The prefill GEMM (``qgemm.c``): ``y = x2 @ W^T (+ bias)`` with int16 activations."""
        native.gemm_tiled(self._native_kind, x2.data_ptr(), x2.shape[0], self.in_features, self.qs.data_ptr(),
                          self.scales.data_ptr(), self._mins_ptr(), self._scale_f16(), self.out_features,
                          self.group_size, bias_ptr, y.data_ptr(), threads, kernel=kernel)

    def _mins_ptr(self) -> int:
        """The per-group mins of a format that has them, else 0."""
        return 0

    @abc.abstractmethod
    def _dequant_into(self, out: torch.Tensor, rows: slice, threads: int) -> None:
        """The native dequantizer: rows ``rows`` of ``W`` into ``out`` (fp32)."""

    def _embed(self, ids: torch.Tensor, dtype: torch.dtype, parts: Sequence[torch.Tensor],
               dequant: Callable[..., None]) -> torch.Tensor:
        """Rows ``ids`` of the dequantized matrix, ``[*ids.shape, in_features]`` in ``dtype``:
        ``dequant(*row pointers of parts, rows, out pointer)`` (a native ``dequant_*``). Up to
        ``EMBED_IN_PLACE`` ids (a decode step's) are read in place through row pointers; more are
        gathered first. A decode step spent about 50 us here with two gathers and their tensors,
        its Python running with caches the weight stream had just emptied."""
        flat = ids.reshape(-1)
        n = flat.numel()
        out = torch.empty(n, self.in_features, dtype=torch.float32)
        if n <= EMBED_IN_PLACE:
            rows = flat.tolist()
            if any(not 0 <= i < self.out_features for i in rows):
                raise IndexError(f"token ids {rows} outside the embedding's {self.out_features} rows")
            row_bytes = [t.stride(0) * t.element_size() for t in parts]
            base = [t.data_ptr() for t in parts]
            for r, i in enumerate(rows):
                dequant(*(b + i * rb for b, rb in zip(base, row_bytes)), 1, out.data_ptr() + 4 * r * self.in_features)
        else:
            gathered = [t.index_select(0, flat) for t in parts]   # alive through the call
            dequant(*(g.data_ptr() for g in gathered), n, out.data_ptr())
        if dtype != torch.float32:
            out = out.to(dtype)
        return out if ids.dim() == 1 else out.reshape(*ids.shape, self.in_features)

    def forward(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        if x2.dtype != torch.float32:
            x2 = x2.float()
        x2 = x2.contiguous()
        m, n = x2.shape[0], self.out_features
        if m == 0:  # e.g. the head of a prefill chunk that samples nothing
            return x.new_empty(*lead, n)
        threads = torch.get_num_threads()
        mode = _activation_mode()
        decode = mode == "int16" or (mode == "auto" and m <= gemv_max_rows())
        if decode or (mode == "auto" and prefill_gemm() == "int16"):
            y = torch.empty(m, n, dtype=torch.float32)
            b = None if bias is None else bias.float().contiguous()
            b_ptr = 0 if b is None else b.data_ptr()
            if decode:
                self._gemm(x2, y, b_ptr, threads)
            else:
                self._gemm_tiled(x2, y, b_ptr, threads)
        else:
            y = self._dequant_matmul(x2, threads)
            if bias is not None:
                y += bias.float()
        return y.reshape(*lead, n).to(x.dtype)

    def _dequant_matmul(self, x2: torch.Tensor, threads: int) -> torch.Tensor:
        n, k = self.out_features, self.in_features
        rows = max(1, min(n, SLAB_BYTES // (4 * k)))
        if rows >= n:
            w = _scratch(n * k).view(n, k)
            self._dequant_into(w, slice(0, n), threads)
            return fp32_gemm(x2, w)
        y = torch.empty(x2.shape[0], n, dtype=torch.float32)
        for r0 in range(0, n, rows):  # a slab of weight rows at a time (large vocabularies)
            r1 = min(n, r0 + rows)
            w = _scratch((r1 - r0) * k).view(r1 - r0, k)
            self._dequant_into(w, slice(r0, r1), threads)
            y[:, r0:r1] = fp32_gemm(x2, w)
        return y

    def dequantize(self) -> torch.Tensor:
        out = torch.empty(self.out_features, self.in_features, dtype=torch.float32)
        if native.available():
            self._dequant_into(out, slice(0, self.out_features), torch.get_num_threads())
        else:
            out.copy_(self._dequantize_torch())
        return out

    @abc.abstractmethod
    def _dequantize_torch(self) -> torch.Tensor:
        """``W`` in fp32 with torch ops only (no native kernels needed)."""

    def _expand(self, t: torch.Tensor) -> torch.Tensor:
        """Per-group ``t [N, G]`` as per-value ``[N, K]`` fp32."""
        return t.float().repeat_interleave(self.group_size, dim=1)[:, : self.in_features]


class Int8Linear(_Packed):
    """Signed 8-bit weights with one scale per group of ``group_size`` inputs (per channel when
    the group is the whole row)."""

    format = "int8"
    _native_kind = 1

    def __init__(self, qs: torch.Tensor, scales: torch.Tensor, in_features: int, group_size: int) -> None:
        super().__init__(qs.shape[0], in_features)
        kp = _padded(in_features)
        _check_group(in_features, group_size)
        g = (in_features + group_size - 1) // group_size
        if qs.dtype != torch.int8 or tuple(qs.shape) != (self.out_features, kp):
            raise ValueError(f"int8 qs must be int8 [{self.out_features}, {kp}], got {qs.dtype} {tuple(qs.shape)}")
        if scales.dtype not in (torch.float16, torch.float32) or tuple(scales.shape) != (self.out_features, g):
            raise ValueError(f"int8 scales must be fp16/fp32 [{self.out_features}, {g}], got "
                             f"{scales.dtype} {tuple(scales.shape)}")
        self.group_size = int(group_size)
        self.register_buffer("qs", qs.contiguous(), persistent=False)
        self.register_buffer("scales", scales.contiguous(), persistent=False)

    @classmethod
    def from_float(cls, w: torch.Tensor, group_size: int | None = None) -> "Int8Linear":
        """Symmetric round-to-nearest quantization of ``w [N, K]`` (``group_size`` None: per channel)."""
        w = w.detach().float()
        n, k = w.shape
        kp = _padded(k)
        group = kp if group_size is None else int(group_size)
        _check_group(k, group)
        grouped, g = _group_view(_pad_cols(w, kp), group)
        scale = grouped.abs().amax(dim=-1) / 127.0
        inv = torch.where(scale > 0, 1.0 / scale, torch.zeros_like(scale))
        q = torch.round(grouped * inv.unsqueeze(-1)).clamp_(-127, 127).to(torch.int8)
        q = q.reshape(n, g * group)[:, :kp].clone()
        q[:, k:] = 0
        return cls(q, scale.contiguous(), k, group)

    def _gemm(self, x2: torch.Tensor, y: torch.Tensor, bias_ptr: int, threads: int) -> None:
        native.gemm_s8(x2.data_ptr(), x2.shape[0], self.in_features, self.qs.data_ptr(), self.scales.data_ptr(),
                       self._scale_f16(), self.out_features, self.group_size, bias_ptr, y.data_ptr(), threads)

    def _dequant_into(self, out: torch.Tensor, rows: slice, threads: int) -> None:
        native.dequant_s8(self.qs[rows].data_ptr(), self.scales[rows].data_ptr(), self._scale_f16(),
                          rows.stop - rows.start, self.in_features, self.group_size, out.data_ptr(), threads)

    def _dequantize_torch(self) -> torch.Tensor:
        return self.qs[:, : self.in_features].float() * self._expand(self.scales)

    def embedding(self, ids: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        if not native.available():
            return super().embedding(ids, dtype)
        f16, k, group = self._scale_f16(), self.in_features, self.group_size
        return self._embed(ids, dtype, (self.qs, self.scales),
                           lambda qs, sc, n, out: native.dequant_s8(qs, sc, f16, n, k, group, out, 1))

    def select_rows(self, index: torch.Tensor) -> "Int8Linear":
        return Int8Linear(self.qs[index], self.scales[index], self.in_features, self.group_size)

    def can_cat(self, other: LinearMethod) -> bool:
        return (isinstance(other, Int8Linear) and other.in_features == self.in_features
                and other.group_size == self.group_size and other.scales.dtype == self.scales.dtype)

    @classmethod
    def cat_rows(cls, parts: Sequence[LinearMethod]) -> "Int8Linear":
        p0 = parts[0]
        return cls(torch.cat([p.qs for p in parts]), torch.cat([p.scales for p in parts]),  # type: ignore
                   p0.in_features, p0.group_size)  # type: ignore[attr-defined]

    def extra_repr(self) -> str:
        return f"int8 group={self.group_size}, out={self.out_features}, in={self.in_features}"


def pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """``q [N, Kp]`` values 0..15 -> ``[N, Kp/2]`` bytes in the kernel's (GGML's) block order."""
    n, kp = q.shape
    b = q.to(torch.uint8).reshape(n, kp // QK, 2, QK // 2)
    return (b[:, :, 0] | (b[:, :, 1] << 4)).reshape(n, kp // 2).contiguous()


def unpack_nibbles(qs: torch.Tensor) -> torch.Tensor:
    n, half = qs.shape
    b = qs.reshape(n, half // 16, 1, 16)
    return torch.cat([b & 0x0F, b >> 4], dim=2).reshape(n, half * 2)


class Int4Linear(_Packed):
    """Unsigned 4-bit weights with a scale and a min per group (``w = scale * q + min``)."""

    format = "int4"
    _native_kind = 0

    def _mins_ptr(self) -> int:
        return self.mins.data_ptr()

    def __init__(self, qs: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor, in_features: int,
                 group_size: int) -> None:
        super().__init__(qs.shape[0], in_features)
        kp = _padded(in_features)
        _check_group(in_features, group_size)
        g = (in_features + group_size - 1) // group_size
        if qs.dtype != torch.uint8 or tuple(qs.shape) != (self.out_features, kp // 2):
            raise ValueError(f"int4 qs must be uint8 [{self.out_features}, {kp // 2}], got {qs.dtype} {tuple(qs.shape)}")
        for name, t in (("scales", scales), ("mins", mins)):
            if t.dtype not in (torch.float16, torch.float32) or tuple(t.shape) != (self.out_features, g):
                raise ValueError(f"int4 {name} must be fp16/fp32 [{self.out_features}, {g}], got "
                                 f"{t.dtype} {tuple(t.shape)}")
        if scales.dtype != mins.dtype:
            raise ValueError("int4 scales and mins must have one dtype")
        self.group_size = int(group_size)
        self.register_buffer("qs", qs.contiguous(), persistent=False)
        self.register_buffer("scales", scales.contiguous(), persistent=False)
        self.register_buffer("mins", mins.contiguous(), persistent=False)

    @classmethod
    def from_float(cls, w: torch.Tensor, group_size: int = 128, symmetric: bool = False) -> "Int4Linear":
        """Round-to-nearest 4-bit quantization of ``w [N, K]`` per group of ``group_size`` inputs.

        Asymmetric: ``scale = (max - min) / 15``, ``min = min`` (the GGUF Q4_1 rule). Symmetric
        (the Q4_0 rule): ``scale = v / -8`` for the group's value ``v`` of largest magnitude, ``q - 8``
        in -8..7, stored as ``min = -8 * scale``; zero stays exact."""
        w = w.detach().float()
        n, k = w.shape
        kp = _padded(k)
        _check_group(k, group_size)
        grouped, g = _group_view(_pad_cols(w, kp), group_size)
        if symmetric:
            peak = grouped.gather(-1, grouped.abs().argmax(dim=-1, keepdim=True)).squeeze(-1)
            scale = peak / -8.0
            inv = torch.where(scale != 0, 1.0 / scale, torch.zeros_like(scale))
            q = (torch.round(grouped * inv.unsqueeze(-1)) + 8).clamp_(0, 15)
            mins = -8.0 * scale
        else:
            lo, hi = grouped.amin(dim=-1), grouped.amax(dim=-1)
            scale = (hi - lo) / 15.0
            inv = torch.where(scale > 0, 1.0 / scale, torch.zeros_like(scale))
            q = torch.round((grouped - lo.unsqueeze(-1)) * inv.unsqueeze(-1)).clamp_(0, 15)
            mins = lo
        q = q.reshape(n, g * group_size)[:, :kp]
        return cls(pack_nibbles(q), scale.contiguous(), mins.contiguous(), k, group_size)

    def _gemm(self, x2: torch.Tensor, y: torch.Tensor, bias_ptr: int, threads: int) -> None:
        native.gemm_u4(x2.data_ptr(), x2.shape[0], self.in_features, self.qs.data_ptr(), self.scales.data_ptr(),
                       self.mins.data_ptr(), self._scale_f16(), self.out_features, self.group_size, bias_ptr,
                       y.data_ptr(), threads)

    def _dequant_into(self, out: torch.Tensor, rows: slice, threads: int) -> None:
        native.dequant_u4(self.qs[rows].data_ptr(), self.scales[rows].data_ptr(), self.mins[rows].data_ptr(),
                          self._scale_f16(), rows.stop - rows.start, self.in_features, self.group_size,
                          out.data_ptr(), threads)

    def _dequantize_torch(self) -> torch.Tensor:
        q = unpack_nibbles(self.qs)[:, : self.in_features].float()
        return torch.addcmul(self._expand(self.mins), q, self._expand(self.scales))

    def embedding(self, ids: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        if not native.available():
            return super().embedding(ids, dtype)
        f16, k, group = self._scale_f16(), self.in_features, self.group_size
        return self._embed(ids, dtype, (self.qs, self.scales, self.mins),
                           lambda qs, sc, mn, n, out: native.dequant_u4(qs, sc, mn, f16, n, k, group, out, 1))

    def select_rows(self, index: torch.Tensor) -> "Int4Linear":
        return Int4Linear(self.qs[index], self.scales[index], self.mins[index], self.in_features, self.group_size)

    def can_cat(self, other: LinearMethod) -> bool:
        return (isinstance(other, Int4Linear) and other.in_features == self.in_features
                and other.group_size == self.group_size and other.scales.dtype == self.scales.dtype)

    @classmethod
    def cat_rows(cls, parts: Sequence[LinearMethod]) -> "Int4Linear":
        p0 = parts[0]
        return cls(torch.cat([p.qs for p in parts]), torch.cat([p.scales for p in parts]),  # type: ignore
                   torch.cat([p.mins for p in parts]), p0.in_features, p0.group_size)  # type: ignore

    def extra_repr(self) -> str:
        return f"int4 group={self.group_size}, out={self.out_features}, in={self.in_features}"
