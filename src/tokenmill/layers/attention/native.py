"""Paged attention with the native CPU kernel: pages are read in place.

The layout is the torch reference backend's (``[2, num_pages, page_size, kv_heads, head_dim]``
per layer), so the two backends are interchangeable on the same pool and the reference can
check the kernel. One kernel call per layer covers the whole step (decodes, fresh prefills and
chunks after cached context together): no per-sequence Python loop, no mask tensor, no gather
of the context into a copy. Its metadata is the batch's own integer tensors, so building it
costs nothing. Writing the step's K/V into its slots stays a torch ``index_copy_``. Decode rows
take the kernel's per-row online softmax; prefill chunks its tiled path, where each K/V row read
from a page serves a whole group of query rows and heads (see ``_native/attention.c``).

Supported: fp32 activations with an fp32 or bf16 KV pool (bf16 pages are widened to fp32 as
they are read, halving the bytes a long-context decode reads) on the CPU. Anything else falls back to the torch
backend when ``auto`` chooses (:func:`unsupported_reason` says why).
"""
from __future__ import annotations

from typing import NamedTuple

import torch
from torch.profiler import record_function

from tokenmill._native import attention as kernel
from tokenmill.contracts.batch import ForwardBatch
from tokenmill.contracts.kv import KVCacheSpec, PagedKV
from tokenmill.layers.attention.base import attention_kinds
from tokenmill.layers.attention.torch_ref import TorchPagedAttention


def unsupported_reason(spec: KVCacheSpec, device: torch.device, compute_dtype: torch.dtype) -> str | None:
    if not kernel.available():
        return kernel.unavailable_reason()
    if device.type != "cpu":
        return f"it runs on the CPU only, not {device}"
    if not all(isinstance(layer, PagedKV) for layer in attention_kinds(spec)):
        return "it handles standard attention layers (PagedKV) only"
    if compute_dtype != torch.float32 or spec.dtype not in ("float32", "bfloat16"):
        return f"it needs float32 activations and a float32 or bfloat16 KV pool (got {compute_dtype}, KV {spec.dtype})"
    return None


class NativeMetadata(NamedTuple):
    slot_mapping: torch.Tensor
    query_start_loc: torch.Tensor   # int64, contiguous
    seq_lens: torch.Tensor
    block_tables: torch.Tensor
    num_seqs: int
    page_size: int
    threads: int


class NativePagedAttention(TorchPagedAttention):
    name = "native"

    def build_metadata(self, batch: ForwardBatch) -> NativeMetadata:
        ps = batch.page_size
        if batch.max_seq_len and batch.max_seq_len > batch.block_tables.shape[1] * ps:
            raise ValueError(f"block_tables hold {batch.block_tables.shape[1]} pages of {ps} tokens, "
                             f"too few for a context of {batch.max_seq_len} tokens")
        as_i64 = lambda t: t.to(torch.int64).contiguous()  # noqa: E731
        return NativeMetadata(batch.slot_mapping, as_i64(batch.query_start_loc), as_i64(batch.seq_lens),
                              as_i64(batch.block_tables), batch.num_seqs, ps, torch.get_num_threads())

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                meta: NativeMetadata, scale: float) -> torch.Tensor:
        t, hq, d = q.shape
        hkv = k.shape[1]
        kv_cache[0].view(-1, hkv, d).index_copy_(0, meta.slot_mapping, k.to(kv_cache.dtype))
        kv_cache[1].view(-1, hkv, d).index_copy_(0, meta.slot_mapping, v.to(kv_cache.dtype))
        if q.stride(2) != 1 or q.stride(1) != d:
            q = q.contiguous()
        out = torch.empty(t, hq * d, dtype=q.dtype, device=q.device)
        with record_function("tokenmill::native_paged_attention"):   # visible in torch.profiler
            kernel.paged_attention(
                q.data_ptr(), q.stride(0), out.data_ptr(), kv_cache[0].data_ptr(), kv_cache[1].data_ptr(),
                meta.block_tables.data_ptr(), meta.block_tables.stride(0), meta.query_start_loc.data_ptr(),
                meta.seq_lens.data_ptr(), meta.num_seqs, meta.page_size, hq, hkv, d, scale, meta.threads,
                int(kv_cache.dtype == torch.bfloat16))
        return out
