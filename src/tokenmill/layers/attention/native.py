"""Paged attention with the native CPU kernel: pages are read in place.

The layout is the torch reference backend's (``[2, num_pages, page_size, kv_heads, head_dim]``
per layer), so the two backends are interchangeable on the same pool and the reference can
check the kernel. One kernel call per layer covers the whole step (decodes, fresh prefills and
chunks after cached context together): no per-sequence Python loop, no mask tensor, no gather
of the context into a copy. Its metadata is the batch's own integer tensors, so building it
costs nothing. Writing the step's K/V into its slots stays a torch ``index_copy_``. Decode rows
take the kernel's per-row online softmax; prefill chunks its tiled path, where each K/V row read
from a page serves a whole group of query rows and heads (see ``_native/attention.c``).

Supported: fp32 activations with an fp32, bf16, fp16, fp8 (``float8_e4m3fn``) or int8 KV pool on the
CPU, for standard attention layers (:class:`~tokenmill.contracts.kv.PagedKV`). bf16 and fp16
pages are widened to fp32 as they are read (half the bytes a long-context decode reads; fp16 by
F16C's ``vcvtph2ps``, stored saturated at +-65504 by ``base.to_kv_dtype``); fp8 pages
(:class:`~tokenmill.layers.attention.fp8.FP8Pages`, static or per-token scales) are read as bytes
(a quarter) and widened exactly in the kernel, the scales folded into the query and the softmax
weights. int8 pages (per-vector scales) are widened the same way, except that a decode row on an
AVX-512 VNNI CPU takes an integer body. There the pool is allocated in a tiled order
(:func:`int8_tiled_layout`; :class:`~tokenmill.layers.attention.fp8.FP8Pages` ``tiled``), and a
decode row rounds its query to 16 bits (two signed bytes) and the softmax weights to 8 bits (each
block's largest weight exact), so that both products are ``vpdpbusd`` with no widening
(``_native/attention.c``, "tiled int8 pages"); other rows read the same codes through the tiled
prefill path. Rows-order int8 pages keep the earlier body: the query rounded to int16, K rows
scored by ``vpdpwssd``, the softmax weights rounded to int16 ("int8 pages on AVX-512 VNNI"). The
step's K/V are quantized on write in C to the same bytes (and per-vector scales) as the torch
reference's ``write_fp8``. One difference: the kernel reads every key back from the
pool, so a fresh prefill attends its own chunk through fp8 (the reference uses the chunk's
unrounded K/V); the start-up calibration of static scales therefore runs on the reference
(:meth:`calibration_backend`). Not taken here: MLA latents (LatentKV specs keep
:class:`~tokenmill.layers.attention.mla.MLAAttention`, fp8 included) and non-fp32
activations; those fall back to the torch backend when ``auto`` chooses
(:func:`unsupported_reason` says why).
"""
from __future__ import annotations

import os
from typing import NamedTuple

import torch
from torch.profiler import record_function

from tokenmill._native import attention as kernel
from tokenmill.contracts.batch import ForwardBatch
from tokenmill.contracts.kv import FP8_DTYPES, INT8_DTYPES, KVCacheSpec, PagedKV
from tokenmill.layers.attention.base import AttentionBackend, attention_kinds, to_kv_dtype
from tokenmill.layers.attention import fp8
from tokenmill.layers.attention.fp8 import FP8Pages, write_fp8
from tokenmill.layers.attention.torch_ref import TorchPagedAttention

# the kernel's kv kinds (TM_KV_* in _native/attention.h)
KV_F32, KV_BF16, KV_FP8, KV_FP8_TOKEN, KV_F16, KV_INT8, KV_INT8_TILED = 0, 1, 2, 3, 4, 5, 6
# TOKENMILL_KV_INT8_LAYOUT: int8 pages in the tiled order ("tiled"), in rows ("rows"), or (default
# "auto") tiled where the kernel's tiled int8 decode body runs (int8_tiled_layout)
INT8_LAYOUTS = ("auto", "tiled", "rows")
_KIND_OF_DTYPE = {torch.float32: KV_F32, torch.bfloat16: KV_BF16, torch.float16: KV_F16}


def unsupported_reason(spec: KVCacheSpec, device: torch.device, compute_dtype: torch.dtype) -> str | None:
    if not kernel.available():
        return kernel.unavailable_reason()
    if device.type != "cpu":
        return f"it runs on the CPU only, not {device}"
    if not all(isinstance(layer, PagedKV) for layer in attention_kinds(spec)):
        return "it handles standard attention layers (PagedKV) only"
    if compute_dtype != torch.float32 or spec.dtype not in ("float32", "bfloat16", "float16", *FP8_DTYPES, *INT8_DTYPES):
        return (f"it needs float32 activations and a float32, bfloat16, float16, {'/'.join(FP8_DTYPES)} or int8 KV pool "
                f"(got {compute_dtype}, KV {spec.dtype})")
    return None


def kv_kind(entry: torch.Tensor | FP8Pages) -> int:
    """The kernel's kind code for one layer's KV entry."""
    if isinstance(entry, FP8Pages):
        if entry.is_int8:
            return KV_INT8_TILED if entry.tiled else KV_INT8
        return KV_FP8_TOKEN if entry.per_token else KV_FP8
    return _KIND_OF_DTYPE[entry.dtype]


def kv_pointers(entry: torch.Tensor | FP8Pages) -> tuple[int, int, int, int]:
    """``(k, v, k_scale, v_scale)`` addresses of one layer's entry (scales 0 unless fp8): the
    kernel reads K and V pages ``[num_pages, page_size, kv_heads, head_dim]`` and, for fp8, the
    static ``[kv_heads]`` scales of K and of V or the per-vector ``[num_pages, page_size,
    kv_heads]`` ones."""
    if isinstance(entry, FP8Pages):
        data, scale = entry.data, entry.scale
        if not (data.is_contiguous() and scale.is_contiguous()):
            raise ValueError("fp8 KV pages and scales must be contiguous for the native kernel")
        return data.data_ptr(), _second_half(data), scale.data_ptr(), _second_half(scale)
    return entry.data_ptr(), _second_half(entry), 0, 0


def _second_half(t: torch.Tensor) -> int:
    """The address of ``t[1]`` (no view made: the fused decode path asks every step)."""
    return t.data_ptr() + t.stride(0) * t.element_size()


class NativeMetadata(NamedTuple):
    slot_mapping: torch.Tensor
    query_start_loc: torch.Tensor   # int64, contiguous
    seq_lens: torch.Tensor
    block_tables: torch.Tensor
    num_seqs: int
    page_size: int
    threads: int


def int8_tiled_layout(head_dim: int, page_size: int) -> bool:
    """Whether int8 pages of this shape are allocated in the tiled order: ``TOKENMILL_KV_INT8_LAYOUT``
    (``tiled`` / ``rows``), by default where the kernel's tiled int8 decode body runs (AVX-512
    VNNI, head_dim 64 or 128, pages of a multiple of 16 tokens). Tiled pages need head_dim and
    page_size divisible by 4."""
    layout = os.environ.get("TOKENMILL_KV_INT8_LAYOUT", "auto") or "auto"
    if layout not in INT8_LAYOUTS:
        raise ValueError(f"TOKENMILL_KV_INT8_LAYOUT={layout!r}: expected one of {', '.join(INT8_LAYOUTS)}")
    if layout == "rows" or head_dim % 4 or page_size % 4:
        return False
    return layout == "tiled" or (kernel.int8_tiled_decode() and head_dim in (64, 128) and page_size % 16 == 0)


class NativePagedAttention(TorchPagedAttention):
    name = "native"

    def allocate(self, num_pages: int, page_size: int) -> list[torch.Tensor]:
        """The reference layout's pool; int8 pages in the tiled order where :func:`int8_tiled_layout` says so."""
        pool = super().allocate(num_pages, page_size)
        if not any(isinstance(c, FP8Pages) and c.is_int8 for c in pool):
            return pool
        if not int8_tiled_layout(int(next(c for c in pool if isinstance(c, FP8Pages)).data.shape[-1]), page_size):
            return pool
        return [c._replace(tiled=True) if isinstance(c, FP8Pages) and c.is_int8 else c for c in pool]

    def calibration_backend(self) -> AttentionBackend:
        """The torch reference over the same layout: a fresh prefill attends its chunk's own
        unrounded K/V there, while this kernel reads them back from the (not yet calibrated)
        fp8 pool."""
        return TorchPagedAttention(self.spec, self.device, self.compute_dtype)

    @staticmethod
    def _write_fp8(kv_cache: FP8Pages, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """The step's K/V into fp8 (int8) pages: in C (``fp8_write``), the same bytes and scales as the
        reference's :func:`~tokenmill.layers.attention.fp8.write_fp8` (its rounding is tested
        against torch), which still takes a calibration pass (it records the amax there)."""
        if fp8._CALIBRATING or k.dtype != torch.float32:
            write_fp8(kv_cache.half(0), slots, k)
            write_fp8(kv_cache.half(1), slots, v)
            return
        _, _, ps, hkv, d = kv_cache.data.shape
        slots = slots if slots.dtype == torch.int64 and slots.is_contiguous() else slots.to(torch.int64).contiguous()
        _, _, ksp, vsp = kv_pointers(kv_cache)
        for i, (x, sp) in enumerate(((k, ksp), (v, vsp))):
            if x.stride(2) != 1 or x.stride(1) != d:
                x = x.contiguous()
            kernel.fp8_write(x.data_ptr(), x.stride(0), slots.data_ptr(), x.shape[0], hkv, d,
                             kv_cache.data[i].data_ptr(), sp, kv_cache.per_token, kv_cache.is_int8,
                             ps if kv_cache.tiled else 0, i == 0)

    def build_metadata(self, batch: ForwardBatch) -> NativeMetadata:
        ps = batch.page_size
        if batch.max_seq_len and batch.max_seq_len > batch.block_tables.shape[1] * ps:
            raise ValueError(f"block_tables hold {batch.block_tables.shape[1]} pages of {ps} tokens, "
                             f"too few for a context of {batch.max_seq_len} tokens")
        as_i64 = lambda t: t.to(torch.int64).contiguous()  # noqa: E731
        return NativeMetadata(batch.slot_mapping, as_i64(batch.query_start_loc), as_i64(batch.seq_lens),
                              as_i64(batch.block_tables), batch.num_seqs, ps, torch.get_num_threads())

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                meta: NativeMetadata, scale: float) -> torch.Tensor:
        t, hq, d = q.shape
        hkv = k.shape[1]
        if isinstance(kv_cache, FP8Pages):
            self._write_fp8(kv_cache, meta.slot_mapping, k, v)
        else:
            kv_cache[0].view(-1, hkv, d).index_copy_(0, meta.slot_mapping, to_kv_dtype(k, kv_cache.dtype))
            kv_cache[1].view(-1, hkv, d).index_copy_(0, meta.slot_mapping, to_kv_dtype(v, kv_cache.dtype))
        kp, vp, ksp, vsp = kv_pointers(kv_cache)
        if q.stride(2) != 1 or q.stride(1) != d:
            q = q.contiguous()
        out = torch.empty(t, hq * d, dtype=q.dtype, device=q.device)
        with record_function("tokenmill::native_paged_attention"):   # visible in torch.profiler
            kernel.paged_attention(
                q.data_ptr(), q.stride(0), out.data_ptr(), kp, vp,
                meta.block_tables.data_ptr(), meta.block_tables.stride(0), meta.query_start_loc.data_ptr(),
                meta.seq_lens.data_ptr(), meta.num_seqs, meta.page_size, hq, hkv, d, scale, meta.threads,
                kv_kind(kv_cache), ksp, vsp)
        return out
