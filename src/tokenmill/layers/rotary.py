"""Rotary position embedding: the "rotate half" form of HF Llama / Qwen and the interleaved-pair
form of DeepSeek (``rope_interleave``).

The cos/sin table is computed once in fp32 from the inverse frequencies and grown on demand, so
a forward pass only gathers rows by position. The values equal HF's: ``pos * inv_freq`` is one
fp32 product either way, and YaRN's attention factor multiplies cos and sin as HF does.
"""
from __future__ import annotations

import math
from typing import Any, Mapping, NamedTuple

import torch
from torch import nn

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction ``0.1 * mscale * ln(factor) + 1`` (1 when not extending)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def rope_attention_factor(scaling: Mapping[str, Any] | None) -> float:
    """The factor HF multiplies cos and sin by (YaRN only; 1.0 for every other type)."""
    if (scaling or {}).get("rope_type", (scaling or {}).get("type")) != "yarn":
        return 1.0
    assert scaling is not None
    given = scaling.get("attention_factor")
    if given is not None:
        return float(given)
    factor = float(scaling["factor"])
    mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
    if mscale and mscale_all_dim:
        return yarn_mscale(factor, float(mscale)) / yarn_mscale(factor, float(mscale_all_dim))
    return yarn_mscale(factor)


def _yarn_inv_freq(head_dim: int, theta: float, scaling: Mapping[str, Any]) -> torch.Tensor:
    """NTK-by-parts interpolation: extrapolate the fast dimensions, interpolate the slow ones,
    with a linear ramp between the correction dimensions of ``beta_fast`` / ``beta_slow``."""
    factor = float(scaling["factor"])
    old_len = float(scaling["original_max_position_embeddings"])
    beta_fast = float(scaling.get("beta_fast") or 32)
    beta_slow = float(scaling.get("beta_slow") or 1)

    def correction_dim(rotations: float) -> float:
        return head_dim * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001
    pos_freqs = theta ** (torch.arange(0, head_dim, 2).float() / head_dim)
    extrapolated, interpolated = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    ramp = torch.clamp((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    keep = 1 - ramp  # share of the extrapolated (unscaled) frequency
    return interpolated * (1 - keep) + extrapolated * keep


def rope_inv_freq(head_dim: int, theta: float, scaling: Mapping[str, Any] | None) -> torch.Tensor:
    """Inverse frequencies ``[head_dim // 2]`` for ``rope_type`` in :data:`SUPPORTED_ROPE_TYPES`.

    ``scaling`` is HF's ``rope_parameters`` / ``rope_scaling`` dict (or None for plain RoPE).
    """
    rope_type = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if rope_type == "yarn":
        assert scaling is not None
        return _yarn_inv_freq(head_dim, theta, scaling)
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


class RotaryEmbedding(nn.Module):
    """Cos/sin table by position, shared by all layers of a model.

    The tables are non-persistent buffers, so they move with the model (``model.to(device)``)
    and are grown on the same device when a longer position arrives.
    """

    def __init__(self, head_dim: int, theta: float, scaling: Mapping[str, Any] | None,
                 initial_positions: int = 4096) -> None:
        super().__init__()
        if head_dim % 2:
            raise ValueError(f"rotary head_dim must be even, got {head_dim}")
        self.head_dim = head_dim
        self.attention_factor = rope_attention_factor(scaling)
        self.register_buffer("inv_freq", rope_inv_freq(head_dim, theta, scaling), persistent=False)
        self.register_buffer("cos_table", torch.empty(0, head_dim), persistent=False)
        self.register_buffer("sin_table", torch.empty(0, head_dim), persistent=False)
        self._grow(initial_positions)

    def _grow(self, n: int) -> None:
        dev = self.inv_freq.device
        freqs = torch.arange(n, dtype=torch.int64, device=dev).float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos_table, self.sin_table = emb.cos(), emb.sin()
        if self.attention_factor != 1.0:
            self.cos_table, self.sin_table = self.cos_table * self.attention_factor, self.sin_table * self.attention_factor

    def ensure(self, num_positions: int) -> None:
        """Make the tables hold at least ``num_positions`` rows (called by the model runner,
        which knows the step's largest position without reading the positions tensor)."""
        if num_positions > self.cos_table.shape[0]:
            self._grow(max(2 * self.cos_table.shape[0], num_positions))

    def lookup(self, positions: torch.Tensor, dtype: torch.dtype, num_positions: int = 0) -> CosSin:
        """Rows for ``positions`` ([T] int64). ``num_positions`` (> every position, when the
        caller knows it) saves reading the positions back to find the largest."""
        if not num_positions and positions.numel():
            num_positions = int(positions.max()) + 1
        self.ensure(num_positions)
        cos, sin = self.cos_table[positions], self.sin_table[positions]
        if cos.dtype != dtype:
            cos, sin = cos.to(dtype), sin.to(dtype)
        return CosSin(cos.unsqueeze(1), sin.unsqueeze(1))


def apply_rotary(x: torch.Tensor, cs: CosSin) -> torch.Tensor:
    """Rotate ``x`` [T, heads, head_dim] by the per-token angles in ``cs``."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cs.cos + rotated * cs.sin


def apply_rotary_interleaved(x: torch.Tensor, cs: CosSin) -> torch.Tensor:
    """DeepSeek's layout: dimensions ``(0, 1), (2, 3), ...`` are pairs rotated by one angle each.

    The result is written de-interleaved (all first elements of the pairs, then all second
    elements), as HF does; queries and keys go through the same map, so their dot products are
    those of the interleaved rotation.
    """
    half = x.shape[-1] // 2
    cos, sin = cs.cos[..., :half], cs.sin[..., :half]
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
