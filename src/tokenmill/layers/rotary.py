"""Rotary position embedding (the "rotate half" form of HF Llama / Qwen).

The cos/sin table is computed once in fp32 from the inverse frequencies and grown on demand, so
a forward pass only gathers rows by position. The values equal HF's: ``pos * inv_freq`` is one
fp32 product either way.
"""
from __future__ import annotations

import math
from typing import Any, Mapping, NamedTuple

import torch

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


def rope_inv_freq(head_dim: int, theta: float, scaling: Mapping[str, Any] | None) -> torch.Tensor:
    """Inverse frequencies ``[head_dim // 2]`` for ``rope_type`` in :data:`SUPPORTED_ROPE_TYPES`.

    ``scaling`` is HF's ``rope_parameters`` / ``rope_scaling`` dict (or None for plain RoPE).
    """
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    rope_type = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if rope_type == "default":
        return inv_freq
    assert scaling is not None
    if rope_type == "linear":
        return inv_freq / float(scaling["factor"])
    if rope_type == "llama3":
        factor = float(scaling["factor"])
        low = float(scaling["low_freq_factor"])
        high = float(scaling["high_freq_factor"])
        old_len = float(scaling["original_max_position_embeddings"])
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, scaled)
    raise ValueError(f"unsupported rope_type {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}")


class CosSin(NamedTuple):
    cos: torch.Tensor  # [T, 1, head_dim], broadcast over heads
    sin: torch.Tensor


class RotaryEmbedding:
    """Cos/sin table by position; shared by all layers of a model (plain object, no weights)."""

    def __init__(self, head_dim: int, theta: float, scaling: Mapping[str, Any] | None,
                 initial_positions: int = 4096) -> None:
        if head_dim % 2:
            raise ValueError(f"rotary head_dim must be even, got {head_dim}")
        self.head_dim = head_dim
        self.inv_freq = rope_inv_freq(head_dim, theta, scaling)
        self._cos = torch.empty(0, head_dim)
        self._sin = torch.empty(0, head_dim)
        self._grow(initial_positions)

    def _grow(self, n: int) -> None:
        freqs = torch.arange(n, dtype=torch.int64).float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self._cos, self._sin = emb.cos(), emb.sin()

    def lookup(self, positions: torch.Tensor, max_position: int, dtype: torch.dtype) -> CosSin:
        """Rows for ``positions`` ([T] int64); ``max_position`` is ``positions.max()``."""
        if max_position >= self._cos.shape[0]:
            self._grow(max(2 * self._cos.shape[0], max_position + 1))
        cos, sin = self._cos[positions], self._sin[positions]
        if cos.dtype != dtype:
            cos, sin = cos.to(dtype), sin.to(dtype)
        return CosSin(cos.unsqueeze(1), sin.unsqueeze(1))


def apply_rotary(x: torch.Tensor, cs: CosSin) -> torch.Tensor:
    """Rotate ``x`` [T, heads, head_dim] by the per-token angles in ``cs``."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cs.cos + rotated * cs.sin
