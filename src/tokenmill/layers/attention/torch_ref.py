"""The reference paged-attention backend, in plain torch ops (any device).

KV layout (one tensor per layer)::

    kv_cache[layer]: [2, num_pages, page_size, num_kv_heads, head_dim]
                      ^ 0 = K, 1 = V
    token at slot s = page_id * page_size + offset lives at kv_cache[:, s // page_size, s % page_size]

* Decode-shaped sequences (query length 1) are handled together in one vectorised pass: pages
  are gathered through the block table (one ``index_select`` for K and V) into a padded
  ``[B, L, H, D]`` tensor, masked by length, and attended with one SDPA call.
* Longer chunks (prefill, possibly after cached context: chunked prefill or a prefix hit) run one
  sequence at a time with SDPA and an offset causal mask.

This backend is the correctness reference for the faster ones: it is simple, copies what it
reads, and is checked against HF transformers by the model tests. The cache may be stored in a
lower precision than the activations (cast on write and on read). FP8 pools
(``float8_e4m3fn``) are :class:`~tokenmill.layers.attention.fp8.FP8Pages`: the bytes in the
shape above plus fp32 scales, static ``[2, 1, 1, num_kv_heads, 1]`` (one per layer and head,
calibrated at start-up) or per token ``[2, num_pages, page_size, num_kv_heads]``, quantized on
write and dequantized when pages are gathered.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from tokenmill.contracts.batch import ForwardBatch
from tokenmill.contracts.kv import KVCacheSpec, PagedKV
from tokenmill.layers.attention.base import AttentionBackend, attention_kinds, per_layer, to_kv_dtype
from tokenmill.layers.attention.fp8 import FP8Pages, allocate_fp8, dequantize, dequantize_static, untile_pages, write_fp8


class PrefillSegment(NamedTuple):
    start: int          # first row of the chunk in the step's tokens
    end: int            # one past the last row
    seq_len: int        # context length after the step (cached + this chunk)
    pages: torch.Tensor  # page ids holding the sequence's first seq_len tokens
    allowed: torch.Tensor | None  # [n, seq_len] bool mask when there is earlier context, else None


class AttentionMetadata(NamedTuple):
    """Per-step values shared by all layers; built once per forward by ``build_metadata``."""

    slot_mapping: torch.Tensor
    num_tokens: int
    decode_rows: torch.Tensor | None          # [Bd] rows of query-length-1 sequences (None: all rows)
    num_decode: int
    decode_block_tables: torch.Tensor | None  # [Bd, P]
    decode_mask: torch.Tensor | None          # [Bd, 1, 1, P*page_size] additive 0 / -inf
    prefill: list[PrefillSegment]


def check_paged_spec(spec: KVCacheSpec) -> PagedKV:
    """The one PagedKV shape shared by every attention layer (these backends need a uniform
    layout; a hybrid model's LinearState layers are not theirs and are ignored)."""
    kinds = attention_kinds(spec)
    if len(kinds) != 1 or not isinstance(next(iter(kinds)), PagedKV):
        raise ValueError(f"this attention backend needs the same PagedKV entry in every attention layer, got "
                         f"{sorted(map(repr, kinds))}")
    return next(iter(kinds))


class TorchPagedAttention(AttentionBackend):
    """Paged attention in plain torch ops: page gathers with ``index_select``, then SDPA."""

    name = "torch"

    def allocate(self, num_pages: int, page_size: int) -> list[torch.Tensor]:
        """One zeroed tensor per layer, ``[2, num_pages, page_size, num_kv_heads, head_dim]``."""
        if num_pages <= 0 or page_size <= 0:
            raise ValueError(f"num_pages and page_size must be positive, got {num_pages}, {page_size}")
        layer = check_paged_spec(self.spec)
        shape = (2, num_pages, page_size, layer.num_kv_heads, layer.head_dim)
        if self.spec.is_scaled:
            static = None if self.spec.per_token_scales else (2, 1, 1, layer.num_kv_heads, 1)
            return per_layer(self.spec, lambda: allocate_fp8(shape, self.device, static, self.spec.is_int8))
        return per_layer(self.spec, lambda: torch.zeros(shape, dtype=self.cache_dtype, device=self.device))

    def build_metadata(self, batch: ForwardBatch) -> AttentionMetadata:
        dtype = self.compute_dtype
        qsl = batch.query_start_loc.tolist()
        seq_lens = batch.seq_lens.tolist()
        ps = batch.page_size
        q_lens = [qsl[i + 1] - qsl[i] for i in range(len(seq_lens))]
        if seq_lens and max(seq_lens) > batch.block_tables.shape[1] * ps:
            raise ValueError(f"block_tables hold {batch.block_tables.shape[1]} pages of {ps} tokens, "
                             f"too few for a context of {max(seq_lens)} tokens")
        dec = [i for i, n in enumerate(q_lens) if n == 1]
        prefill: list[PrefillSegment] = []
        for i, n in enumerate(q_lens):
            if n > 1:
                if n > seq_lens[i]:
                    raise ValueError(f"sequence {i}: query length {n} exceeds its context length {seq_lens[i]}")
                pages = batch.block_tables[i, : (seq_lens[i] + ps - 1) // ps]
                allowed = None
                if n < seq_lens[i]:  # query j sits at position seq_len - n + j
                    key_pos = torch.arange(seq_lens[i], device=pages.device)
                    allowed = key_pos[None, :] <= key_pos[seq_lens[i] - n:, None]
                prefill.append(PrefillSegment(qsl[i], qsl[i + 1], seq_lens[i], pages, allowed))
        decode_rows = bt = mask = None
        if dec:
            idx = torch.tensor(dec, dtype=torch.long, device=batch.seq_lens.device)
            all_rows = len(dec) == len(q_lens) and qsl[-1] == len(dec)
            lens = batch.seq_lens if all_rows else batch.seq_lens[idx]
            max_len = max(seq_lens[i] for i in dec)
            num_pages = (max_len + ps - 1) // ps
            bt = (batch.block_tables if all_rows else batch.block_tables[idx])[:, :num_pages]
            key_pos = torch.arange(num_pages * ps, device=lens.device)
            mask = torch.zeros(len(dec), 1, 1, num_pages * ps, dtype=dtype, device=lens.device)
            mask.masked_fill_((key_pos[None, :] >= lens[:, None]).view(len(dec), 1, 1, -1), float("-inf"))
            if not all_rows:
                decode_rows = torch.tensor([qsl[i] for i in dec], dtype=torch.long, device=idx.device)
        return AttentionMetadata(batch.slot_mapping, qsl[-1], decode_rows, len(dec), bt, mask, prefill)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float) -> torch.Tensor:
        """Write ``k``/``v`` [T, Hkv, D] at ``meta.slot_mapping`` and attend with ``q`` [T, Hq, D].

        Returns ``[T, Hq * D]``.
        """
        t, hq, d = q.shape
        hkv = k.shape[1]
        if isinstance(kv_cache, FP8Pages):
            write_fp8(kv_cache.half(0), meta.slot_mapping, k)
            write_fp8(kv_cache.half(1), meta.slot_mapping, v)
        else:
            kv_cache[0].view(-1, hkv, d).index_copy_(0, meta.slot_mapping, to_kv_dtype(k, kv_cache.dtype))
            kv_cache[1].view(-1, hkv, d).index_copy_(0, meta.slot_mapping, to_kv_dtype(v, kv_cache.dtype))
        if meta.num_decode == t:  # pure decode step: no scatter needed
            return self._decode(q, kv_cache, meta, scale)
        out = q.new_empty(t, hq * d)
        if meta.num_decode:
            assert meta.decode_rows is not None
            out[meta.decode_rows] = self._decode(q[meta.decode_rows], kv_cache, meta, scale)
        for seg in meta.prefill:
            out[seg.start:seg.end] = self._prefill(q[seg.start:seg.end], k[seg.start:seg.end],
                                                   v[seg.start:seg.end], kv_cache, seg, scale)
        return out

    @classmethod
    def _gather(cls, kv_cache: torch.Tensor | FP8Pages, pages: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        """K and V of ``pages`` (any shape of page ids) in ``like``'s dtype: ``[2, pages.numel() * page_size, H, D]``."""
        if isinstance(kv_cache, FP8Pages):
            two, num_pages, page_size, hkv, d = kv_cache.data.shape
            data = kv_cache.data.view(two, num_pages, page_size * hkv * d).index_select(1, pages.reshape(-1))
            if not kv_cache.per_token:
                return dequantize_static(data.view(two, -1, hkv, d), kv_cache.scale.view(two, 1, hkv, 1), like.dtype)
            scale = kv_cache.scale.view(two, num_pages, page_size * hkv).index_select(1, pages.reshape(-1))
            if kv_cache.tiled:   # the pages' codes back in row order
                data, scale = untile_pages(data.view(two, -1, page_size, hkv, d), scale.view(two, -1, page_size, hkv), page_size)
            return dequantize(data.view(two, -1, hkv, d), scale.view(two, -1, hkv), like.dtype)
        two, num_pages, page_size, hkv, d = kv_cache.shape
        flat = kv_cache.view(two, num_pages, page_size * hkv * d).index_select(1, pages.reshape(-1))
        return cls._as(flat.view(two, -1, hkv, d), like)

    @staticmethod
    def _as(x: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        return x if x.dtype == like.dtype else x.to(like.dtype)

    @classmethod
    def _decode(cls, q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
                scale: float) -> torch.Tensor:
        bt, mask = meta.decode_block_tables, meta.decode_mask
        assert bt is not None and mask is not None
        b, hq, d = q.shape
        hkv = (kv_cache.data if isinstance(kv_cache, FP8Pages) else kv_cache).shape[-2]
        kv = cls._gather(kv_cache, bt, q).view(2, b, mask.shape[-1], hkv, d)
        keys, values = kv[0].transpose(1, 2), kv[1].transpose(1, 2)         # [B, Hkv, L, D]
        # The G query heads that share a KV head act as G query rows over the same keys.
        o = F.scaled_dot_product_attention(q.view(b, hkv, hq // hkv, d), keys, values,
                                           attn_mask=mask, scale=scale)    # [B, Hkv, G, D]
        return o.reshape(b, hq * d)

    @classmethod
    def _prefill(cls, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                 seg: PrefillSegment, scale: float) -> torch.Tensor:
        n, hq, d = q.shape
        qh = q.transpose(0, 1).unsqueeze(0)  # [1, Hq, n, D]
        if seg.allowed is None:  # no earlier context: the chunk's own K/V are the whole context
            kh, vh = k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0)
            o = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale, enable_gqa=True)
        else:
            kv = cls._gather(kv_cache, seg.pages, q)[:, : seg.seq_len]
            kh, vh = kv[0].transpose(0, 1).unsqueeze(0), kv[1].transpose(0, 1).unsqueeze(0)
            o = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=seg.allowed, scale=scale, enable_gqa=True)
        return o.squeeze(0).transpose(0, 1).reshape(n, hq * d)


