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


def simd() -> str:
    """The instruction set the kernel uses on this CPU ("avx2+fma" or "scalar")."""
    return _ext.simd() if _ext is not None else "unavailable"


def paged_attention(*args) -> None:
    """See ``attention.c``: ``paged_attention(q_ptr, q_stride, out_ptr, k_ptr, v_ptr, bt_ptr,
    bt_stride, qsl_ptr, seq_lens_ptr, num_seqs, page_size, hq, hkv, head_dim, scale, threads)``."""
    if _ext is None:
        raise RuntimeError(_ERROR)
    _ext.paged_attention(*args)
