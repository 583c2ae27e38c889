"""Python side of the sampler's race-noise kernel (``tokenmill._native._sampling``)."""
from __future__ import annotations

try:
    from tokenmill._native import _sampling as _ext
    _ERROR: str | None = None
except ImportError as e:  # not built (no compiler at install time) or built for another Python
    _ext = None
    _ERROR = (f"the native sampling kernel is not built ({e}); reinstall with a C compiler "
              f"(`pip install -e .`) to get it")


def available() -> bool:
    return _ext is not None


def unavailable_reason() -> str | None:
    return _ERROR


def simd() -> str:
    """The code path in use on this CPU ("avx512", "avx2" or "portable")."""
    return _ext.simd() if _ext is not None else "unavailable"


def race_uniforms(keys_ptr: int, n_keys: int, vocab: int, out_ptr: int, path: int = 0) -> None:
    """See ``sampling.c``: fills ``out[n_keys, vocab]`` (float64) with the splitmix64 uniforms of
    each uint64 key at counters ``0 .. vocab - 1``. ``path`` (for tests): 0 the one chosen for this
    CPU, 1 the portable loop, 2 AVX2, 3 AVX-512 (ValueError where the CPU lacks it)."""
    if _ext is None:
        raise RuntimeError(_ERROR)
    _ext.race_uniforms(keys_ptr, n_keys, vocab, out_ptr, path)
