"""Llama-family decoder (Llama 2/3, SmolLM, Qwen2, Qwen3) over a paged KV cache.

Qwen2 differs from Llama by a bias on the q/k/v projections and Qwen3 by an RMSNorm on each
query and key head before RoPE; both are options of one implementation (``ModelArgs.qkv_bias``,
``ModelArgs.qk_norm``).

Weights are kept the way the forward wants them: q/k/v concatenated into one ``qkv_proj``
matrix and gate/up into one ``gate_up_proj``. Every matmul goes through a linear method
(``tokenmill.layers.linear``): dense ``F.linear`` or a quantized format, chosen by the loader.
"""
from __future__ import annotations

import os
from typing import Any, Mapping, Sequence

import torch
from torch import nn

from tokenmill.layers.attention import ForwardContext
from tokenmill.layers.linear import DenseLinear, as_linear
from tokenmill.layers.quant.fused_decode import DecoderLayerWeights, FusedDecodeStack
from tokenmill.layers.quant.methods import cat_linears
from tokenmill.layers.norm import RMSNorm
from tokenmill.layers import fused
from tokenmill.layers.rotary import CosSin, RotaryEmbedding
from tokenmill.models.base import CausalLM, KVCacheSpec, ModelArgs


def _param(*shape: int, dtype: torch.dtype) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs, dtype: torch.dtype) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = args.num_heads, args.num_kv_heads, args.head_dim
        self.q_size = args.num_heads * args.head_dim
        self.kv_size = args.num_kv_heads * args.head_dim
        self.inter = args.intermediate_size
        self.scale = args.head_dim ** -0.5
        self.qkv_proj = DenseLinear.empty(self.q_size + 2 * self.kv_size, args.hidden_size, dtype)
        self.qkv_bias = _param(self.q_size + 2 * self.kv_size, dtype=dtype) if args.qkv_bias else None
        self.o_proj = DenseLinear.empty(args.hidden_size, self.q_size, dtype)
        self.gate_up_proj = DenseLinear.empty(2 * args.intermediate_size, args.hidden_size, dtype)
        self.down_proj = DenseLinear.empty(args.hidden_size, args.intermediate_size, dtype)
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.q_norm = RMSNorm(args.head_dim, args.rms_norm_eps) if args.qk_norm else None
        self.k_norm = RMSNorm(args.head_dim, args.rms_norm_eps) if args.qk_norm else None

    def forward(self, h: torch.Tensor, cs: CosSin, kv_cache: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        t = h.shape[0]
        x = self.input_layernorm(h)
        qkv = self.qkv_proj(x, self.qkv_bias)
        if self.q_norm is not None and self.k_norm is not None:
            q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
            q = self.q_norm(q.view(t, self.num_heads, self.head_dim))
            k = self.k_norm(k.view(t, self.num_kv_heads, self.head_dim))
            q, k = fused.rotary(q, cs), fused.rotary(k, cs)
        else:  # q and k are adjacent in qkv: rotate all their heads in one pass
            qk = fused.rotary(qkv[:, : self.q_size + self.kv_size].view(t, -1, self.head_dim), cs)
            q, k = qk[:, : self.num_heads], qk[:, self.num_heads:]
            v = qkv[:, self.q_size + self.kv_size:]
        v = v.view(t, self.num_kv_heads, self.head_dim)
        o = ctx.attn.forward(q, k, v, kv_cache, ctx.meta, self.scale)
        norm = self.post_attention_layernorm
        h, x = fused.add_rms_norm(h, self.o_proj(o), norm.weight, norm.eps)
        return h + self.down_proj(fused.swiglu(self.gate_up_proj(x)))


class LlamaForCausalLM(CausalLM):
    """Llama / Qwen2 / Qwen3 causal LM. Build, then ``load_weights`` before the first forward."""

    calls_compute_hook = True   # ForwardContext.compute_starts, right before the layers run

    def __init__(self, args: ModelArgs, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu") -> None:
        super().__init__()
        self.args = args
        self.dtype = dtype
        self.embed_tokens = DenseLinear.empty(args.vocab_size, args.hidden_size, dtype)
        self.layers = nn.ModuleList(LlamaDecoderLayer(args, dtype) for _ in range(args.num_layers))
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.lm_head = self.embed_tokens if args.tie_word_embeddings else DenseLinear.empty(
            args.vocab_size, args.hidden_size, dtype)
        self.rotary = RotaryEmbedding(args.head_dim, args.rope_theta, args.rope_scaling,
                                      initial_positions=min(args.max_position_embeddings, 4096))
        self._fused: FusedDecodeStack | None | bool = False   # False: not built yet
        self._fused_on = True

    def kv_cache_spec(self) -> KVCacheSpec:
        return KVCacheSpec.dense(self.args.num_layers, self.args.num_kv_heads, self.args.head_dim,
                                 str(self.dtype).removeprefix("torch."))

    @torch.no_grad()
    def forward(self, ctx: ForwardContext) -> torch.Tensor:
        batch = ctx.batch
        if len(ctx.kv_caches) != len(self.layers):
            raise ValueError(f"expected {len(self.layers)} KV cache entries, got {len(ctx.kv_caches)}")
        h = self.embed_tokens.embedding(batch.input_ids, self.dtype)
        ctx.capture(-1, h)
        stack = self.fused_decode_stack() if self._fused_on else None
        ctx.compute_starts()
        if stack is not None and stack.applies(h.shape[0], ctx.attn, ctx.kv_caches):
            # the native code reads the tables' rows in place (chained steps: past the batch's end)
            self.rotary.ensure(batch.max_seq_len + ctx.decode_steps - 1)
            h, logits = self._forward_fused(stack, h, ctx)
            if logits is not None:
                return logits
        else:
            cs = self.rotary.lookup(batch.positions, self.dtype, batch.max_seq_len)
            for i, (layer, cache) in enumerate(zip(self.layers, ctx.kv_caches)):
                h = layer(h, cs, cache, ctx)
                ctx.capture(i, h)
        h = self.norm(h[batch.logits_indices])
        return self.lm_head(h).float()

    def _forward_fused(self, stack: FusedDecodeStack, h: torch.Tensor,
                       ctx: ForwardContext) -> tuple[torch.Tensor, torch.Tensor | None]:
        """All layers in native calls (split only where a layer's output is captured); the last
        call also gives the logits when the stack holds the head (``FusedDecodeStack.set_head``),
        and their rows' argmax (``ctx.logits_argmax``)."""
        if -1 in ctx.capture_layers or not h.is_contiguous():
            h = h.clone(memory_format=torch.contiguous_format)  # updated in place from here on
        start = 0
        cos, sin, pos = self.rotary.cos_table, self.rotary.sin_table, ctx.batch.positions
        if ctx.decode_steps > 1:   # chained greedy steps (chains_decode_steps said yes)
            h, logits, ctx.step_tokens = stack.run_steps(h, cos, sin, ctx.kv_caches, ctx.meta, pos, ctx.decode_steps,
                                                         ctx.chain_stop)
            ctx.logits_argmax = ctx.step_tokens[-1]
            return h, logits
        for i in sorted(c for c in ctx.capture_layers if 0 <= c < len(self.layers)):
            h = stack.run(h, cos, sin, ctx.kv_caches, ctx.meta, start, i + 1, positions=pos)
            ctx.capture(i, h.clone())
            start = i + 1
        if start < len(self.layers):
            if stack.has_head and not os.environ.get("TOKENMILL_NO_FUSED_HEAD"):   # the env: A/B runs
                h, logits, ctx.logits_argmax = stack.run_to_logits(h, cos, sin, ctx.kv_caches, ctx.meta,
                                                                   ctx.batch.logits_indices, start, positions=pos)
                return h, logits
            h = stack.run(h, cos, sin, ctx.kv_caches, ctx.meta, start, positions=pos)
        return h, None

    @property
    def fused_decode_enabled(self) -> bool:
        return self._fused_on

    def set_fused_decode(self, enabled: bool) -> None:
        """Turn the native fused decode path on (the default, where the weights fit it) or off
        (every step then runs layer by layer; for A/B measurements and tests)."""
        self._fused_on = bool(enabled)

    def fused_decode_stack(self) -> FusedDecodeStack | None:
        """The native decode path over this model's layers, or None when its weights do not fit it
        (dense weights, per-head q/k norms; ``FusedDecodeStack.unsupported_reason``). Built on
        first use; ``load_weights`` resets it."""
        if self._fused is False:
            layers = [DecoderLayerWeights(l.input_layernorm.weight, l.post_attention_layernorm.weight, l.qkv_proj,
                                          l.qkv_bias, l.o_proj, l.gate_up_proj, l.down_proj) for l in self.layers]
            a = self.args
            reason = (FusedDecodeStack.unsupported_reason(layers, self.dtype)
                      or ("per-head q/k norms" if any(l.q_norm is not None for l in self.layers) else None)
                      or ("head shape beyond the attention kernel" if a.head_dim > 512 or a.head_dim % 2
                          or a.num_heads // a.num_kv_heads > 256 else None))
            self._fused = None if reason else FusedDecodeStack(
                layers, hidden=a.hidden_size, num_heads=a.num_heads, num_kv_heads=a.num_kv_heads,
                head_dim=a.head_dim, intermediate=a.intermediate_size, eps=a.rms_norm_eps,
                scale=self.layers[0].scale)
            if self._fused is not None:
                self._fused.set_head(self.norm.weight, self.lm_head)
                self._fused.set_embedding(self.embed_tokens)
        return self._fused

    def chains_decode_steps(self, rows: int, attn: Any, kv_caches: Sequence[Any]) -> bool:
        """Chained greedy steps run on the fused native path with its head and embedding, and
        without captured layers (the runner checks those)."""
        stack = self.fused_decode_stack() if self._fused_on else None
        return (stack is not None and stack.chains and stack.applies(rows, attn, kv_caches)
                and not os.environ.get("TOKENMILL_NO_FUSED_HEAD"))

    # ---- weights -------------------------------------------------------------------------
    def _hf_layout(self) -> dict[str, tuple[int, ...]]:
        """HF tensor name -> expected shape, for every tensor this model needs."""
        a = self.args
        q, kv = a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim
        out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (a.vocab_size, a.hidden_size),
                                           "model.norm.weight": (a.hidden_size,)}
        if not a.tie_word_embeddings:
            out["lm_head.weight"] = (a.vocab_size, a.hidden_size)
        for i in range(a.num_layers):
            p = f"model.layers.{i}."
            out[p + "self_attn.q_proj.weight"] = (q, a.hidden_size)
            out[p + "self_attn.k_proj.weight"] = (kv, a.hidden_size)
            out[p + "self_attn.v_proj.weight"] = (kv, a.hidden_size)
            out[p + "self_attn.o_proj.weight"] = (a.hidden_size, q)
            if a.qkv_bias:
                out[p + "self_attn.q_proj.bias"] = (q,)
                out[p + "self_attn.k_proj.bias"] = (kv,)
                out[p + "self_attn.v_proj.bias"] = (kv,)
            if a.qk_norm:
                out[p + "self_attn.q_norm.weight"] = (a.head_dim,)
                out[p + "self_attn.k_norm.weight"] = (a.head_dim,)
            out[p + "mlp.gate_proj.weight"] = (a.intermediate_size, a.hidden_size)
            out[p + "mlp.up_proj.weight"] = (a.intermediate_size, a.hidden_size)
            out[p + "mlp.down_proj.weight"] = (a.hidden_size, a.intermediate_size)
            out[p + "input_layernorm.weight"] = (a.hidden_size,)
            out[p + "post_attention_layernorm.weight"] = (a.hidden_size,)
        return out

    def load_weights(self, weights: Mapping[str, torch.Tensor]) -> None:
        layout = self._hf_layout()
        self.check_weights(weights, layout)
        self._fused = False

        def get(name: str) -> torch.Tensor:
            return weights[name].to(self.dtype)

        def cat(*names: str) -> torch.Tensor:
            return torch.cat([weights[n].to(self.dtype) for n in names], dim=0)

        def linear(*names: str):  # one linear method over the rows of these (maybe quantized) weights
            return cat_linears([weights[n] for n in names], self.dtype)

        self.embed_tokens = as_linear(weights["model.embed_tokens.weight"], self.dtype)
        self.lm_head = self.embed_tokens if self.args.tie_word_embeddings else linear("lm_head.weight")
        self.norm.weight.data = get("model.norm.weight").contiguous()
        for i, layer in enumerate(self.layers):
            p = f"model.layers.{i}."
            a = p + "self_attn."
            layer.qkv_proj = linear(a + "q_proj.weight", a + "k_proj.weight", a + "v_proj.weight")
            if layer.qkv_bias is not None:
                layer.qkv_bias.data = cat(a + "q_proj.bias", a + "k_proj.bias", a + "v_proj.bias")
            if layer.q_norm is not None and layer.k_norm is not None:
                layer.q_norm.weight.data = get(a + "q_norm.weight").contiguous()
                layer.k_norm.weight.data = get(a + "k_norm.weight").contiguous()
            layer.o_proj = linear(a + "o_proj.weight")
            layer.gate_up_proj = linear(p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight")
            layer.down_proj = linear(p + "mlp.down_proj.weight")
            layer.input_layernorm.weight.data = get(p + "input_layernorm.weight").contiguous()
            layer.post_attention_layernorm.weight.data = get(p + "post_attention_layernorm.weight").contiguous()

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        a = self.args
        q, kv, inter = a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim, a.intermediate_size
        head = self.lm_head.dequantize()  # views for dense weights, fresh fp32 for quantized ones
        embed = head if self.embed_tokens is self.lm_head else self.embed_tokens.dequantize()
        out = {"model.embed_tokens.weight": embed, "model.norm.weight": self.norm.weight,
               "lm_head.weight": head}
        for i, layer in enumerate(self.layers):
            p = f"model.layers.{i}."
            w = layer.qkv_proj.dequantize()
            out[p + "self_attn.q_proj.weight"] = w[:q]
            out[p + "self_attn.k_proj.weight"] = w[q:q + kv]
            out[p + "self_attn.v_proj.weight"] = w[q + kv:]
            if layer.qkv_bias is not None:
                b = layer.qkv_bias
                out[p + "self_attn.q_proj.bias"] = b[:q]
                out[p + "self_attn.k_proj.bias"] = b[q:q + kv]
                out[p + "self_attn.v_proj.bias"] = b[q + kv:]
            if layer.q_norm is not None and layer.k_norm is not None:
                out[p + "self_attn.q_norm.weight"] = layer.q_norm.weight
                out[p + "self_attn.k_norm.weight"] = layer.k_norm.weight
            out[p + "self_attn.o_proj.weight"] = layer.o_proj.dequantize()
            gate_up = layer.gate_up_proj.dequantize()
            out[p + "mlp.gate_proj.weight"] = gate_up[:inter]
            out[p + "mlp.up_proj.weight"] = gate_up[inter:]
            out[p + "mlp.down_proj.weight"] = layer.down_proj.dequantize()
            out[p + "input_layernorm.weight"] = layer.input_layernorm.weight
            out[p + "post_attention_layernorm.weight"] = layer.post_attention_layernorm.weight
        return {k: v.detach() for k, v in out.items()}
