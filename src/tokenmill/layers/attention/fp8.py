"""FP8 (``float8_e4m3fn``) KV pages with fp32 scales beside them.

Layout: an fp8 KV entry is :class:`FP8Pages` ``(data, scale)``. ``data`` holds the e4m3 bytes
(stored as ``uint8``, because CPU torch has no scatter kernels for float8 tensors; the bytes are
reinterpreted with ``.view(torch.float8_e4m3fn)``) in exactly the shape a full-precision pool
would have; ``scale`` has that shape minus the last (feature) dimension: one fp32 scale per
stored vector, i.e. per token and KV head for K and for V (dense attention), per token for an MLA
latent. The value of an element is ``fp8(data) * scale``.

Why per token (and head) rather than per page: pages fill one token at a time and are shared by
the prefix cache, so a page's range is not known when its first token is written; a per-token
scale is computed from the vector being written (``amax / 448``) and never changes, so a
quantized entry is final on write and identical whichever request wrote it. The cost is the
scale bytes (4 per vector) in the bytes-per-token formula of :mod:`tokenmill.contracts.kv`.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)   # 448
_TINY = 1e-12                           # scale floor for all-zero vectors


class FP8Pages(NamedTuple):
    data: torch.Tensor    # uint8 bytes of float8_e4m3fn values, [..., D]
    scale: torch.Tensor   # fp32, data.shape[:-1]


def fp8_supported(device: torch.device) -> bool:
    """Whether this torch build converts to and from float8_e4m3fn on ``device``."""
    try:
        x = torch.ones(2, device=device).to(FP8)
        return bool(x.view(torch.uint8).view(FP8).float().sum().item() == 2.0)
    except (RuntimeError, TypeError):
        return False


def allocate_fp8(shape: tuple[int, ...], device: torch.device) -> FP8Pages:
    return FP8Pages(torch.zeros(shape, dtype=torch.uint8, device=device),
                    torch.zeros(shape[:-1], dtype=torch.float32, device=device))


def quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(bytes uint8, scale fp32)`` of ``x`` with one scale per vector over the last dimension."""
    xf = x.float()
    scale = (xf.abs().amax(dim=-1) / FP8_MAX).clamp_min(_TINY)
    q = (xf / scale.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q.view(torch.uint8), scale


def dequantize(data: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (data.view(FP8).float() * scale.unsqueeze(-1)).to(dtype)


def write_fp8(pages: FP8Pages, slots: torch.Tensor, x: torch.Tensor) -> None:
    """Store ``x`` [T, ..., D] at flat slots (the first two dims of the pool are pages x offsets)."""
    q, scale = quantize(x)
    d = pages.data.shape[-1]
    inner = tuple(pages.data.shape[2:-1])
    pages.data.view(-1, *inner, d).index_copy_(0, slots, q)
    pages.scale.view(-1, *inner).index_copy_(0, slots, scale)
