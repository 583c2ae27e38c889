"""Ling / BailingHybrid (``BailingHybridForCausalLM``): MLA full-attention layers between Kimi
Delta Attention (KDA) linear layers, with DeepSeek-style MoE.

Layer pattern: ``layer_types[i]`` (HF derives it from ``layer_group_size``: the last layer of
every group is ``full_attention``, the others ``linear_attention``). MLP: ``mlp_layer_types[i]``
(HF derives it from ``first_k_dense_replace``: dense first, then ``sparse``).

Per layer: ``h += attn(norm(h))``; ``h += mlp(norm(h))``.

* Full attention: DeepSeek-V3's MLA (:class:`tokenmill.models.deepseek_v3.MLA`, ``q_proj`` only,
  interleaved rope) over the paged latent cache, its heads' outputs multiplied by a per-head
  gate ``sigmoid(g_proj(x))`` before ``o_proj``.
* KDA (linear attention, :class:`KDA`): ``q, k, v = conv(silu)(q_proj x ; k_proj x ; v_proj x)``
  (one depthwise causal conv of width ``short_conv_kernel_size`` over the three), a per-channel
  forget gate ``g = lower_bound * sigmoid(exp(A_log) * (f_proj x + dt_bias))`` (``kda_safe_gate``;
  else ``-exp(A_log) * softplus(f_proj x + dt_bias)``), ``beta = sigmoid(b_proj x)``, the gated
  delta rule with l2-normed q and k (:mod:`tokenmill.layers.linear_attention`), then a gated
  RMSNorm per head ``norm(o) * sigmoid(g_proj x)`` and ``o_proj``. The layer's recurrent state
  ``[H, D, D]`` and conv state (the last K-1 inputs of the conv) live in the engine's state pool.
* MLP: dense SwiGLU, or routed experts with DeepSeek's sigmoid group-limited router plus
  ``num_shared_experts`` shared experts (:class:`tokenmill.models.deepseek_v3.MoE`; same op order
  as HF's ``BailingHybridTopkRouter``).

KV spec: :class:`~tokenmill.contracts.kv.LatentKV` for attention layers,
:class:`~tokenmill.contracts.kv.LinearState` for KDA layers.

Weights are read under the checkpoint's own names (``model.word_embeddings``, ``attention.dense``,
``q_conv1d`` / ``k_conv1d`` / ``v_conv1d``, ``mlp.gate.expert_bias``, one tensor per expert) or
HF's in-memory names. MTP layers (``model.layers.{num_hidden_layers + i}.*``) are loaded and kept
in :attr:`BailingHybridForCausalLM.mtp_weights` under their checkpoint names; the engine does not
run them (HF's class does not either).
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Mapping

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.contracts.errors import ModelLoadError
from tokenmill.contracts.kv import KVCacheSpec, LatentKV, LinearState
from tokenmill.layers.attention import ForwardContext
from tokenmill.layers.linear_attention import causal_conv_step, gated_delta_step
from tokenmill.layers.norm import RMSNorm
from tokenmill.layers.rotary import CosSin, RotaryEmbedding
from tokenmill.models.base import CausalLM
from tokenmill.models.deepseek_v3 import (MLA, DeepseekV3Args, DenseMLP, MoE, decoder_stack_forward,
                                          fuse_expert_weights, split_mtp_weights)

FULL, LINEAR = "full_attention", "linear_attention"
DENSE, SPARSE = "dense", "sparse"


@dataclass(frozen=True)
class BailingHybridArgs:
    """The BailingHybrid config fields that change the math. ``mla`` carries the attention and
    MoE sizes in DeepSeek-V3's terms (the code is shared)."""

    mla: DeepseekV3Args
    layer_types: tuple[str, ...]
    mlp_layer_types: tuple[str, ...]
    linear_num_heads: int
    linear_head_dim: int
    conv_kernel: int
    kda_safe_gate: bool
    kda_lower_bound: float

    def __post_init__(self) -> None:
        n = self.mla.num_layers
        if len(self.layer_types) != n or any(t not in (FULL, LINEAR) for t in self.layer_types):
            raise ModelLoadError(f"model config: layer_types={list(self.layer_types)!r} must list {n} entries of "
                                 f"{FULL!r} / {LINEAR!r}")
        if len(self.mlp_layer_types) != n or any(t not in (DENSE, SPARSE) for t in self.mlp_layer_types):
            raise ModelLoadError(f"model config: mlp_layer_types={list(self.mlp_layer_types)!r} must list {n} "
                                 f"entries of {DENSE!r} / {SPARSE!r}")
        for name in ("linear_num_heads", "linear_head_dim", "conv_kernel"):
            if getattr(self, name) <= 0:
                raise ModelLoadError(f"model config: {name}={getattr(self, name)!r} must be positive")

    @property
    def num_layers(self) -> int:
        return self.mla.num_layers

    @property
    def vocab_size(self) -> int:
        return self.mla.vocab_size

    @property
    def hidden_size(self) -> int:
        return self.mla.hidden_size

    @property
    def num_heads(self) -> int:
        return self.mla.num_heads

    @property
    def max_position_embeddings(self) -> int:
        return self.mla.max_position_embeddings

    @property
    def qkv_dim(self) -> int:
        return self.linear_num_heads * self.linear_head_dim

    def linear_state(self) -> LinearState:
        d = self.linear_head_dim
        return LinearState(self.linear_num_heads, d, d, 3 * self.qkv_dim, self.conv_kernel)


def _param(*shape: int, dtype: torch.dtype) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)


class GatedMLA(nn.Module):
    """DeepSeek-V3's MLA with Ling's per-head output gate."""

    def __init__(self, a: DeepseekV3Args, dtype: torch.dtype) -> None:
        super().__init__()
        self.mla = MLA(a, dtype)
        self.g_proj = _param(a.num_heads, a.hidden_size, dtype=dtype)
        self.heads = a.num_heads

    def forward(self, x: torch.Tensor, cs: CosSin, kv_cache: Any, ctx: ForwardContext, layer_idx: int) -> torch.Tensor:
        o = self.mla.attend(x, cs, kv_cache, ctx)
        gate = torch.sigmoid(F.linear(x, self.g_proj).float()).to(x.dtype)
        o = (o.view(x.shape[0], self.heads, -1) * gate.unsqueeze(-1)).view(x.shape[0], -1)
        return F.linear(o, self.mla.o_proj, self.mla.o_bias)


class KDA(nn.Module):
    """Kimi Delta Attention: the linear-attention layer (see the module docstring)."""

    def __init__(self, a: BailingHybridArgs, dtype: torch.dtype) -> None:
        super().__init__()
        self.a = a
        h, qkv, n = a.mla.hidden_size, a.qkv_dim, a.linear_num_heads
        self.qkv_proj = _param(3 * qkv, h, dtype=dtype)             # q_proj ; k_proj ; v_proj
        # Kept in fp32 whatever the model dtype, as HF does (_keep_in_fp32_modules_strict).
        self.conv_weight = _param(3 * qkv, a.conv_kernel, dtype=torch.float32)
        self.f_proj = _param(qkv, h, dtype=dtype)
        self.A_log = _param(n, dtype=torch.float32)
        self.dt_bias = _param(qkv, dtype=torch.float32)
        self.b_proj = _param(n, h, dtype=dtype)
        self.g_proj = _param(qkv, h, dtype=dtype)
        self.o_norm = _param(a.linear_head_dim, dtype=dtype)
        self.o_proj = _param(h, qkv, dtype=dtype)
        self.eps = a.mla.rms_norm_eps

    def forget_gate(self, x: torch.Tensor) -> torch.Tensor:
        n, d = self.a.linear_num_heads, self.a.linear_head_dim
        z = F.linear(x, self.f_proj).float().view(-1, n, d) + self.dt_bias.view(n, d)
        rate = self.A_log.exp().view(n, 1)
        if self.a.kda_safe_gate:
            g = self.a.kda_lower_bound * torch.sigmoid(rate * z)
        else:
            g = -rate * F.softplus(z)
        return g.to(x.dtype)

    def forward(self, x: torch.Tensor, cs: CosSin, kv_cache: Any, ctx: ForwardContext, layer_idx: int) -> torch.Tensor:
        a = self.a
        t, n, d = x.shape[0], a.linear_num_heads, a.linear_head_dim
        mixed = causal_conv_step(F.linear(x, self.qkv_proj), self.conv_weight, None, ctx, layer_idx, "silu")
        q, k, v = (y.reshape(t, n, d) for y in mixed.split(a.qkv_dim, dim=-1))
        beta = torch.sigmoid(F.linear(x, self.b_proj))
        o = gated_delta_step(q, k, v, self.forget_gate(x), beta, ctx, layer_idx, use_l2norm=True)
        # Gated RMSNorm per head, strictly in fp32 (HF's BailingHybridRMSNormGated).
        gate = F.linear(x, self.g_proj).view(t, n, d)
        of = o.float()
        of = of * torch.rsqrt(of.pow(2).mean(-1, keepdim=True) + self.eps) * self.o_norm.float()
        o = (of * torch.sigmoid(gate.float())).to(x.dtype)
        return F.linear(o.reshape(t, a.qkv_dim), self.o_proj)


class BailingHybridDecoderLayer(nn.Module):
    def __init__(self, a: BailingHybridArgs, index: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.is_linear = a.layer_types[index] == LINEAR
        self.self_attn: nn.Module = KDA(a, dtype) if self.is_linear else GatedMLA(a.mla, dtype)
        m = a.mla
        self.mlp: nn.Module = (MoE(m, dtype) if a.mlp_layer_types[index] == SPARSE
                               else DenseMLP(m.hidden_size, m.intermediate_size, dtype))
        self.input_layernorm = RMSNorm(m.hidden_size, m.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(m.hidden_size, m.rms_norm_eps)
        self.index = index

    def forward(self, h: torch.Tensor, cs: CosSin, kv_cache: Any, ctx: ForwardContext) -> torch.Tensor:
        h = h + self.self_attn(self.input_layernorm(h), cs, kv_cache, ctx, self.index)
        return h + self.mlp(self.post_attention_layernorm(h))


# Checkpoint names (Ling's own layout) -> HF transformers' in-memory names; the q/k/v convs and
# the per-expert tensors are fused separately.
_RENAMES = (
    (re.compile(r"^model\.word_embeddings\."), "model.embed_tokens."),
    (re.compile(r"\.attention\."), ".self_attn."),
    (re.compile(r"self_attn\.f_proj\."), "self_attn.forget_gate.f_proj."),
    (re.compile(r"self_attn\.dt_bias$"), "self_attn.forget_gate.dt_bias"),
    (re.compile(r"self_attn\.A_log$"), "self_attn.forget_gate.A_log"),
    (re.compile(r"\.self_attn\.dense\."), ".self_attn.o_proj."),
    (re.compile(r"\.mlp\.gate\.expert_bias$"), ".mlp.gate.e_score_correction_bias"),
)
_CONV = re.compile(r"^(model\.layers\.\d+\.self_attn)\.([qkv])_conv1d\.weight$")


def hf_names(weights: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Checkpoint tensors under HF's in-memory names (names already in that form pass through)."""
    out: dict[str, torch.Tensor] = {}
    convs: dict[str, dict[str, torch.Tensor]] = {}
    for name, t in weights.items():
        for pattern, repl in _RENAMES:
            name = pattern.sub(repl, name)
        m = _CONV.match(name)
        if m:
            convs.setdefault(m.group(1), {})[m.group(2)] = t
        else:
            out[name] = t
    for prefix, parts in convs.items():
        missing = [f"{prefix}.{p}_conv1d.weight" for p in "qkv" if p not in parts]
        if missing:
            raise ModelLoadError(f"checkpoint is missing tensor(s) {', '.join(missing)}")
        if prefix + ".conv1d.weight" in out:
            raise ModelLoadError(f"checkpoint has both fused and per-projection conv weights for {prefix}")
        out[prefix + ".conv1d.weight"] = torch.cat([parts[p] for p in "qkv"], dim=0)
    return out


class BailingHybridForCausalLM(CausalLM):
    """Ling (BailingHybrid) over a paged latent cache plus the state pool. Build, then ``load_weights``."""

    def __init__(self, args: BailingHybridArgs, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu") -> None:
        super().__init__()
        self.args = args  # type: ignore[assignment]
        self.dtype = dtype
        m = args.mla
        self.embed_tokens = _param(m.vocab_size, m.hidden_size, dtype=dtype)
        self.layers = nn.ModuleList(BailingHybridDecoderLayer(args, i, dtype) for i in range(args.num_layers))
        self.norm = RMSNorm(m.hidden_size, m.rms_norm_eps)
        self.lm_head = _param(m.vocab_size, m.hidden_size, dtype=dtype)
        self.rotary = RotaryEmbedding(m.qk_rope_head_dim, m.rope_theta, m.rope_scaling,
                                      initial_positions=min(m.max_position_embeddings, 4096))
        self.mtp_weights: dict[str, torch.Tensor] = {}

    def kv_cache_spec(self) -> KVCacheSpec:
        m = self.args.mla
        latent, state = LatentKV(m.kv_lora_rank, m.qk_rope_head_dim), self.args.linear_state()
        layers = tuple(state if t == LINEAR else latent for t in self.args.layer_types)
        return KVCacheSpec(layers, str(self.dtype).removeprefix("torch."))

    @torch.no_grad()
    def forward(self, ctx: ForwardContext) -> torch.Tensor:
        return decoder_stack_forward(self, ctx)

    # ---- weights -------------------------------------------------------------------------
    def _hf_layout(self) -> dict[str, tuple[int, ...]]:
        """HF in-memory name -> shape of every tensor."""
        a, m = self.args, self.args.mla
        h = m.hidden_size
        out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (m.vocab_size, h), "model.norm.weight": (h,),
                                           "lm_head.weight": (m.vocab_size, h)}
        for i in range(a.num_layers):
            p = f"model.layers.{i}."
            s = p + "self_attn."
            if a.layer_types[i] == LINEAR:
                qkv, n, d = a.qkv_dim, a.linear_num_heads, a.linear_head_dim
                for proj in ("q_proj", "k_proj", "v_proj", "g_proj"):
                    out[s + proj + ".weight"] = (qkv, h)
                out[s + "conv1d.weight"] = (3 * qkv, 1, a.conv_kernel)
                out[s + "forget_gate.f_proj.weight"] = (qkv, h)
                out[s + "forget_gate.A_log"] = (n,)
                out[s + "forget_gate.dt_bias"] = (qkv,)
                out[s + "b_proj.weight"] = (n, h)
                out[s + "o_norm.weight"] = (d,)
                out[s + "o_proj.weight"] = (h, qkv)
            else:
                out[s + "q_proj.weight"] = (m.num_heads * m.qk_head_dim, h)
                out[s + "kv_a_proj_with_mqa.weight"] = (m.kv_lora_rank + m.qk_rope_head_dim, h)
                if m.attention_bias:
                    out[s + "kv_a_proj_with_mqa.bias"] = (m.kv_lora_rank + m.qk_rope_head_dim,)
                    out[s + "o_proj.bias"] = (h,)
                out[s + "kv_a_layernorm.weight"] = (m.kv_lora_rank,)
                out[s + "kv_b_proj.weight"] = (m.num_heads * (m.qk_nope_head_dim + m.v_head_dim), m.kv_lora_rank)
                out[s + "o_proj.weight"] = (h, m.num_heads * m.v_head_dim)
                out[s + "g_proj.weight"] = (m.num_heads, h)
            out[p + "input_layernorm.weight"] = (h,)
            out[p + "post_attention_layernorm.weight"] = (h,)
            mp = p + "mlp."
            if a.mlp_layer_types[i] == SPARSE:
                e, f = m.n_routed_experts, m.moe_intermediate_size
                out[mp + "gate.weight"] = (e, h)
                out[mp + "gate.e_score_correction_bias"] = (e,)
                out[mp + "experts.gate_up_proj"] = (e, 2 * f, h)
                out[mp + "experts.down_proj"] = (e, h, f)
                if m.n_shared_experts:
                    fs = f * m.n_shared_experts
                    out[mp + "shared_experts.gate_proj.weight"] = (fs, h)
                    out[mp + "shared_experts.up_proj.weight"] = (fs, h)
                    out[mp + "shared_experts.down_proj.weight"] = (h, fs)
            else:
                out[mp + "gate_proj.weight"] = (m.intermediate_size, h)
                out[mp + "up_proj.weight"] = (m.intermediate_size, h)
                out[mp + "down_proj.weight"] = (h, m.intermediate_size)
        return out

    def load_weights(self, weights: Mapping[str, torch.Tensor]) -> None:
        a, m = self.args, self.args.mla
        main, mtp = split_mtp_weights(weights, a.num_layers, m.num_mtp_layers, self.dtype)
        self.mtp_weights.update(mtp)
        weights = fuse_expert_weights(hf_names(main), m.n_routed_experts)
        if not m.n_shared_experts:  # HF saves zero-size shared experts when there are none
            weights = {k: v for k, v in weights.items() if not (".shared_experts." in k and v.numel() == 0)}
        self.check_weights(weights, self._hf_layout())

        def get(name: str, dtype: torch.dtype | None = None) -> torch.Tensor:
            return weights[name].to(dtype or self.dtype).contiguous()

        self.embed_tokens.data = get("model.embed_tokens.weight")
        self.lm_head.data = get("lm_head.weight")
        self.norm.weight.data = get("model.norm.weight")
        for i, layer in enumerate(self.layers):
            p = f"model.layers.{i}."
            s, att = p + "self_attn.", layer.self_attn
            if isinstance(att, KDA):
                att.qkv_proj.data = torch.cat([get(s + f"{x}_proj.weight") for x in "qkv"])
                att.conv_weight.data = get(s + "conv1d.weight", torch.float32).squeeze(1).contiguous()
                att.f_proj.data = get(s + "forget_gate.f_proj.weight")
                att.A_log.data = get(s + "forget_gate.A_log", torch.float32)
                att.dt_bias.data = get(s + "forget_gate.dt_bias", torch.float32)
                att.b_proj.data = get(s + "b_proj.weight")
                att.g_proj.data = get(s + "g_proj.weight")
                att.o_norm.data = get(s + "o_norm.weight")
                att.o_proj.data = get(s + "o_proj.weight")
            else:
                assert isinstance(att, GatedMLA)
                mla = att.mla
                mla.q_proj.data = get(s + "q_proj.weight")
                mla.kv_a_proj.data = get(s + "kv_a_proj_with_mqa.weight")
                if m.attention_bias:
                    mla.kv_a_bias.data = get(s + "kv_a_proj_with_mqa.bias")
                    mla.o_bias.data = get(s + "o_proj.bias")
                mla.kv_a_layernorm.weight.data = get(s + "kv_a_layernorm.weight")
                mla.kv_b_proj.data = get(s + "kv_b_proj.weight")
                mla.o_proj.data = get(s + "o_proj.weight")
                att.g_proj.data = get(s + "g_proj.weight")
            layer.input_layernorm.weight.data = get(p + "input_layernorm.weight")
            layer.post_attention_layernorm.weight.data = get(p + "post_attention_layernorm.weight")
            mp, mlp = p + "mlp.", layer.mlp
            if isinstance(mlp, MoE):
                mlp.gate.data = get(mp + "gate.weight")
                mlp.e_score_correction_bias.copy_(weights[mp + "gate.e_score_correction_bias"].float())
                mlp.experts_gate_up.data = get(mp + "experts.gate_up_proj")
                mlp.experts_down.data = get(mp + "experts.down_proj")
                if mlp.shared is not None:
                    mlp.shared.gate_up_proj.data = torch.cat(
                        (get(mp + "shared_experts.gate_proj.weight"), get(mp + "shared_experts.up_proj.weight")))
                    mlp.shared.down_proj.data = get(mp + "shared_experts.down_proj.weight")
            else:
                assert isinstance(mlp, DenseMLP)
                mlp.gate_up_proj.data = torch.cat((get(mp + "gate_proj.weight"), get(mp + "up_proj.weight")))
                mlp.down_proj.data = get(mp + "down_proj.weight")

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        """Weights under HF transformers' in-memory names (fused experts and conv), as views."""
        a = self.args
        out = {"model.embed_tokens.weight": self.embed_tokens, "model.norm.weight": self.norm.weight,
               "lm_head.weight": self.lm_head}
        for i, layer in enumerate(self.layers):
            p = f"model.layers.{i}."
            s, att = p + "self_attn.", layer.self_attn
            if isinstance(att, KDA):
                qkv = a.qkv_dim
                for j, x in enumerate("qkv"):
                    out[s + f"{x}_proj.weight"] = att.qkv_proj[j * qkv:(j + 1) * qkv]
                out[s + "conv1d.weight"] = att.conv_weight.unsqueeze(1)
                out[s + "forget_gate.f_proj.weight"] = att.f_proj
                out[s + "forget_gate.A_log"] = att.A_log
                out[s + "forget_gate.dt_bias"] = att.dt_bias
                out[s + "b_proj.weight"] = att.b_proj
                out[s + "g_proj.weight"] = att.g_proj
                out[s + "o_norm.weight"] = att.o_norm
                out[s + "o_proj.weight"] = att.o_proj
            else:
                assert isinstance(att, GatedMLA)
                out.update(att.mla.hf_tensors(s))
                out[s + "g_proj.weight"] = att.g_proj
            out[p + "input_layernorm.weight"] = layer.input_layernorm.weight
            out[p + "post_attention_layernorm.weight"] = layer.post_attention_layernorm.weight
            out.update(layer.mlp.hf_tensors(p + "mlp."))
        return {k: v.detach() for k, v in out.items()}
