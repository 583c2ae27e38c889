"""Python side of the quantized-matmul kernels (``tokenmill._native._quant``, see ``quant.c``).

``available()`` says whether the extension was built; ``kernel()`` names the instruction set in use,
chosen from the CPU at start-up ("amx", "avx512vnni", "avxvnni", "avx2" or the portable "scalar"; see
``default_kernel()``) or set with ``set_kernel()`` or ``TOKENMILL_QUANT_KERNELS``. Callers pass raw
pointers of contiguous CPU tensors; the thread count follows ``torch.get_num_threads()``.
"""
from __future__ import annotations

import os

import torch  # noqa: F401  (load torch's OpenMP runtime first so the extension shares it)

try:
    from tokenmill._native import _quant as _ext
    _ERROR: str | None = None
except ImportError as e:  # not built (no compiler at install time) or built for another Python
    _ext = None
    _ERROR = (f"the native quantized-matmul kernels are not built ({e}); reinstall with a C compiler "
              f"(`pip install -e .`) to get them")


KERNELS_ENV = "TOKENMILL_QUANT_KERNELS"
GEMM_KERNELS_ENV = "TOKENMILL_GEMM_KERNELS"


def _kernel_from_env() -> None:
    for var, setter in ((KERNELS_ENV, "set_isa"), (GEMM_KERNELS_ENV, "set_gemm_isa")):
        name = os.environ.get(var, "").strip()
        if name and _ext is not None:
            try:
                getattr(_ext, setter)(name)
            except ValueError as e:
                raise ValueError(f"{var}={name}: {e}") from None


_kernel_from_env()


def available() -> bool:
    return _ext is not None


def unavailable_reason() -> str | None:
    return _ERROR


def kernel() -> str:
    """The kernel set in use on this CPU, or "unavailable"."""
    return _ext.isa() if _ext is not None else "unavailable"


def best_kernel() -> str:
    """The widest kernel set this CPU runs, or "unavailable"."""
    return _ext.best_isa() if _ext is not None else "unavailable"


def default_kernel() -> str:
    """The kernel set chosen for this CPU at start-up: :func:`best_kernel`, except on AMD's Zen 4,
    where the 256-bit set decodes faster (its 512-bit units are double-pumped); or "unavailable".
    ``TOKENMILL_QUANT_KERNELS=<set>`` in the environment picks another supported set at import."""
    return _ext.default_isa() if _ext is not None else "unavailable"


def avx512_half_width() -> bool:
    """Whether this CPU runs AVX-512 on 256-bit units (AMD's Zen 4): a 512-bit instruction takes
    two passes, so AVX-512 code is no wider than AVX2 code there."""
    return bool(_ext.avx512_half_width()) if _ext is not None else False


def supported_kernels() -> list[str]:
    """Every kernel set this CPU runs ("scalar", "avx2", "avxvnni", "avx512vnni", "amx"), worst first."""
    return list(_ext.supported_isas()) if _ext is not None else []


def set_kernel(name: str) -> None:
    """Use the ``name`` kernel set (one of :func:`supported_kernels`); ValueError if the CPU lacks it."""
    _need().set_isa(name)


def _need():
    if _ext is None:
        raise RuntimeError(_ERROR)
    return _ext


def gemm_u4(*args) -> None:
    """``gemm_u4(x, M, K, qs, scales, mins, scales_f16, N, group, bias_or_0, y, threads)``."""
    _need().gemm_u4(*args)


def gemm_s8(*args) -> None:
    """``gemm_s8(x, M, K, qs, scales, scales_f16, N, group, bias_or_0, y, threads)``."""
    _need().gemm_s8(*args)


GEMM_KERNELS = ("scalar", "avx2", "avx512vnni")   # gemm_tiled's kernel argument indexes these


def gemm_kernel() -> str:
    """The kernels :func:`gemm_tiled` uses by default: "avx512vnni" wherever the CPU has AVX-512
    VNNI (Zen 4 included), else "avx2", or "scalar" while the kernel set in use is scalar; or the
    ones :func:`set_gemm_kernel` or ``TOKENMILL_GEMM_KERNELS=<kernels>`` picked; or "unavailable"."""
    return _ext.gemm_isa() if _ext is not None else "unavailable"


def set_gemm_kernel(name: str | None) -> None:
    """Pick the prefill GEMM's kernels (one of :data:`GEMM_KERNELS` this CPU runs), apart from the
    decode kernel set; ``None`` restores the rule of :func:`gemm_kernel`. For A/B runs (an AVX2
    machine's prefill on an AVX-512 one, with ``ONEDNN_MAX_CPU_ISA=AVX2`` for the fp32 side)."""
    _need().set_gemm_isa(name)


def gemm_tiled(kind: int, *args, kernel: str | None = None) -> None:
    """``gemm_tiled(kind, x, M, K, qs, scales, mins_or_0, scales_f16, N, group, bias_or_0, y, threads)``:
    the prefill GEMM (``qgemm.c``) for a u4 (``kind`` 0) or s8 (1) weight, with the decode
    kernels' int16 activations; ``kernel`` one of :data:`GEMM_KERNELS` this CPU runs (default:
    :func:`gemm_kernel`)."""
    if kernel is not None and kernel not in GEMM_KERNELS:
        raise ValueError(f"unknown GEMM kernels {kernel!r} (one of {', '.join(GEMM_KERNELS)})")
    _need().gemm_tiled(kind, *args, -1 if kernel is None else GEMM_KERNELS.index(kernel))


def dequant_u4(*args) -> None:
    """``dequant_u4(qs, scales, mins, scales_f16, N, K, group, out, threads)``."""
    _need().dequant_u4(*args)


def dequant_s8(*args) -> None:
    """``dequant_s8(qs, scales, scales_f16, N, K, group, out, threads)``."""
    _need().dequant_s8(*args)


def quantize_act(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The kernels' activation quantizer on ``x [M, K]`` fp32: (xq [M, Kp] int16, xd, xs [M, Kp/32])."""
    ext = _need()
    x = x.contiguous().float()
    m, k = x.shape
    nb = (k + 31) // 32
    xq = torch.empty(m, nb * 32, dtype=torch.int16)
    xd = torch.empty(m, nb)
    xs = torch.empty(m, nb)
    ext.quantize_act(x.data_ptr(), m, k, xq.data_ptr(), xd.data_ptr(), xs.data_ptr())
    return xq, xd, xs


def decode_layers(*args) -> int:
    """Fused decode through packed Llama layers (``decoder.c``); see
    ``tokenmill.layers.quant.fused_decode`` for the arguments. Returns the steps run (1, or a
    chain's, which its stop flag may have cut short)."""
    return _need().decode_layers(*args)


def fp8_quantize(src_ptr: int, dst_ptr: int, n: int, scale_ptr: int, per_token: bool) -> None:
    """``decode_layers``' fp8 KV write of one vector: ``n`` fp32 values to e4m3 bytes with the
    static scale at ``scale_ptr`` or (``per_token``) computing the vector's scale into it."""
    _need().fp8_quantize(src_ptr, dst_ptr, n, scale_ptr, per_token)


def f16_quantize(src_ptr: int, dst_ptr: int, n: int) -> None:
    """``decode_layers``' fp16 KV write: ``n`` fp32 values to IEEE halves, saturated at +-65504
    and rounded to nearest even."""
    _need().f16_quantize(src_ptr, dst_ptr, n)


def layer_fields() -> int:
    """int64 values per layer row of ``decode_layers``' table (-1: an older build without it)."""
    fn = getattr(_need(), "layer_fields", None)
    return int(fn()) if fn is not None else -1


def decode_profile(on: bool | None = None) -> dict[str, float]:
    """Seconds spent so far in each phase of ``decode_layers`` (RMSNorm, each matmul, attention,
    ...). ``on`` True / False also zeroes the timers and turns them on / off (off by default)."""
    ext = _need()
    return dict(ext.decode_profile() if on is None else ext.decode_profile(int(on)))


def decode_kv_prefetch() -> tuple[bool, bool]:
    """``decode_layers``' prefetch of each layer's KV during the matmuls before it: ``(this CPU's
    default, on for a call made now)``. The default is off on Intel CPUs and on elsewhere;
    ``TOKENMILL_KV_PREFETCH=1`` / ``TOKENMILL_NO_KV_PREFETCH=1`` turn it on / off (``decoder.c``)."""
    default, now = _need().decode_kv_prefetch()
    return bool(default), bool(now)
