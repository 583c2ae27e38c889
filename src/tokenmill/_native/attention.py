"""Python side of the paged-attention kernel (``tokenmill._native._attention``)."""
from __future__ import annotations

try:
    from tokenmill._native import _attention as _ext
    _ERROR: str | None = None
except ImportError as e:  # not built (no compiler at install time) or built for another Python
    _ext = None
    _ERROR = (f"the native attention kernel is not built ({e}); reinstall with a C compiler "
              f"(`pip install -e .`) to get it")


def available() -> bool:
    return _ext is not None


def unavailable_reason() -> str | None:
    return _ERROR


def fp8_write(*args) -> None:
    """See ``attention.c``: ``fp8_write(src_ptr, row_stride, slots_ptr, n, hkv, head_dim, dst_ptr,
    scale_ptr, per_token[, int8[, tiled_page_size, is_k]])``, the bytes and scales of
    ``fp8.write_fp8`` (int8: int8 pages; tiled_page_size > 0: tiled int8 pages of that page size,
    is_k for the K half)."""
    if _ext is None:
        raise RuntimeError(_ERROR)
    _ext.fp8_write(*args)


def e4m3_to_float(src_ptr: int, dst_ptr: int, n: int, path: int) -> None:
    """Widen ``n`` fp8 bytes to fp32 with the kernel's scalar (0), AVX2+F16C (1), AVX-512 (2) or
    AVX-512 VBMI table (3, the decode body's) routine (for tests of the exact conversion)."""
    if _ext is None:
        raise RuntimeError(_ERROR)
    _ext.e4m3_to_float(src_ptr, dst_ptr, n, path)


def int8_tiled_decode() -> bool:
    """Whether decode rows over tiled int8 pages take the kernel's VNNI body on this CPU."""
    return bool(_ext.int8_tiled_decode()) if _ext is not None else False


def simd() -> str:
    """The instruction set the kernel uses on this CPU ("avx2+fma" or "scalar")."""
    return _ext.simd() if _ext is not None else "unavailable"


def paged_attention(*args) -> None:
    """See ``attention.c``: ``paged_attention(q_ptr, q_stride, out_ptr, k_ptr, v_ptr, bt_ptr,
    bt_stride, qsl_ptr, seq_lens_ptr, num_seqs, page_size, hq, hkv, head_dim, scale, threads,
    kv_kind[, k_scale_ptr, v_scale_ptr])`` (kv_kind: 0 fp32, 1 bf16, 2 fp8 static scales, 3 fp8
    per-vector scales, 4 fp16, 5 int8 with per-vector scales, 6 tiled int8)."""
    if _ext is None:
        raise RuntimeError(_ERROR)
    _ext.paged_attention(*args)
