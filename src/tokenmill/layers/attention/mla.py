"""Multi-head latent attention (MLA, DeepSeek-V2/V3, Kimi K2) over a paged latent cache.

KV layout (one entry per layer, :class:`~tokenmill.contracts.kv.LatentKV`)::

    kv_cache[layer]: [num_pages, page_size, kv_lora_rank + rope_dim]
                      ^ per token: the normed latent c (kv_lora_rank), then the roped shared key
    fp8: FP8Pages(data uint8 of that shape, scale fp32): static [1, 1, kv_lora_rank + rope_dim]
         (one value for the latent's features, one for the rope key's, per layer; calibrated at
         start-up), or per token [num_pages, page_size] (``--kv-cache-fp8-scales token``)

No per-head K or V is stored. With ``W_UK [H, nope, r]`` and ``W_UV [H, v, r]`` the two halves of
``kv_b_proj`` (per head), a head's key is ``[W_UK c ; k_rope]`` and its value ``W_UV c``.

* **Decode (absorbed, default):** fold ``W_UK`` into the query, ``q_lat = q_nope W_UK`` [H, r],
  attend over the cached vectors directly (``score = q_lat . c + q_rope . k_rope``, values = c),
  then apply ``W_UV`` to the ``[H, r]`` result. One SDPA call for all decode rows, the H heads
  acting as H query rows of one shared key/value head (MQA over the latent); nothing per head is
  materialised for the context.
* **Prefill (expanded):** a chunk expands its context's latents to per-head K and V with one
  matmul and runs ordinary causal SDPA (cheaper than absorbing when many queries share the
  keys). A chunk with earlier context (chunked prefill, prefix hit) expands the cached latents too.

``absorb_decode=False`` expands on decode as well (the reference for the absorbed path; tests
check the two agree). Metadata (decode rows, prefill segments) is the torch reference backend's.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from tokenmill.contracts.batch import ForwardBatch
from tokenmill.contracts.kv import KVCacheSpec, LatentKV
from tokenmill.layers.attention.base import AttentionBackend, attention_kinds, per_layer, to_kv_dtype
from tokenmill.layers.attention.fp8 import FP8Pages, allocate_fp8, dequantize, dequantize_static, write_fp8
from tokenmill.layers.attention.torch_ref import AttentionMetadata, PrefillSegment, TorchPagedAttention

LatentPages = torch.Tensor | FP8Pages


def check_latent_spec(spec: KVCacheSpec) -> LatentKV:
    """The one LatentKV shape of every attention layer (a hybrid model's LinearState layers are
    ignored: their state lives in the state pool)."""
    kinds = attention_kinds(spec)
    if len(kinds) != 1 or not isinstance(next(iter(kinds)), LatentKV):
        raise ValueError(f"the MLA backend needs the same LatentKV entry in every attention layer, got "
                         f"{sorted(map(repr, kinds))}")
    return next(iter(kinds))


class MLAAttention(AttentionBackend):
    """MLA in plain torch ops: absorbed decode, expanded prefill (see the module docstring)."""

    name = "mla-torch"

    def __init__(self, spec: KVCacheSpec, device: torch.device, compute_dtype: torch.dtype, *,
                 absorb_decode: bool = True) -> None:
        super().__init__(spec, device, compute_dtype)
        self.layer = check_latent_spec(spec)
        self.absorb_decode = absorb_decode
        # static fp8 scales: the latent and the rope key are calibrated separately
        self.fp8_scale_segments = (self.layer.kv_lora_rank, self.layer.rope_dim)

    def allocate(self, num_pages: int, page_size: int) -> list[LatentPages]:
        if num_pages <= 0 or page_size <= 0:
            raise ValueError(f"num_pages and page_size must be positive, got {num_pages}, {page_size}")
        shape = (num_pages, page_size, self.layer.elements_per_token())
        if self.spec.is_scaled:
            static = None if self.spec.per_token_scales else (1, 1, shape[-1])
            return per_layer(self.spec, lambda: allocate_fp8(shape, self.device, static, self.spec.is_int8))
        return per_layer(self.spec, lambda: torch.zeros(shape, dtype=self.cache_dtype, device=self.device))

    def build_metadata(self, batch: ForwardBatch) -> AttentionMetadata:
        return TorchPagedAttention.build_metadata(self, batch)  # type: ignore[arg-type]

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: Any, meta: Any,
                scale: float) -> torch.Tensor:
        raise TypeError("the MLA backend stores latents, not K/V heads: call forward_mla")

    # -- cache access ----------------------------------------------------------------------------
    def _write(self, kv_cache: LatentPages, slots: torch.Tensor, entry: torch.Tensor) -> None:
        if isinstance(kv_cache, FP8Pages):
            write_fp8(kv_cache, slots, entry)
        else:
            kv_cache.view(-1, entry.shape[-1]).index_copy_(0, slots, to_kv_dtype(entry, kv_cache.dtype))

    def _gather(self, kv_cache: LatentPages, pages: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Entries of ``pages`` (any shape of page ids), ``[pages.numel() * page_size, r + rope]``."""
        flat = pages.reshape(-1)
        if isinstance(kv_cache, FP8Pages):
            d = kv_cache.data.shape[-1]
            if not kv_cache.per_token:
                return dequantize_static(kv_cache.data.index_select(0, flat), kv_cache.scale, dtype).view(-1, d)
            return dequantize(kv_cache.data.index_select(0, flat), kv_cache.scale.index_select(0, flat),
                              dtype).view(-1, d)
        out = kv_cache.index_select(0, flat).view(-1, kv_cache.shape[-1])
        return out if out.dtype == dtype else out.to(dtype)

    # -- attention -------------------------------------------------------------------------------
    def forward_mla(self, q_nope: torch.Tensor, q_rope: torch.Tensor, latent: torch.Tensor,
                    k_rope: torch.Tensor, kv_cache: LatentPages, meta: AttentionMetadata, scale: float,
                    kv_b: torch.Tensor) -> torch.Tensor:
        """Write ``[latent ; k_rope]`` ([T, r], [T, rope]) at the step's slots and attend.

        ``q_nope`` [T, H, nope] and ``q_rope`` [T, H, rope] (already roped); ``kv_b`` is
        ``kv_b_proj.weight`` [H * (nope + v), r]. Returns ``[T, H * v]`` in ``q_nope``'s dtype.
        """
        t, h, nope = q_nope.shape
        r = latent.shape[-1]
        vdim = kv_b.shape[0] // h - nope
        entry = torch.cat((latent, k_rope), dim=-1)
        self._write(kv_cache, meta.slot_mapping, entry)
        w = kv_b.view(h, nope + vdim, r)
        w_uk, w_uv = w[:, :nope], w[:, nope:]
        if meta.num_decode == t:
            return self._decode(q_nope, q_rope, kv_cache, meta, scale, kv_b, w_uk, w_uv)
        out = q_nope.new_empty(t, h * vdim)
        if meta.num_decode:
            rows = meta.decode_rows
            assert rows is not None
            out[rows] = self._decode(q_nope[rows], q_rope[rows], kv_cache, meta, scale, kv_b, w_uk, w_uv)
        for seg in meta.prefill:
            sl = slice(seg.start, seg.end)
            ctx = entry[sl] if seg.allowed is None else self._gather(kv_cache, seg.pages, q_nope.dtype)[: seg.seq_len]
            out[sl] = self._expanded(q_nope[sl].unsqueeze(0), q_rope[sl].unsqueeze(0), ctx.unsqueeze(0), kv_b,
                                     h, nope, r, scale, seg.allowed, causal=seg.allowed is None)[0]
        return out

    def _decode(self, q_nope: torch.Tensor, q_rope: torch.Tensor, kv_cache: LatentPages,
                meta: AttentionMetadata, scale: float, kv_b: torch.Tensor, w_uk: torch.Tensor,
                w_uv: torch.Tensor) -> torch.Tensor:
        bt, mask = meta.decode_block_tables, meta.decode_mask
        assert bt is not None and mask is not None
        b, h, nope = q_nope.shape
        r = w_uk.shape[-1]
        ctx = self._gather(kv_cache, bt, q_nope.dtype).view(b, mask.shape[-1], -1)   # [B, L, r + rope]
        if not self.absorb_decode:
            return self._expanded(q_nope.unsqueeze(1), q_rope.unsqueeze(1), ctx, kv_b, h, nope, r, scale,
                                  mask, causal=False).view(b, -1)
        q_lat = torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)             # [B, H, r]
        q = torch.cat((q_lat, q_rope), dim=-1).unsqueeze(1)                           # [B, 1, H, r + rope]
        keys = ctx.unsqueeze(1)                                                       # [B, 1, L, r + rope]
        o_lat = F.scaled_dot_product_attention(q, keys, keys[..., :r], attn_mask=mask, scale=scale)
        o = torch.bmm(o_lat.squeeze(1).transpose(0, 1), w_uv.transpose(1, 2))        # [H, B, v]
        return o.transpose(0, 1).reshape(b, -1)

    @staticmethod
    def _expanded(q_nope: torch.Tensor, q_rope: torch.Tensor, ctx: torch.Tensor, kv_b: torch.Tensor, h: int,
                  nope: int, r: int, scale: float, mask: torch.Tensor | None, causal: bool) -> torch.Tensor:
        """Per-head attention over expanded keys: q [B, n, H, *], ctx [B, L, r + rope] -> [B, n, H * v]."""
        b, n = q_nope.shape[:2]
        length = ctx.shape[1]
        kv = F.linear(ctx[..., :r], kv_b).view(b, length, h, -1)                      # [B, L, H, nope + v]
        k_rope = ctx[..., r:].unsqueeze(2).expand(b, length, h, ctx.shape[-1] - r)
        keys = torch.cat((kv[..., :nope], k_rope), dim=-1).transpose(1, 2)           # [B, H, L, nope + rope]
        values = kv[..., nope:].transpose(1, 2)                                       # [B, H, L, v]
        q = torch.cat((q_nope, q_rope), dim=-1).transpose(1, 2)                       # [B, H, n, nope + rope]
        if mask is not None and mask.dim() == 2:
            mask = mask.view(1, 1, n, length)
        o = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, is_causal=causal, scale=scale)
        return o.transpose(1, 2).reshape(b, n, -1)


__all__ = ["LatentPages", "MLAAttention", "PrefillSegment", "check_latent_spec"]
