"""The linear-method interface: every weight matmul of a model goes through a :class:`LinearMethod`.

A linear method owns one weight matrix ``W [out_features, in_features]`` in some storage format
and computes ``y = x @ W^T (+ bias)``. Models hold one per matmul (``qkv_proj``, ``o_proj``,
``gate_up_proj``, ``down_proj``, ``lm_head``, MoE experts) and call it like a function; they never
look inside. Formats:

- :class:`DenseLinear` (this module): fp32 / bf16 / fp16 weights through ``F.linear``; the
  correctness oracle.
- :class:`OneDNNLinear` (this module): an fp32 weight reordered once into oneDNN's blocked layout
  and run by oneDNN's inner product. On x86 CPUs it is 1.8x-3x faster than ``F.linear`` (MKL
  sgemm) from batch 1 to 1,024 rows (``benchmarks/linear_fp32.py``). The model runner converts a
  model's fp32 dense methods to it on CPU (``--linear-backend``, :func:`select_linear_backend`).
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

__all__ = ["DenseLinear", "LINEAR_BACKENDS", "LinearMethod", "OneDNNLinear", "as_linear", "onednn_available",
           "onednn_linear", "onednn_pack",
           "select_linear_backend", "use_linear_backend"]


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


# --- oneDNN (mkldnn) prepacked fp32 weights ------------------------------------------------------

LINEAR_BACKENDS = ("auto", "torch", "onednn")
ONEDNN_PACK_ROWS = 16   # the batch size the blocked layout is chosen for (measured: 8..512 pack alike,
                        # 1 packs worse for every batch above 1)


def onednn_available() -> bool:
    """Whether this torch build can reorder and run oneDNN linear weights."""
    try:
        return (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")
                and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"))
    except (AttributeError, RuntimeError):
        return False


def onednn_pack(weight: torch.Tensor, rows: int = ONEDNN_PACK_ROWS) -> torch.Tensor:
    """``weight`` [N, K] reordered once into oneDNN's blocked layout, chosen for ``rows`` rows."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), rows)


def onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight^T (+ bias)`` by oneDNN's inner product; ``weight`` plain or from :func:`onednn_pack`.
    The one place tokenmill calls oneDNN's linear (the fp32 method here, the packed MoE experts,
    the quantized formats' prefill GEMM)."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


class OneDNNLinear(LinearMethod):
    """An fp32 weight held in oneDNN's blocked layout (an opaque ``torch._mkldnn`` tensor).

    The layout is chosen once for :data:`ONEDNN_PACK_ROWS` rows; any number of rows runs on it.
    The plain weight is not kept (``dequantize`` reorders back, exactly) unless the method is also
    an embedding table (a tied ``lm_head``), whose rows are looked up every step. Results differ
    from ``F.linear``'s by float rounding only (a different summation order).
    """

    format = "onednn"

    def __init__(self, weight: torch.Tensor, keep_dense: bool = False) -> None:
        if weight.dtype != torch.float32 or weight.device.type != "cpu":
            raise ValueError(f"OneDNNLinear takes an fp32 CPU weight, got {weight.dtype} on {weight.device}")
        super().__init__(*weight.shape)
        w = weight.detach().contiguous()
        self.register_buffer("packed", onednn_pack(w), persistent=False)
        self.dense = w if keep_dense else None

    @property
    def dtype(self) -> torch.dtype:
        return torch.float32

    def forward(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if x.dtype != torch.float32:
            x = x.float()
        return onednn_linear(x.contiguous(), self.packed, bias)

    def dequantize(self) -> torch.Tensor:
        return self.dense if self.dense is not None else self.packed.to_dense()

    def weight_bytes(self) -> int:
        return self.out_features * self.in_features * 4

    def select_rows(self, index: torch.Tensor) -> "DenseLinear":
        return DenseLinear(self.dequantize()[index])

    def embedding(self, ids: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return F.embedding(ids, self.dequantize()).to(dtype)

    def can_cat(self, other: LinearMethod) -> bool:
        return isinstance(other, OneDNNLinear)

    @classmethod
    def cat_rows(cls, parts: Sequence[LinearMethod]) -> "OneDNNLinear":
        return OneDNNLinear(torch.cat([p.dequantize() for p in parts], dim=0))

    def __deepcopy__(self, memo: dict) -> "OneDNNLinear":
        # the opaque packed tensor has no storage to copy: repack from the plain rows
        return OneDNNLinear(self.dequantize().clone(), keep_dense=self.dense is not None)

    def extra_repr(self) -> str:
        return f"onednn fp32, out={self.out_features}, in={self.in_features}"


def select_linear_backend(name: str, device: torch.device | str, dtype: torch.dtype) -> str:
    """``auto`` -> ``onednn`` for fp32 on a CPU whose torch has oneDNN, else ``torch``; an explicit
    ``onednn`` that cannot run is refused with the reason."""
    if name not in LINEAR_BACKENDS:
        raise ValueError(f"linear backend must be one of {', '.join(LINEAR_BACKENDS)}, got {name!r}")
    dev = torch.device(device)
    fits = dev.type == "cpu" and dtype == torch.float32 and onednn_available()
    if name == "auto":
        return "onednn" if fits else "torch"
    if name == "onednn" and not fits:
        why = ("this torch build has no oneDNN" if not onednn_available()
               else f"it runs fp32 weights on CPU only (device {dev}, dtype {dtype})")
        raise ValueError(f"linear backend 'onednn' is not available: {why}")
    return name


def use_linear_backend(model: nn.Module, backend: str) -> int:
    """Convert ``model``'s fp32 dense methods in place: ``onednn`` packs every fp32
    :class:`DenseLinear`, ``torch`` unpacks every :class:`OneDNNLinear` back. A method shared by
    two attributes (a tied embedding and head) is converted once, stays shared and keeps its plain
    rows for the embedding lookup. Returns how many distinct methods changed."""
    refs: dict[int, int] = {}
    for parent in model.modules():
        for child in parent._modules.values():
            if isinstance(child, LinearMethod):
                refs[id(child)] = refs.get(id(child), 0) + 1
    done: dict[int, LinearMethod] = {}
    for parent in list(model.modules()):
        for name, child in list(parent._modules.items()):
            if not isinstance(child, LinearMethod):
                continue
            if id(child) not in done:
                new: LinearMethod = child
                if backend == "onednn" and isinstance(child, DenseLinear) and child.dtype == torch.float32 \
                        and child.weight.device.type == "cpu":
                    new = OneDNNLinear(child.weight.detach(), keep_dense=refs[id(child)] > 1)
                elif backend == "torch" and isinstance(child, OneDNNLinear):
                    new = DenseLinear(child.dequantize())
                done[id(child)] = new
            setattr(parent, name, done[id(child)])
    return sum(1 for k, v in done.items() if id(v) != k)
