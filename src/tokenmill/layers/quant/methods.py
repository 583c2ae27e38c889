"""Choosing and applying a weight format for a whole model.

:class:`QuantConfig` is what ``--quantization`` / ``--quant-group-size`` / ``--quant-symmetric``
ask for. :func:`apply_quantization` replaces every dense linear method of a loaded model by its
quantized form: int8 is symmetric per output channel; int4 is group-wise (default 128 inputs per
group, asymmetric scale + min unless ``symmetric``), with the output head and a tied embedding
table kept at int8 per channel (as llama.cpp's 4-bit files keep theirs at 6 or 8 bits).

:func:`finalize_linears` runs after loading: when the native kernels are missing (no compiler at
install time) it dequantizes every quantized method back to dense fp32, once, with a warning, so a
model always runs.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
from torch import nn

from tokenmill._native import quant as native
from tokenmill.layers.linear import DenseLinear, LinearMethod, as_linear
from tokenmill.layers.quant.packed import Int4Linear, Int8Linear, _Packed

log = logging.getLogger(__name__)

QUANTIZATION_CHOICES = ("auto", "none", "int8", "int4")
HEAD_NAMES = ("lm_head", "embed_tokens")  # output head / embedding table: int8 even under int4


@dataclass(frozen=True)
class QuantConfig:
    """``method``: auto (a GGUF file in its own block types, an HF checkpoint unquantized), none
    (everything dense in the model dtype: the fp32 oracle), int8 or int4 (quantize at load)."""

    method: str = "auto"
    group_size: int = 128
    symmetric: bool = False

    def __post_init__(self) -> None:
        if self.method not in QUANTIZATION_CHOICES:
            raise ValueError(f"quantization must be one of {', '.join(QUANTIZATION_CHOICES)}, got {self.method!r}")
        if self.group_size <= 0 or self.group_size % 32:
            raise ValueError(f"quantization group size must be a positive multiple of 32, got {self.group_size}")

    @classmethod
    def of(cls, q: "QuantConfig | str | None") -> "QuantConfig":
        if q is None:
            return cls()
        return q if isinstance(q, QuantConfig) else cls(method=q)


def replace_linears(model: nn.Module, fn: Callable[[str, LinearMethod], LinearMethod]) -> int:
    """Replace each linear method ``m`` under ``model`` (child name ``name``) by ``fn(name, m)``;
    a method shared by two attributes (tied embedding and head) is converted once and stays shared.
    Returns how many distinct methods changed."""
    done: dict[int, LinearMethod] = {}
    changed = 0
    for parent in list(model.modules()):
        for name, child in list(parent._modules.items()):
            if not isinstance(child, LinearMethod):
                continue
            if id(child) not in done:
                new = fn(name, child)
                done[id(child)] = new
                changed += new is not child
            setattr(parent, name, done[id(child)])
    return changed


def _quantizer(cfg: QuantConfig) -> Callable[[str, LinearMethod], LinearMethod]:
    def convert(name: str, m: LinearMethod) -> LinearMethod:
        if not isinstance(m, DenseLinear):
            return m  # already quantized (a GGUF block type): keep it
        w = m.weight.detach().float()
        if cfg.method == "int8" or name in HEAD_NAMES:
            return Int8Linear.from_float(w)
        k = w.shape[1]
        group = min(cfg.group_size, (k + 31) // 32 * 32)
        return Int4Linear.from_float(w, group_size=group, symmetric=cfg.symmetric)
    return convert


def apply_quantization(model: nn.Module, cfg: QuantConfig) -> None:
    """Quantize ``model``'s dense linear methods as ``cfg`` says (no-op for auto and none)."""
    if cfg.method in ("int8", "int4"):
        if not any(isinstance(m, LinearMethod) for m in model.modules()):
            from tokenmill.contracts.errors import ModelLoadError

            raise ModelLoadError(f"{type(model).__name__} does not run its weights through linear methods, so "
                                 f"quantization {cfg.method!r} is not available for it; use 'auto' or 'none'")
        n = replace_linears(model, _quantizer(cfg))
        log.info("quantized %d weight matrices to %s", n, cfg.method)


def dequantize_linears(model: nn.Module, dtype: torch.dtype) -> int:
    """Every quantized method -> dense ``dtype`` (exact dequantized values)."""
    return replace_linears(model, lambda _n, m: m if isinstance(m, DenseLinear) else
                           DenseLinear(m.dequantize().to(dtype)))


def finalize_linears(model: nn.Module, dtype: torch.dtype) -> None:
    """Fall back to dense weights when the native kernels are not available."""
    if native.available():
        return
    n = dequantize_linears(model, dtype)
    if n:
        log.warning("quantized weights are served as dense %s because %s", str(dtype).removeprefix("torch."),
                    native.unavailable_reason())


def packed_weights(model: nn.Module) -> bool:
    """Whether ``model`` serves any weight matrix in a packed (quantized) format."""
    return any(isinstance(m, _Packed) for m in model.modules())


def weight_bytes(model: nn.Module) -> int:
    """Bytes of all distinct linear-method weights (what one decode step reads)."""
    seen: set[int] = set()
    total = 0
    for m in model.modules():
        if isinstance(m, LinearMethod) and id(m) not in seen:
            seen.add(id(m))
            total += m.weight_bytes()
    return total


def cat_linears(parts: Sequence["torch.Tensor | LinearMethod"], dtype: torch.dtype) -> LinearMethod:
    """One linear method stacking the rows of ``parts`` (fused q/k/v, gate/up).

    Parts in one format are concatenated exactly. Mixed formats (a GGUF file may store q and v in
    different types) fall back to the most precise representation that holds all of them: dense
    ``dtype`` when any part is dense, else 8-bit groups of 32 (``Int8Linear.from_float``).
    """
    methods = [as_linear(p, dtype) for p in parts]
    first = methods[0]
    if len(methods) == 1:
        return first
    if all(first.can_cat(m) for m in methods[1:]):
        return type(first).cat_rows(methods)
    if any(isinstance(m, DenseLinear) for m in methods):
        return DenseLinear(torch.cat([m.dequantize().to(dtype) for m in methods], dim=0))
    return Int8Linear.from_float(torch.cat([m.dequantize() for m in methods], dim=0), group_size=32)
