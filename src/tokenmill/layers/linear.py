"""The linear-method interface: every weight matmul of a model goes through a :class:`LinearMethod`.

A linear method owns one weight matrix ``W [out_features, in_features]`` in some storage format
and computes ``y = x @ W^T (+ bias)``. Models hold one per matmul (``qkv_proj``, ``o_proj``,
``gate_up_proj``, ``down_proj``, ``lm_head``, MoE experts) and call it like a function; they never
look inside. Formats:

- :class:`DenseLinear` (this module): fp32 / bf16 / fp16 weights through ``F.linear``; the
  correctness oracle.
- ``tokenmill.layers.quant.packed``: 8-bit (:class:`~tokenmill.layers.quant.packed.Int8Linear`) and
  4-bit (:class:`~tokenmill.layers.quant.packed.Int4Linear`) group-wise weights run by the native
  kernels; GGUF Q8_0 / Q4_0 / Q4_1 / Q4_K (``layers/quant/gguf.py``) and tokenmill's own
  ``--quantization int8 / int4`` (``layers/quant/methods.py``) are repacked into them.

Besides the matmul a method gives back its weight in fp32 (``dequantize``, for HF oracle tests
and ``hf_state_dict``), rows of it (``embedding``, for a tied embedding table), row selections
and concatenations (the loader fuses q/k/v and gate/up and undoes llama.cpp's Q/K permutation on
quantized rows), and its size in bytes.
"""
from __future__ import annotations

import abc
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["DenseLinear", "LinearMethod", "as_linear"]


class LinearMethod(nn.Module, abc.ABC):
    """``y = x @ W^T (+ bias)`` for one weight ``W [out_features, in_features]`` in one format."""

    format: str = "?"

    def __init__(self, out_features: int, in_features: int) -> None:
        super().__init__()
        self.out_features = int(out_features)
        self.in_features = int(in_features)

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.out_features, self.in_features))

    @abc.abstractmethod
    def forward(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """``y = x @ W^T (+ bias)`` in fp32 or the input dtype."""

    @abc.abstractmethod
    def dequantize(self) -> torch.Tensor:
        """``W`` in fp32 ``[out_features, in_features]`` (a fresh tensor, or the weight itself for
        a dense fp32 method)."""

    @abc.abstractmethod
    def select_rows(self, index: torch.Tensor) -> "LinearMethod":
        """A method of the same format holding rows ``index`` of ``W`` (exact, no requantization)."""

    def weight_bytes(self) -> int:
        """Bytes one full pass over the weight reads (what bounds batch-1 decode)."""
        return sum(t.numel() * t.element_size() for t in self.buffers(recurse=False)) + sum(
            p.numel() * p.element_size() for p in self.parameters(recurse=False))

    def embedding(self, ids: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Rows ``ids`` of ``W`` (an embedding lookup from a table stored in this format)."""
        return self.select_rows(ids.reshape(-1)).dequantize().to(dtype).reshape(*ids.shape, self.in_features)

    def can_cat(self, other: "LinearMethod") -> bool:
        """Whether ``cat_rows([self, other])`` keeps both exactly in this format."""
        return False

    @classmethod
    def cat_rows(cls, parts: Sequence["LinearMethod"]) -> "LinearMethod":
        """One method of this format whose rows are the parts' rows, in order."""
        raise TypeError(f"{cls.__name__} does not define cat_rows")

    def extra_repr(self) -> str:
        return f"{self.format}, out={self.out_features}, in={self.in_features}"


class DenseLinear(LinearMethod):
    """Unquantized weight (the model's dtype) through ``F.linear``."""

    format = "dense"

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__(*weight.shape)
        self.weight = nn.Parameter(weight.contiguous(), requires_grad=False)

    @classmethod
    def empty(cls, out_features: int, in_features: int, dtype: torch.dtype) -> "DenseLinear":
        return cls(torch.empty(out_features, in_features, dtype=dtype))

    @property
    def dtype(self) -> torch.dtype:
        return self.weight.dtype

    def forward(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return F.linear(x, self.weight, bias)

    def dequantize(self) -> torch.Tensor:
        return self.weight.detach().float().clone() if self.weight.dtype != torch.float32 else self.weight.detach()

    def select_rows(self, index: torch.Tensor) -> "DenseLinear":
        return DenseLinear(self.weight.detach()[index])

    def embedding(self, ids: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return F.embedding(ids, self.weight).to(dtype)

    def can_cat(self, other: LinearMethod) -> bool:
        return isinstance(other, DenseLinear) and other.weight.dtype == self.weight.dtype

    @classmethod
    def cat_rows(cls, parts: Sequence[LinearMethod]) -> "DenseLinear":
        return DenseLinear(torch.cat([p.weight.detach() for p in parts], dim=0))  # type: ignore[attr-defined]

    def extra_repr(self) -> str:
        return f"dense {str(self.weight.dtype).removeprefix('torch.')}, out={self.out_features}, in={self.in_features}"


def as_linear(w: "torch.Tensor | LinearMethod", dtype: torch.dtype) -> LinearMethod:
    """A linear method for a loader's weight: a tensor becomes a dense weight in ``dtype``; a
    quantized method stays as it is."""
    if isinstance(w, LinearMethod):
        return w
    return DenseLinear(w.to(dtype))
