"""Fused decode through Llama-style layers: one native call for a run of whole layers.

At batch 1 the weight matmuls of the default model take about half of a decode step when each
small op between them (RMSNorm, rotary, the KV write, SiLU*up, residual adds) is its own torch
call issued from Python. :class:`FusedDecodeStack` hands a step's hidden states to
``decode_layers`` in ``tokenmill/_native/decoder.c``, which runs norm, QKV, rotary, the KV write,
paged attention, the output projection and the MLP of every layer in C, in one OpenMP region,
with the same integer kernels as the per-matrix path (packed weights) or its own fp32 GEMV
kernel (unquantized weights), and the native paged-attention kernel.

It applies when (:meth:`FusedDecodeStack.unsupported_reason` says why not otherwise):

- every matrix of every layer is packed (:class:`~tokenmill.layers.quant.packed.Int4Linear` or
  :class:`~tokenmill.layers.quant.packed.Int8Linear`, any mix) or unquantized fp32 on the CPU
  (:class:`~tokenmill.layers.linear.DenseLinear` or
  :class:`~tokenmill.layers.linear.OneDNNLinear`), the model is fp32 and has no per-head q/k norm;
- the attention backend is the native paged one over fp32, bf16, fp16 or fp8 pages (fp8: static or
  per-token scales; the step's K/V are quantized in C to the same bytes and scales the torch
  path's ``write_fp8`` stores: x / scale saturated at +-448, rounded to nearest even);
- the step has at most :func:`~tokenmill.layers.quant.packed.gemv_max_rows` token rows for
  packed matrices (larger steps keep the dequantize + GEMM path) and no forced activation mode,
  and at most :func:`fused_fp32_max_rows` for fp32 ones (larger steps keep oneDNN's GEMM).

A packed output head (a GGUF Q8_0 / Q4 head, or int8 / int4) joins the call as well
(:meth:`FusedDecodeStack.set_head`): after the last layer the same parallel region applies the
final RMSNorm to the rows that need logits and runs the head's integer kernel, instead of a
torch norm and a second native call (and, with two threads, a second fork) from Python. Each
layer's KV pages are prefetched during the previous layer's gate_up and down matmuls
(``decoder.c``, ``KvPf``), except on Intel CPUs, where that measured slower from 2k tokens of
context on (``TOKENMILL_KV_PREFETCH=1`` / ``TOKENMILL_NO_KV_PREFETCH=1`` turn it on / off on any
CPU; ``tokenmill._native.quant.decode_kv_prefetch()`` says which).

The results equal the layer-by-layer path up to float summation order (RMSNorm's sum, the
residual adds, the fp32 dot products): packed matrices see the same int16-quantized activations
and kernels. Memory: the fp32 kernel reads plain ``[N, K]`` rows, while oneDNN keeps its weights
in a blocked layout for prefill, so an fp32 model on the fused path holds its layer weights
twice (the default model: +425 MB); ``set_fused_decode(False)`` on the model gives that back
only together with the speed.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch

from tokenmill._native import attention as attention_kernel
from tokenmill._native import quant as native
from tokenmill.layers.attention.fp8 import FP8Pages
from tokenmill.layers.attention.native import NativeMetadata, NativePagedAttention, kv_kind, kv_pointers
from tokenmill.layers.linear import DenseLinear, LinearMethod, OneDNNLinear
from tokenmill.layers.quant import packed
from tokenmill.layers.quant.packed import Int4Linear, Int8Linear

# one layer row of int64 values, in decoder.c's order
_NORM1, _NORM2, _QKV_BIAS, _K_CACHE, _V_CACHE, _K_SCALE, _V_SCALE, _MATS = range(8)
_MAT_FIELDS = 8  # kind, qs, scales, mins, f16, N, K, group
_LAYER_FIELDS = _MATS + 4 * _MAT_FIELDS
_U4, _S8, _F32 = 0, 1, 2
FUSED_FP32_MAX_ROWS = 4   # fp32 stacks: token rows up to which a step runs fused (more go layer by layer
                          # through oneDNN's GEMM), on kernel sets without an entry below: on an AVX2
                          # host oneDNN was ahead from about 5 rows (benchmarks/fused_decode_ab.py:
                          # 1.41x / 1.06x / 0.79x oneDNN at 1 / 4 / 8 rows)
# ... and on the sets whose fp32 GEMV is 512 bits wide. There, on an Intel host with AMX, the fused
# step stayed ahead of oneDNN (AVX-512) up to 16 rows (1.33x at 5 rows, 1.19x at 8, 1.05x at 16:
# docs/benchmarks.md, "fp32 verify and batch steps"), but it stops at 8: fused and GEMM rows differ
# in summation order, and the 9-row chunk of tests/models/test_batch_invariance.py, alone (fused
# at a limit of 16) against inside a batch of 32 (GEMM), then differed by 1.05e-5, past that
# test's 1e-5
FUSED_FP32_MAX_ROWS_BY_KERNEL = {"amx": 8, "avx512vnni": 8}


def fused_fp32_max_rows() -> int:
    """Token rows up to which a step of an fp32 stack runs fused on the kernel set in use."""
    return FUSED_FP32_MAX_ROWS_BY_KERNEL.get(native.kernel(), FUSED_FP32_MAX_ROWS)


@dataclass(frozen=True)
class DecoderLayerWeights:
    """What the fused path reads from one Llama-style decoder layer."""

    input_norm: torch.Tensor      # [H] fp32
    post_norm: torch.Tensor       # [H] fp32
    qkv: LinearMethod             # [(hq + 2 hkv) * d, H], q then k then v rows
    qkv_bias: torch.Tensor | None
    o: LinearMethod               # [H, hq * d]
    gate_up: LinearMethod         # [2 I, H], gate rows then up rows
    down: LinearMethod            # [H, I]


def _dense_fp32(m: LinearMethod) -> bool:
    """An unquantized fp32 CPU matrix: plain, or oneDNN-packed (always fp32 on the CPU), whose
    plain rows ``dequantize`` gives back."""
    if isinstance(m, DenseLinear):
        return m.weight.dtype == torch.float32 and m.weight.device.type == "cpu"
    return isinstance(m, OneDNNLinear)


def _mat_fields(m: LinearMethod, keep: list[torch.Tensor]) -> list[int]:
    if _dense_fp32(m):
        # the kernel reads plain [N, K] rows; a oneDNN-packed weight keeps its packed copy for
        # prefill and this plain copy for decode (see the module docstring on memory)
        w = m.dequantize().detach().contiguous()
        keep.append(w)
        return [_F32, w.data_ptr(), 0, 0, 0, m.out_features, m.in_features, m.in_features]
    if isinstance(m, Int4Linear):
        return [_U4, m.qs.data_ptr(), m.scales.data_ptr(), m.mins.data_ptr(), int(m.scales.dtype == torch.float16),
                m.out_features, m.in_features, m.group_size]
    assert isinstance(m, Int8Linear)
    return [_S8, m.qs.data_ptr(), m.scales.data_ptr(), 0, int(m.scales.dtype == torch.float16),
            m.out_features, m.in_features, m.group_size]


class FusedDecodeStack:
    """The native decode path over a model's layers (see the module docstring)."""

    def __init__(self, layers: Sequence[DecoderLayerWeights], *, hidden: int, num_heads: int, num_kv_heads: int,
                 head_dim: int, intermediate: int, eps: float, scale: float) -> None:
        self.layers = list(layers)
        self.hidden, self.hq, self.hkv, self.d = hidden, num_heads, num_kv_heads, head_dim
        self.inter, self.eps, self.scale = intermediate, float(eps), float(scale)
        self._keep: list[torch.Tensor] = []   # contiguous fp32 copies the table points into
        mats = [m for layer in self.layers for m in (layer.qkv, layer.o, layer.gate_up, layer.down)]
        self.dense = any(_dense_fp32(m) for m in mats)      # fp32 matrices (an unquantized model)
        self.packed = any(not _dense_fp32(m) for m in mats)  # int4 / int8 matrices
        rows = []
        for layer in self.layers:
            row = [0] * _LAYER_FIELDS
            row[_NORM1] = self._ptr(layer.input_norm)
            row[_NORM2] = self._ptr(layer.post_norm)
            row[_QKV_BIAS] = 0 if layer.qkv_bias is None else self._ptr(layer.qkv_bias)
            for i, m in enumerate((layer.qkv, layer.o, layer.gate_up, layer.down)):
                row[_MATS + i * _MAT_FIELDS:_MATS + (i + 1) * _MAT_FIELDS] = _mat_fields(m, self._keep)
            rows.append(row)
        self._table = torch.tensor(rows, dtype=torch.int64).reshape(len(rows), _LAYER_FIELDS)
        self._kv: Sequence[Any] | None = None
        self._kv_ptrs: tuple[Any, ...] = ()
        self._head: torch.Tensor | None = None   # the output head's fields (set_head)
        self._head_norm = 0
        self._head_out = 0
        self._embed: torch.Tensor | None = None   # the embedding's fields (set_embedding)

    def set_head(self, norm: torch.Tensor, head: LinearMethod) -> bool:
        """Let a run through the last layer end with the final RMSNorm (weight ``norm``, this
        stack's eps) and the output head, in the same native call (:meth:`run`'s
        ``logits_rows``). Packed heads only (a GGUF Q8_0 or Q4 head, int8 / int4): the same
        kernel and int16 activations as the head's own forward, so the logits differ from the
        torch path's only by RMSNorm's summation order. Returns whether it took the head."""
        self._head = None
        if not isinstance(head, (Int4Linear, Int8Linear)) or head.in_features != self.hidden:
            return False
        self._head_norm = self._ptr(norm)
        self._head = torch.tensor(_mat_fields(head, self._keep), dtype=torch.int64)
        self._head_out = head.out_features
        return True

    @property
    def has_head(self) -> bool:
        return self._head is not None

    def set_embedding(self, embed: LinearMethod) -> bool:
        """The token embedding, for chained steps (:meth:`run_steps`): packed rows (int4 / int8,
        dequantized in C as the embedding's own ``embedding`` does) or plain fp32 rows. Returns
        whether it took the embedding."""
        self._embed = None
        if isinstance(embed, (Int4Linear, Int8Linear)):
            fields = _mat_fields(embed, self._keep)
        elif (isinstance(embed, DenseLinear) and embed.weight.dtype == torch.float32
              and embed.weight.device.type == "cpu" and embed.weight.is_contiguous()):
            w = embed.weight.detach()
            self._keep.append(w)   # its rows in place, no copy
            fields = [_F32, w.data_ptr(), 0, 0, 0, embed.out_features, embed.in_features, embed.in_features]
        else:
            return False
        if embed.in_features != self.hidden:
            return False
        self._embed = torch.tensor(fields, dtype=torch.int64)
        return True

    @property
    def chains(self) -> bool:
        """Whether :meth:`run_steps` can run here (the head and the embedding are set)."""
        return self._head is not None and self._embed is not None

    def _ptr(self, t: torch.Tensor) -> int:
        t = t.detach().float().contiguous()
        self._keep.append(t)
        return t.data_ptr()

    @staticmethod
    def unsupported_reason(layers: Sequence[DecoderLayerWeights], dtype: torch.dtype) -> str | None:
        """Why these layers cannot take the fused path (None when they can)."""
        if not native.available():
            return native.unavailable_reason()
        if not attention_kernel.available():
            return attention_kernel.unavailable_reason()
        if native.layer_fields() != _LAYER_FIELDS:
            return "the native module was built from another version of decoder.c; rebuild it"
        if dtype != torch.float32:
            return f"it runs fp32 models only, not {dtype}"
        for i, layer in enumerate(layers):
            for name in ("qkv", "o", "gate_up", "down"):
                m = getattr(layer, name)
                if not isinstance(m, (Int4Linear, Int8Linear)) and not _dense_fp32(m):
                    return f"layer {i} {name} is {m.format}, not a packed int4/int8 or fp32 matrix"
        return None

    def max_rows(self) -> int:
        """Token rows up to which a step can run fused: the packed kernels' limit
        (:func:`~tokenmill.layers.quant.packed.gemv_max_rows`) and, with fp32 matrices,
        :func:`fused_fp32_max_rows`."""
        limits = ([packed.gemv_max_rows()] if self.packed else []) + ([fused_fp32_max_rows()] if self.dense else [])
        return min(limits)

    def applies(self, rows: int, attn: Any, kv_caches: Sequence[Any]) -> bool:
        """Whether a step of ``rows`` token rows on this backend and pool can run fused."""
        if rows > self.max_rows() or (self.packed and packed._activation_mode() == "fp32"):
            return False
        if type(attn) is not NativePagedAttention:
            return False
        c = kv_caches[0]
        return isinstance(c, FP8Pages) or (isinstance(c, torch.Tensor) and c.dtype in (torch.float32, torch.bfloat16, torch.float16))

    def _bind_kv(self, kv_caches: Sequence[Any]) -> None:
        """Point the table's KV fields at this pool (once per pool)."""
        ptrs = (kv_pointers(kv_caches[0]), kv_pointers(kv_caches[-1]))
        if self._kv is kv_caches and self._kv_ptrs == ptrs:
            return
        if len(kv_caches) != len(self.layers):
            raise ValueError(f"expected {len(self.layers)} KV cache entries, got {len(kv_caches)}")
        for i, c in enumerate(kv_caches):
            data = c.data if isinstance(c, FP8Pages) else c
            if not data.is_contiguous() or data.dim() != 5 or tuple(data.shape[3:]) != (self.hkv, self.d):
                raise ValueError(f"KV cache of layer {i} has shape {tuple(data.shape)}, not [2, pages, page, "
                                 f"{self.hkv}, {self.d}] contiguous")
            if isinstance(c, FP8Pages) and not c.per_token and c.scale.numel() != 2 * self.hkv:
                raise ValueError(f"KV cache of layer {i} has static fp8 scales of shape {tuple(c.scale.shape)}, "
                                 f"not one per kv head for K and for V")
            k, v, ks, vs = kv_pointers(c)
            self._table[i, _K_CACHE], self._table[i, _V_CACHE] = k, v
            self._table[i, _K_SCALE], self._table[i, _V_SCALE] = ks, vs
        self._kv = kv_caches
        self._kv_ptrs = ptrs

    def run(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_caches: Sequence[Any],
            meta: NativeMetadata, start: int = 0, stop: int | None = None,
            positions: torch.Tensor | None = None) -> torch.Tensor:
        """Layers ``[start, stop)`` on ``h [T, H]`` (updated in place and returned); ``cos``/``sin``
        are the step's rotary rows ``[T, head_dim]``, or with ``positions`` (int64 ``[T]``) whole
        contiguous tables ``[P, head_dim]`` whose row ``positions[t]`` is token t's (every
        position below P: the caller sees to it, as ``RotaryEmbedding.ensure`` does). The native
        code then reads the rows in place, and the step runs no gather for them."""
        return self._run(h, cos, sin, kv_caches, meta, start, stop, positions=positions)[0]

    def run_to_logits(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_caches: Sequence[Any],
                      meta: NativeMetadata, logits_rows: torch.Tensor, start: int = 0,
                      positions: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Layers ``[start, L)``, then the head given to :meth:`set_head` on the final-normed rows
        ``logits_rows`` of ``h``: ``(h, logits [len(logits_rows), vocab] fp32, argmax
        [len(logits_rows)] int64)``, the last each row's first largest index (as ``argmax(-1)``),
        found by the threads that wrote the row. No rows (a prefill chunk that does not finish
        its prompt): the layers alone, and empty logits (the native head takes at least one row).
        ``cos``/``sin``/``positions`` as for :meth:`run`."""
        if self._head is None:
            raise ValueError("run_to_logits needs set_head first")
        if logits_rows.numel() == 0:
            h = self._run(h, cos, sin, kv_caches, meta, start, None, positions=positions)[0]
            return h, torch.empty(0, self._head_out, dtype=torch.float32), torch.empty(0, dtype=torch.int64)
        h, logits, argmax = self._run(h, cos, sin, kv_caches, meta, start, None, logits_rows, positions)
        assert logits is not None and argmax is not None
        return h, logits, argmax

    def run_steps(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_caches: Sequence[Any],
                  meta: NativeMetadata, positions: torch.Tensor, steps: int,
                  stop: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``steps`` greedy decode steps in one native call, for a batch of one row per sequence
        (``h [T, H]``, the embeddings of each sequence's last token): step s + 1's input is step
        s's argmax, embedded in C. Returns ``(h, logits, tokens)``: the last step's hidden states
        and logits, and ``tokens [steps, T]`` int64. Every step writes its rows' K/V, at
        positions ``positions + s``; the caller has allocated the pages for them, and the
        rotary tables reach ``positions.max() + steps``. Each step computes exactly what a
        one-step call would: the same kernels on the same rows. ``stop`` (an int32 ``[1]``
        tensor): when another thread sets it, the chain ends after its current step, and
        ``tokens`` has the rows of the steps that ran."""
        if not self.chains:
            raise ValueError("run_steps needs set_head and set_embedding first")
        if steps < 1:
            raise ValueError(f"steps must be >= 1, got {steps}")
        t = h.shape[0]
        rows = torch.arange(t, dtype=torch.int64)
        if steps == 1:
            h, logits, argmax = self._run(h, cos, sin, kv_caches, meta, 0, None, rows, positions)
            assert logits is not None and argmax is not None
            return h, logits, argmax.view(1, t)
        if stop is not None and not (stop.dtype == torch.int32 and stop.numel() == 1 and stop.device.type == "cpu"):
            raise ValueError("stop must be an int32 [1] CPU tensor")
        h, logits, tokens = self._run(h, cos, sin, kv_caches, meta, 0, None, rows, positions, steps, stop)
        assert logits is not None and tokens is not None
        return h, logits, tokens

    def _run(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_caches: Sequence[Any],
             meta: NativeMetadata, start: int, stop: int | None,
             logits_rows: torch.Tensor | None = None,
             positions: torch.Tensor | None = None, steps: int = 1,
             stop_flag: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        self._bind_kv(kv_caches)
        stop = len(self.layers) if stop is None else stop
        t = h.shape[0]
        if not (h.dtype == torch.float32 and h.is_contiguous()):
            h = h.float().contiguous()
        pos = 0
        if positions is None:
            cos, sin = cos.reshape(t, self.d).contiguous(), sin.reshape(t, self.d).contiguous()
        else:
            if not (positions.dtype == torch.int64 and positions.numel() == t and positions.is_contiguous()
                    and cos.dim() == 2 and cos.shape == sin.shape and cos.shape[1] == self.d
                    and cos.dtype == torch.float32 == sin.dtype and cos.is_contiguous() and sin.is_contiguous()):
                raise ValueError(f"positions must be int64 [{t}] and cos/sin contiguous fp32 [P, {self.d}] tables")
            pos = positions.data_ptr()
        # the step's tensors are nearly always int64 and contiguous already: each torch call
        # skipped here is a few microseconds of a decode step (its Python runs with cold caches)
        slots = meta.slot_mapping if meta.slot_mapping.dtype == torch.int64 else meta.slot_mapping.long()
        if not slots.is_contiguous():
            slots = slots.contiguous()
        table = self._table if start == 0 and stop == len(self.layers) else self._table[start:stop]
        head: tuple[int, ...] = (0, 0, 0, 0, 0, 0)   # no head
        logits = argmax = None
        if logits_rows is not None:
            assert self._head is not None and stop == len(self.layers)
            rows = logits_rows if logits_rows.dtype == torch.int64 else logits_rows.long()
            if not rows.is_contiguous():
                rows = rows.contiguous()
            logits = torch.empty(rows.numel(), self._head_out, dtype=torch.float32)
            argmax = torch.empty(rows.numel(), dtype=torch.int64)
            head = (self._head.data_ptr(), self._head_norm, rows.data_ptr(), rows.numel(), logits.data_ptr(),
                    argmax.data_ptr())
        chain: tuple[int, ...] = ()
        if steps > 1:   # tokens [steps, t]; argmax (the last step's) stays a separate buffer
            assert self._embed is not None and logits_rows is not None
            tokens = torch.empty(steps, t, dtype=torch.int64)
            chain = (steps, tokens.data_ptr(), self._embed.data_ptr(), 0 if stop_flag is None else stop_flag.data_ptr())
        ran = native.decode_layers(
            h.data_ptr(), t, table.data_ptr(), stop - start, self.hidden, self.hq, self.hkv, self.d, self.inter,
            self.eps, self.scale, cos.data_ptr(), sin.data_ptr(), slots.data_ptr(), meta.block_tables.data_ptr(),
            meta.block_tables.stride(0), meta.query_start_loc.data_ptr(), meta.seq_lens.data_ptr(), meta.num_seqs,
            meta.page_size, kv_kind(kv_caches[0]), meta.threads, *head, pos, *chain)
        return h, logits, (tokens[:ran] if steps > 1 else argmax)
