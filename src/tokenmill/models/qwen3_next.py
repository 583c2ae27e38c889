"""Qwen3-Next: a hybrid of Gated DeltaNet linear-attention layers and gated full-attention
layers, with a mixture of experts plus a gated shared expert.

Layer pattern (``layer_types``, which HF derives from ``full_attention_interval``)::

    linear_attention   Gated DeltaNet: in_proj_qkvz / in_proj_ba -> short causal conv (SiLU) over
                       q|k|v -> gated delta rule (per-head decay g = -exp(A_log) softplus(a + dt_bias),
                       beta = sigmoid(b), l2-normed q and k) -> RMSNorm gated by silu(z) -> out_proj.
                       State: one slot of the state pool per request (LinearState in the KV spec).
    full_attention     GQA over the paged KV: q_proj gives the query and an output gate per head,
                       q/k RMSNorm per head, rotary on the first ``partial_rotary_factor`` of each
                       head, output * sigmoid(gate) -> o_proj.

MLP of layer ``i``: MoE (softmax router, top-k, optionally renormalised; routed experts plus a
shared expert scaled by ``sigmoid(shared_expert_gate(x))``) when ``num_experts > 0``,
``(i + 1) % decoder_sparse_step == 0`` and ``i`` is not in ``mlp_only_layers``; a dense SwiGLU
MLP otherwise. Norms are zero-centred (``1 + weight``), except the gated norm of the linear
layers (plain ``weight``), exactly as HF transformers' ``Qwen3NextForCausalLM``.

The linear layers' kernels (chunked prefill from the slot's state, batched recurrent decode,
the varlen conv) live in :mod:`tokenmill.layers.linear_attention`; this module only shapes the
tensors. Multi-token-prediction weights (``mtp.*``) are not used and are dropped at load.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Mapping

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.contracts.errors import ModelLoadError
from tokenmill.contracts.kv import KVCacheSpec, LinearState, PagedKV
from tokenmill.layers.attention import ForwardContext
from tokenmill.layers.linear import DenseLinear
from tokenmill.layers.linear_attention import causal_conv_step, gated_delta_step
from tokenmill.layers.moe import GroupedExperts
from tokenmill.layers.norm import ZeroCenteredRMSNorm
from tokenmill.layers.quant.methods import cat_linears
from tokenmill.layers.rotary import CosSin, RotaryEmbedding, apply_rotary
from tokenmill.models.base import CausalLM

LINEAR, FULL = "linear_attention", "full_attention"


@dataclass(frozen=True)
class Qwen3NextArgs:
    """The Qwen3NextConfig fields that change the math (see models/registry.py for the refusals)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    layer_types: tuple[str, ...]
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int
    num_experts: int = 0
    num_experts_per_tok: int = 1
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    partial_rotary_factor: float = 0.25
    rope_scaling: Mapping[str, Any] | None = None
    attention_bias: bool = False
    tie_word_embeddings: bool = False

    def __post_init__(self) -> None:
        def bad(field: str, why: str) -> ModelLoadError:
            return ModelLoadError(f"Qwen3-Next config: {field}={getattr(self, field)!r} {why}")

        for name in ("vocab_size", "hidden_size", "num_heads", "num_kv_heads", "head_dim", "max_position_embeddings",
                     "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
                     "linear_value_head_dim", "linear_conv_kernel_dim", "decoder_sparse_step"):
            if getattr(self, name) <= 0:
                raise bad(name, "must be positive")
        if not self.layer_types:
            raise bad("layer_types", "is empty (num_hidden_layers must be positive)")
        unknown = sorted(set(self.layer_types) - {LINEAR, FULL})
        if unknown:
            raise bad("layer_types", f"has layer type(s) {unknown}; supported: {LINEAR!r}, {FULL!r}")
        if FULL not in self.layer_types:
            raise bad("layer_types", "has no full_attention layer; tokenmill serves Qwen3-Next with at least one")
        if self.num_heads % self.num_kv_heads:
            raise bad("num_attention_heads", f"is not a multiple of num_key_value_heads={self.num_kv_heads}")
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise bad("linear_num_value_heads", f"is not a multiple of linear_num_key_heads={self.linear_num_key_heads}")
        rot = self.rotary_dim
        if not 0 < self.partial_rotary_factor <= 1 or rot <= 0 or rot % 2:
            raise bad("partial_rotary_factor", f"gives a rotary dimension of {rot} for head_dim={self.head_dim}; it "
                                               f"must be even and positive")
        if self.num_experts < 0:
            raise bad("num_experts", "must be >= 0")
        if self.num_experts and not 0 < self.num_experts_per_tok <= self.num_experts:
            raise bad("num_experts_per_tok", f"must be in 1..num_experts={self.num_experts}")
        if self.num_experts and self.moe_intermediate_size <= 0:
            raise bad("moe_intermediate_size", "must be positive with num_experts > 0")
        if self.shared_expert_intermediate_size < 0:
            raise bad("shared_expert_intermediate_size", "must be >= 0")
        if any(not self.is_moe_layer(i) for i in range(self.num_layers)) and self.intermediate_size <= 0:
            raise bad("intermediate_size", "must be positive (some layers use the dense MLP)")

    @property
    def num_layers(self) -> int:
        return len(self.layer_types)

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def key_dim(self) -> int:
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def value_dim(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def conv_dim(self) -> int:
        return 2 * self.key_dim + self.value_dim

    def is_moe_layer(self, i: int) -> bool:
        """HF's rule: MoE unless the layer is listed in mlp_only_layers or off the sparse step."""
        return (i not in self.mlp_only_layers and self.num_experts > 0
                and (i + 1) % self.decoder_sparse_step == 0)


def _param(*shape: int, dtype: torch.dtype) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)


class GatedAttention(nn.Module):
    """Full attention with a per-head output gate (q_proj holds query and gate), q/k norms and
    partial rotary, over the paged KV backend."""

    def __init__(self, a: Qwen3NextArgs, dtype: torch.dtype) -> None:
        super().__init__()
        self.h, self.kv, self.d, self.rot = a.num_heads, a.num_kv_heads, a.head_dim, a.rotary_dim
        self.q_rows = 2 * a.num_heads * a.head_dim
        self.kv_rows = a.num_kv_heads * a.head_dim
        self.qkv_proj = DenseLinear.empty(self.q_rows + 2 * self.kv_rows, a.hidden_size, dtype)
        self.qkv_bias = _param(self.q_rows + 2 * self.kv_rows, dtype=dtype) if a.attention_bias else None
        self.o_proj = DenseLinear.empty(a.hidden_size, a.num_heads * a.head_dim, dtype)
        self.o_bias = _param(a.hidden_size, dtype=dtype) if a.attention_bias else None
        self.q_norm = ZeroCenteredRMSNorm(a.head_dim, a.rms_norm_eps)
        self.k_norm = ZeroCenteredRMSNorm(a.head_dim, a.rms_norm_eps)
        self.scale = a.head_dim ** -0.5

    def _rope(self, x: torch.Tensor, cs: CosSin) -> torch.Tensor:
        if self.rot == self.d:
            return apply_rotary(x, cs)
        return torch.cat((apply_rotary(x[..., :self.rot], cs), x[..., self.rot:]), dim=-1)

    def forward(self, x: torch.Tensor, cs: CosSin, kv_cache: Any, ctx: ForwardContext) -> torch.Tensor:
        t = x.shape[0]
        qg, k, v = self.qkv_proj(x, self.qkv_bias).split([self.q_rows, self.kv_rows, self.kv_rows], dim=-1)
        q, gate = qg.view(t, self.h, 2 * self.d).chunk(2, dim=-1)
        q = self._rope(self.q_norm(q), cs)
        k = self._rope(self.k_norm(k.view(t, self.kv, self.d)), cs)
        o = ctx.attn.forward(q, k, v.view(t, self.kv, self.d), kv_cache, ctx.meta, self.scale)
        o = o * torch.sigmoid(gate.reshape(t, self.h * self.d))
        return self.o_proj(o, self.o_bias)


class GatedDeltaNet(nn.Module):
    """The linear-attention token mixer; its state lives in ``ctx.states`` at layer ``index``."""

    def __init__(self, a: Qwen3NextArgs, index: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.index = index
        self.nk, self.nv = a.linear_num_key_heads, a.linear_num_value_heads
        self.dk, self.dv = a.linear_key_head_dim, a.linear_value_head_dim
        self.r = self.nv // self.nk
        self.key_dim, self.value_dim = a.key_dim, a.value_dim
        self.in_proj_qkvz = DenseLinear.empty(2 * a.key_dim + 2 * a.value_dim, a.hidden_size, dtype)
        self.in_proj_ba = DenseLinear.empty(2 * self.nv, a.hidden_size, dtype)
        self.conv_weight = _param(a.conv_dim, a.linear_conv_kernel_dim, dtype=dtype)   # HF [C, 1, K] squeezed
        self.dt_bias = _param(self.nv, dtype=dtype)
        self.A_log = _param(self.nv, dtype=dtype)
        self.norm_weight = _param(self.dv, dtype=dtype)
        self.eps = a.rms_norm_eps
        self.out_proj = DenseLinear.empty(a.hidden_size, a.value_dim, dtype)

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        t = x.shape[0]
        nk, r, dk, dv = self.nk, self.r, self.dk, self.dv
        # HF groups the projections by key head: [q dk | k dk | v r*dv | z r*dv] per key head.
        qkvz = self.in_proj_qkvz(x).view(t, nk, 2 * dk + 2 * r * dv)
        q, k, v, z = qkvz.split([dk, dk, r * dv, r * dv], dim=-1)
        b, a = self.in_proj_ba(x).view(t, nk, 2 * r).split([r, r], dim=-1)
        mixed = torch.cat((q.reshape(t, -1), k.reshape(t, -1), v.reshape(t, -1)), dim=-1)
        mixed = causal_conv_step(mixed, self.conv_weight, None, ctx, self.index, activation="silu")
        q, k, v = mixed.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        q, k = q.reshape(t, nk, dk), k.reshape(t, nk, dk)
        if r > 1:   # each key head serves r consecutive value heads
            q, k = q.repeat_interleave(r, dim=1), k.repeat_interleave(r, dim=1)
        beta = b.reshape(t, self.nv).sigmoid()
        g = -self.A_log.float().exp() * F.softplus(a.reshape(t, self.nv).float() + self.dt_bias)
        o = gated_delta_step(q, k, v.reshape(t, self.nv, dv), g, beta, ctx, self.index, use_l2norm=True)
        # RMSNorm (plain weight) gated by silu(z), per value head
        of = o.float()
        of = of * torch.rsqrt(of.pow(2).mean(-1, keepdim=True) + self.eps)
        of = (self.norm_weight * of.to(o.dtype)).float() * F.silu(z.reshape(t, self.nv, dv).float())
        return self.out_proj(of.to(x.dtype).reshape(t, self.value_dim))


class DenseMLP(nn.Module):
    def __init__(self, hidden: int, inter: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.gate_up_proj = DenseLinear.empty(2 * inter, hidden, dtype)
        self.down_proj = DenseLinear.empty(hidden, inter, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class SparseMoE(nn.Module):
    """Softmax top-k router over grouped experts, plus a shared expert behind a sigmoid gate."""

    def __init__(self, a: Qwen3NextArgs, dtype: torch.dtype) -> None:
        super().__init__()
        e, h, f = a.num_experts, a.hidden_size, a.moe_intermediate_size
        self.top_k, self.norm_topk_prob = a.num_experts_per_tok, a.norm_topk_prob
        self.gate = _param(e, h, dtype=dtype)
        self.experts_gate_up = _param(e, 2 * f, h, dtype=dtype)
        self.experts_down = _param(e, h, f, dtype=dtype)
        fs = a.shared_expert_intermediate_size
        self.shared = DenseMLP(h, fs, dtype) if fs else None
        self.shared_gate = _param(1, h, dtype=dtype)
        self._experts: GroupedExperts | None = None

    def experts(self) -> GroupedExperts:
        w = self.experts_gate_up
        if self._experts is None or self._experts.gate_up.data_ptr() != w.data_ptr() or self._experts.gate_up.device != w.device:
            self._experts = GroupedExperts(self.experts_gate_up.data, self.experts_down.data)
        return self._experts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = F.linear(x, self.gate)
        probs = F.softmax(logits, dim=-1, dtype=torch.float)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        out = self.experts()(x, weights.to(logits.dtype), ids)
        if self.shared is not None:
            out = out + torch.sigmoid(F.linear(x, self.shared_gate)) * self.shared(x)
        return out


class Qwen3NextDecoderLayer(nn.Module):
    def __init__(self, a: Qwen3NextArgs, index: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.kind = a.layer_types[index]
        self.mixer: nn.Module = GatedDeltaNet(a, index, dtype) if self.kind == LINEAR else GatedAttention(a, dtype)
        self.mlp: nn.Module = (SparseMoE(a, dtype) if a.is_moe_layer(index)
                               else DenseMLP(a.hidden_size, a.intermediate_size, dtype))
        self.input_layernorm = ZeroCenteredRMSNorm(a.hidden_size, a.rms_norm_eps)
        self.post_attention_layernorm = ZeroCenteredRMSNorm(a.hidden_size, a.rms_norm_eps)

    def forward(self, h: torch.Tensor, cs: CosSin, kv_cache: Any, ctx: ForwardContext) -> torch.Tensor:
        x = self.input_layernorm(h)
        if isinstance(self.mixer, GatedDeltaNet):
            h = h + self.mixer(x, ctx)
        else:
            h = h + self.mixer(x, cs, kv_cache, ctx)
        return h + self.mlp(self.post_attention_layernorm(h))


_EXPERT = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


class Qwen3NextForCausalLM(CausalLM):
    """Qwen3-Next over paged KV (full-attention layers) and the state pool (linear layers)."""

    def __init__(self, args: Qwen3NextArgs, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu") -> None:
        super().__init__()
        self.args = args  # type: ignore[assignment]
        self.dtype = dtype
        self.embed_tokens = DenseLinear.empty(args.vocab_size, args.hidden_size, dtype)
        self.layers = nn.ModuleList(Qwen3NextDecoderLayer(args, i, dtype) for i in range(args.num_layers))
        self.norm = ZeroCenteredRMSNorm(args.hidden_size, args.rms_norm_eps)
        self.lm_head = self.embed_tokens if args.tie_word_embeddings else DenseLinear.empty(
            args.vocab_size, args.hidden_size, dtype)
        self.rotary = RotaryEmbedding(args.rotary_dim, args.rope_theta, args.rope_scaling,
                                      initial_positions=min(args.max_position_embeddings, 4096))

    def kv_cache_spec(self) -> KVCacheSpec:
        a = self.args
        attn = PagedKV(a.num_kv_heads, a.head_dim)
        lin = LinearState(a.linear_num_value_heads, a.linear_key_head_dim, a.linear_value_head_dim, a.conv_dim,
                          a.linear_conv_kernel_dim)
        return KVCacheSpec(tuple(lin if t == LINEAR else attn for t in a.layer_types),
                           str(self.dtype).removeprefix("torch."))

    @torch.no_grad()
    def forward(self, ctx: ForwardContext) -> torch.Tensor:
        batch = ctx.batch
        if len(ctx.kv_caches) != len(self.layers):
            raise ValueError(f"expected {len(self.layers)} KV cache entries, got {len(ctx.kv_caches)}")
        cs = self.rotary.lookup(batch.positions, self.dtype, batch.max_seq_len)
        h = self.embed_tokens.embedding(batch.input_ids, self.dtype)
        ctx.capture(-1, h)
        for i, (layer, cache) in enumerate(zip(self.layers, ctx.kv_caches)):
            h = layer(h, cs, cache, ctx)
            ctx.capture(i, h)
        h = self.norm(h[batch.logits_indices])
        return self.lm_head(h).float()

    # ---- weights -------------------------------------------------------------------------
    def _hf_layout(self) -> dict[str, tuple[int, ...]]:
        """HF tensor name -> shape (routed experts in HF's fused in-memory layout)."""
        a = self.args
        h = a.hidden_size
        out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (a.vocab_size, h), "model.norm.weight": (h,)}
        if not a.tie_word_embeddings:
            out["lm_head.weight"] = (a.vocab_size, h)
        for i, kind in enumerate(a.layer_types):
            p = f"model.layers.{i}."
            out[p + "input_layernorm.weight"] = (h,)
            out[p + "post_attention_layernorm.weight"] = (h,)
            if kind == LINEAR:
                s = p + "linear_attn."
                out[s + "in_proj_qkvz.weight"] = (2 * a.key_dim + 2 * a.value_dim, h)
                out[s + "in_proj_ba.weight"] = (2 * a.linear_num_value_heads, h)
                out[s + "conv1d.weight"] = (a.conv_dim, 1, a.linear_conv_kernel_dim)
                out[s + "dt_bias"] = (a.linear_num_value_heads,)
                out[s + "A_log"] = (a.linear_num_value_heads,)
                out[s + "norm.weight"] = (a.linear_value_head_dim,)
                out[s + "out_proj.weight"] = (h, a.value_dim)
            else:
                s = p + "self_attn."
                q, kv = a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim
                out[s + "q_proj.weight"] = (2 * q, h)
                out[s + "k_proj.weight"] = (kv, h)
                out[s + "v_proj.weight"] = (kv, h)
                out[s + "o_proj.weight"] = (h, q)
                if a.attention_bias:
                    out[s + "q_proj.bias"] = (2 * q,)
                    out[s + "k_proj.bias"] = (kv,)
                    out[s + "v_proj.bias"] = (kv,)
                    out[s + "o_proj.bias"] = (h,)
                out[s + "q_norm.weight"] = (a.head_dim,)
                out[s + "k_norm.weight"] = (a.head_dim,)
            m = p + "mlp."
            if a.is_moe_layer(i):
                e, f, fs = a.num_experts, a.moe_intermediate_size, a.shared_expert_intermediate_size
                out[m + "gate.weight"] = (e, h)
                out[m + "experts.gate_up_proj"] = (e, 2 * f, h)
                out[m + "experts.down_proj"] = (e, h, f)
                if fs:
                    out[m + "shared_expert.gate_proj.weight"] = (fs, h)
                    out[m + "shared_expert.up_proj.weight"] = (fs, h)
                    out[m + "shared_expert.down_proj.weight"] = (h, fs)
                out[m + "shared_expert_gate.weight"] = (1, h)
            else:
                out[m + "gate_proj.weight"] = (a.intermediate_size, h)
                out[m + "up_proj.weight"] = (a.intermediate_size, h)
                out[m + "down_proj.weight"] = (h, a.intermediate_size)
        return out

    def _fuse_experts(self, weights: Mapping[str, Any]) -> dict[str, Any]:
        """Per-expert checkpoint tensors (``experts.{j}.gate_proj.weight``, as Qwen3-Next ships and
        HF saves) -> HF's fused ``experts.gate_up_proj`` [E, 2I, H] and ``experts.down_proj`` [E, H, I]."""
        out: dict[str, Any] = {}
        per: dict[str, dict[int, dict[str, torch.Tensor]]] = {}
        for name, t in weights.items():
            if name.startswith("mtp."):   # multi-token-prediction head: not used for serving
                continue
            m = _EXPERT.match(name)
            if m:
                per.setdefault(m.group(1), {}).setdefault(int(m.group(2)), {})[m.group(3)] = t
            else:
                out[name] = t
        e = self.args.num_experts
        for prefix, experts in per.items():
            extra = sorted(j for j in experts if not 0 <= j < e)
            if extra:
                raise ModelLoadError(f"checkpoint has expert {extra[0]} in {prefix}, but num_experts={e}")
            missing = [f"{prefix}.{j}.{w}.weight" for j in range(e) for w in ("gate_proj", "up_proj", "down_proj")
                       if w not in experts.get(j, {})]
            if missing:
                raise ModelLoadError(f"checkpoint is missing tensor(s) {', '.join(missing[:5])}")
            try:
                out[prefix + ".gate_up_proj"] = torch.stack(
                    [torch.cat((experts[j]["gate_proj"], experts[j]["up_proj"]), dim=0) for j in range(e)])
                out[prefix + ".down_proj"] = torch.stack([experts[j]["down_proj"] for j in range(e)])
            except RuntimeError as err:
                raise ModelLoadError(f"expert weights of {prefix} have inconsistent shapes: {err}") from err
        return out

    def load_weights(self, weights: Mapping[str, Any]) -> None:
        weights = self._fuse_experts(weights)
        if not self.args.shared_expert_intermediate_size:   # HF saves zero-width shared experts
            weights = {k: v for k, v in weights.items() if not (".shared_expert." in k and v.numel() == 0)}
        self.check_weights(weights, self._hf_layout())

        def get(name: str) -> torch.Tensor:
            return weights[name].to(self.dtype).contiguous()

        def linear(*names: str):
            return cat_linears([weights[n] for n in names], self.dtype)

        a = self.args
        self.embed_tokens = linear("model.embed_tokens.weight")
        self.lm_head = self.embed_tokens if a.tie_word_embeddings else linear("lm_head.weight")
        self.norm.weight.data = get("model.norm.weight")
        for i, layer in enumerate(self.layers):
            p = f"model.layers.{i}."
            layer.input_layernorm.weight.data = get(p + "input_layernorm.weight")
            layer.post_attention_layernorm.weight.data = get(p + "post_attention_layernorm.weight")
            mix = layer.mixer
            if isinstance(mix, GatedDeltaNet):
                s = p + "linear_attn."
                mix.in_proj_qkvz = linear(s + "in_proj_qkvz.weight")
                mix.in_proj_ba = linear(s + "in_proj_ba.weight")
                mix.conv_weight.data = get(s + "conv1d.weight").squeeze(1).contiguous()
                mix.dt_bias.data = get(s + "dt_bias")
                mix.A_log.data = get(s + "A_log")
                mix.norm_weight.data = get(s + "norm.weight")
                mix.out_proj = linear(s + "out_proj.weight")
            else:
                assert isinstance(mix, GatedAttention)
                s = p + "self_attn."
                mix.qkv_proj = linear(s + "q_proj.weight", s + "k_proj.weight", s + "v_proj.weight")
                mix.o_proj = linear(s + "o_proj.weight")
                if mix.qkv_bias is not None and mix.o_bias is not None:
                    mix.qkv_bias.data = torch.cat([get(s + n) for n in ("q_proj.bias", "k_proj.bias", "v_proj.bias")])
                    mix.o_bias.data = get(s + "o_proj.bias")
                mix.q_norm.weight.data = get(s + "q_norm.weight")
                mix.k_norm.weight.data = get(s + "k_norm.weight")
            m, mlp = p + "mlp.", layer.mlp
            if isinstance(mlp, SparseMoE):
                mlp.gate.data = get(m + "gate.weight")
                mlp.experts_gate_up.data = get(m + "experts.gate_up_proj")
                mlp.experts_down.data = get(m + "experts.down_proj")
                mlp.shared_gate.data = get(m + "shared_expert_gate.weight")
                if mlp.shared is not None:
                    mlp.shared.gate_up_proj = linear(m + "shared_expert.gate_proj.weight", m + "shared_expert.up_proj.weight")
                    mlp.shared.down_proj = linear(m + "shared_expert.down_proj.weight")
            else:
                assert isinstance(mlp, DenseMLP)
                mlp.gate_up_proj = linear(m + "gate_proj.weight", m + "up_proj.weight")
                mlp.down_proj = linear(m + "down_proj.weight")

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        """Weights under HF transformers' in-memory names (fused experts)."""
        a = self.args
        head = self.lm_head.dequantize()
        embed = head if self.embed_tokens is self.lm_head else self.embed_tokens.dequantize()
        out = {"model.embed_tokens.weight": embed, "model.norm.weight": self.norm.weight, "lm_head.weight": head}

        def halves(w: torch.Tensor, m: str) -> None:
            n = w.shape[0] // 2
            out[m + "gate_proj.weight"], out[m + "up_proj.weight"] = w[:n], w[n:]

        for i, layer in enumerate(self.layers):
            p = f"model.layers.{i}."
            out[p + "input_layernorm.weight"] = layer.input_layernorm.weight
            out[p + "post_attention_layernorm.weight"] = layer.post_attention_layernorm.weight
            mix = layer.mixer
            if isinstance(mix, GatedDeltaNet):
                s = p + "linear_attn."
                out[s + "in_proj_qkvz.weight"] = mix.in_proj_qkvz.dequantize()
                out[s + "in_proj_ba.weight"] = mix.in_proj_ba.dequantize()
                out[s + "conv1d.weight"] = mix.conv_weight.unsqueeze(1)
                out[s + "dt_bias"], out[s + "A_log"] = mix.dt_bias, mix.A_log
                out[s + "norm.weight"] = mix.norm_weight
                out[s + "out_proj.weight"] = mix.out_proj.dequantize()
            else:
                assert isinstance(mix, GatedAttention)
                s = p + "self_attn."
                w = mix.qkv_proj.dequantize()
                q, kv = mix.q_rows, mix.kv_rows
                out[s + "q_proj.weight"], out[s + "k_proj.weight"] = w[:q], w[q:q + kv]
                out[s + "v_proj.weight"] = w[q + kv:]
                out[s + "o_proj.weight"] = mix.o_proj.dequantize()
                if mix.qkv_bias is not None and mix.o_bias is not None:
                    b = mix.qkv_bias
                    out[s + "q_proj.bias"], out[s + "k_proj.bias"], out[s + "v_proj.bias"] = b[:q], b[q:q + kv], b[q + kv:]
                    out[s + "o_proj.bias"] = mix.o_bias
                out[s + "q_norm.weight"], out[s + "k_norm.weight"] = mix.q_norm.weight, mix.k_norm.weight
            m, mlp = p + "mlp.", layer.mlp
            if isinstance(mlp, SparseMoE):
                out[m + "gate.weight"] = mlp.gate
                out[m + "experts.gate_up_proj"] = mlp.experts_gate_up
                out[m + "experts.down_proj"] = mlp.experts_down
                out[m + "shared_expert_gate.weight"] = mlp.shared_gate
                if mlp.shared is not None:
                    halves(mlp.shared.gate_up_proj.dequantize(), m + "shared_expert.")
                    out[m + "shared_expert.down_proj.weight"] = mlp.shared.down_proj.dequantize()
                else:   # HF builds a zero-width shared expert when its size is 0
                    h = a.hidden_size
                    out[m + "shared_expert.gate_proj.weight"] = mlp.gate.new_empty(0, h)
                    out[m + "shared_expert.up_proj.weight"] = mlp.gate.new_empty(0, h)
                    out[m + "shared_expert.down_proj.weight"] = mlp.gate.new_empty(h, 0)
            else:
                assert isinstance(mlp, DenseMLP)
                halves(mlp.gate_up_proj.dequantize(), m)
                out[m + "down_proj.weight"] = mlp.down_proj.dequantize()
        return {k: v.detach() for k, v in out.items()}
