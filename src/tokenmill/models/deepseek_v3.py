"""DeepSeek-V3 / Kimi K2 (``DeepseekV3ForCausalLM``): multi-head latent attention and a
mixture of experts with a sigmoid, group-limited router.

Per layer: ``h += o_proj(MLA(norm(h)))``; ``h += MLP(norm(h))`` where the MLP is dense for the
first ``first_k_dense_replace`` layers and MoE after (routed experts + ``n_shared_experts``
shared experts of ``moe_intermediate_size * n_shared_experts``).

MLA (see :mod:`tokenmill.layers.attention.mla`): the query comes from ``q_proj`` or, with
``q_lora_rank``, from ``q_b_proj(norm(q_a_proj(x)))``; ``kv_a_proj_with_mqa`` gives the latent
(``kv_lora_rank``, normed) and the shared rope key (``qk_rope_head_dim``). The cache holds exactly
those two per token. The softmax scale is ``(qk_nope + qk_rope)^-0.5``, times ``mscale^2`` with
``mscale = 0.1 * mscale_all_dim * ln(factor) + 1`` under YaRN (HF's ``yarn_apply_mscale``).

MTP (multi-token prediction) layers, stored as ``model.layers.{num_hidden_layers + i}.*``, are
loaded when the checkpoint has them and kept in :attr:`DeepseekV3ForCausalLM.mtp_weights` (HF
names) for a drafter; the engine does not run them.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Mapping

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.contracts.errors import ModelLoadError
from tokenmill.contracts.kv import KVCacheSpec, LatentKV
from tokenmill.layers.attention import ForwardContext, MLAAttention
from tokenmill.layers.moe import GroupedExperts, route_sigmoid_grouped
from tokenmill.layers.norm import RMSNorm
from tokenmill.layers.rotary import CosSin, RotaryEmbedding, apply_rotary, apply_rotary_interleaved, yarn_mscale
from tokenmill.models.base import CausalLM


@dataclass(frozen=True)
class DeepseekV3Args:
    """The DeepSeek-V3 config fields that change the math (validated in ``__post_init__``)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    moe_intermediate_size: int
    num_layers: int
    num_heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_interleave: bool
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    rope_scaling: Mapping[str, Any] | None
    n_routed_experts: int
    num_experts_per_tok: int
    n_shared_experts: int
    first_k_dense_replace: int
    n_group: int
    topk_group: int
    norm_topk_prob: bool
    routed_scaling_factor: float
    attention_bias: bool = False
    tie_word_embeddings: bool = False
    num_mtp_layers: int = 0
    hidden_act: str = "silu"
    # expert parallelism (models/tensor_parallel.py): this shard holds routed experts [lo, hi)
    # only, and the shared experts' intermediate is this size; None: all experts, full size
    expert_range: tuple[int, int] | None = None
    shared_intermediate_size: int | None = None

    def __post_init__(self) -> None:
        def bad(field: str, why: str) -> ModelLoadError:
            return ModelLoadError(f"model config: {field}={getattr(self, field)!r} {why}")

        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "kv_lora_rank", "qk_rope_head_dim",
                     "v_head_dim", "max_position_embeddings"):
            if getattr(self, name) <= 0:
                raise bad(name, "must be positive")
        if self.qk_nope_head_dim < 0:
            raise bad("qk_nope_head_dim", "must not be negative")
        if self.q_lora_rank is not None and self.q_lora_rank <= 0:
            raise bad("q_lora_rank", "must be positive or null (no query compression)")
        if self.qk_rope_head_dim % 2:
            raise bad("qk_rope_head_dim", "must be even (rotary pairs)")
        if self.hidden_act not in ("silu", "swish"):
            raise bad("hidden_act", "is not supported (only silu)")
        if not 0 <= self.first_k_dense_replace:
            raise bad("first_k_dense_replace", "must be >= 0")
        if self.first_k_dense_replace and self.intermediate_size <= 0:
            raise bad("intermediate_size", "must be positive when there are dense layers")
        if self.first_k_dense_replace < self.num_layers:
            if self.n_routed_experts <= 0 or self.moe_intermediate_size <= 0:
                raise bad("n_routed_experts", "and moe_intermediate_size must be positive for MoE layers")
            if not 0 < self.num_experts_per_tok <= self.n_routed_experts:
                raise bad("num_experts_per_tok", f"must be in 1..n_routed_experts={self.n_routed_experts}")
            if self.n_group <= 0 or self.n_routed_experts % self.n_group:
                raise bad("n_group", f"must divide n_routed_experts={self.n_routed_experts}")
            if self.n_routed_experts // self.n_group < 2:
                raise bad("n_group", "leaves fewer than 2 experts per group (a group scores its best two)")
            if not 0 < self.topk_group <= self.n_group:
                raise bad("topk_group", f"must be in 1..n_group={self.n_group}")
            if self.topk_group * (self.n_routed_experts // self.n_group) < self.num_experts_per_tok:
                raise bad("topk_group", "keeps fewer experts than num_experts_per_tok")
            if self.n_shared_experts < 0:
                raise bad("n_shared_experts", "must be >= 0")
            if self.expert_range is not None:
                lo, hi = self.expert_range
                if not 0 <= lo < hi <= self.n_routed_experts:
                    raise bad("expert_range", f"must be a non-empty [lo, hi) within 0..{self.n_routed_experts}")
            if self.shared_intermediate_size is not None and self.shared_intermediate_size <= 0:
                raise bad("shared_intermediate_size", "must be positive")
        if self.num_mtp_layers < 0:
            raise bad("num_mtp_layers", "must be >= 0")

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def softmax_scale(self) -> float:
        scale = self.qk_head_dim ** -0.5
        rope = self.rope_scaling or {}
        if rope.get("rope_type", "default") != "default" and rope.get("mscale_all_dim"):
            m = yarn_mscale(float(rope["factor"]), float(rope["mscale_all_dim"]))
            scale *= m * m
        return scale

    def is_moe_layer(self, i: int) -> bool:
        return i >= self.first_k_dense_replace

    @property
    def local_experts(self) -> tuple[int, int]:
        """``[lo, hi)``: the routed experts this model (or expert-parallel shard) holds."""
        return self.expert_range if self.expert_range is not None else (0, self.n_routed_experts)

    @property
    def shared_inter(self) -> int:
        """Intermediate size of the shared experts held here (all of them fused in one MLP)."""
        if self.shared_intermediate_size is not None:
            return self.shared_intermediate_size
        return self.moe_intermediate_size * self.n_shared_experts


def _param(*shape: int, dtype: torch.dtype) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)


class MLA(nn.Module):
    def __init__(self, a: DeepseekV3Args, dtype: torch.dtype) -> None:
        super().__init__()
        self.a = a
        h, hd = a.hidden_size, a.num_heads * a.qk_head_dim
        if a.q_lora_rank is None:
            self.q_proj = _param(hd, h, dtype=dtype)
        else:
            self.q_a_proj = _param(a.q_lora_rank, h, dtype=dtype)
            self.q_a_bias = _param(a.q_lora_rank, dtype=dtype) if a.attention_bias else None
            self.q_a_layernorm = RMSNorm(a.q_lora_rank, 1e-6)
            self.q_b_proj = _param(hd, a.q_lora_rank, dtype=dtype)
        self.kv_a_proj = _param(a.kv_lora_rank + a.qk_rope_head_dim, h, dtype=dtype)
        self.kv_a_bias = _param(a.kv_lora_rank + a.qk_rope_head_dim, dtype=dtype) if a.attention_bias else None
        self.kv_a_layernorm = RMSNorm(a.kv_lora_rank, 1e-6)
        self.kv_b_proj = _param(a.num_heads * (a.qk_nope_head_dim + a.v_head_dim), a.kv_lora_rank, dtype=dtype)
        self.o_proj = _param(h, a.num_heads * a.v_head_dim, dtype=dtype)
        self.o_bias = _param(h, dtype=dtype) if a.attention_bias else None
        self.rope = apply_rotary_interleaved if a.rope_interleave else apply_rotary
        self.scale = a.softmax_scale

    def hf_tensors(self, s: str) -> dict[str, torch.Tensor]:
        """This attention's weights under HF names, prefixed by ``s`` (``...self_attn.``)."""
        a, out = self.a, {}
        if a.q_lora_rank is None:
            out[s + "q_proj.weight"] = self.q_proj
        else:
            out[s + "q_a_proj.weight"] = self.q_a_proj
            out[s + "q_a_layernorm.weight"] = self.q_a_layernorm.weight
            out[s + "q_b_proj.weight"] = self.q_b_proj
            if a.attention_bias:
                out[s + "q_a_proj.bias"] = self.q_a_bias
        out[s + "kv_a_proj_with_mqa.weight"] = self.kv_a_proj
        if a.attention_bias:
            out[s + "kv_a_proj_with_mqa.bias"] = self.kv_a_bias
            out[s + "o_proj.bias"] = self.o_bias
        out[s + "kv_a_layernorm.weight"] = self.kv_a_layernorm.weight
        out[s + "kv_b_proj.weight"] = self.kv_b_proj
        out[s + "o_proj.weight"] = self.o_proj
        return out

    def forward(self, x: torch.Tensor, cs: CosSin, kv_cache: Any, ctx: ForwardContext) -> torch.Tensor:
        return F.linear(self.attend(x, cs, kv_cache, ctx), self.o_proj, self.o_bias)

    def attend(self, x: torch.Tensor, cs: CosSin, kv_cache: Any, ctx: ForwardContext) -> torch.Tensor:
        """Everything but the output projection: the heads' outputs ``[T, H * v_head_dim]``."""
        a, t = self.a, x.shape[0]
        if a.q_lora_rank is None:
            q = F.linear(x, self.q_proj)
        else:
            q = F.linear(self.q_a_layernorm(F.linear(x, self.q_a_proj, self.q_a_bias)), self.q_b_proj)
        q = q.view(t, a.num_heads, a.qk_head_dim)
        q_nope, q_rope = q.split([a.qk_nope_head_dim, a.qk_rope_head_dim], dim=-1)
        kv = F.linear(x, self.kv_a_proj, self.kv_a_bias)
        latent, k_rope = kv.split([a.kv_lora_rank, a.qk_rope_head_dim], dim=-1)
        latent = self.kv_a_layernorm(latent)
        q_rope = self.rope(q_rope, cs)
        k_rope = self.rope(k_rope.unsqueeze(1), cs).squeeze(1)
        attn = ctx.attn
        if not isinstance(attn, MLAAttention):
            raise TypeError(f"DeepSeek-V3 needs the MLA attention backend, got {type(attn).__name__}")
        return attn.forward_mla(q_nope, q_rope, latent, k_rope, kv_cache, ctx.meta, self.scale, self.kv_b_proj)


class DenseMLP(nn.Module):
    def __init__(self, hidden: int, inter: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.inter = inter
        self.gate_up_proj = _param(2 * inter, hidden, dtype=dtype)
        self.down_proj = _param(hidden, inter, dtype=dtype)

    def hf_tensors(self, m: str) -> dict[str, torch.Tensor]:
        """The gate / up / down weights under HF names, prefixed by ``m`` (``...mlp.``)."""
        fi = self.inter
        return {m + "gate_proj.weight": self.gate_up_proj[:fi], m + "up_proj.weight": self.gate_up_proj[fi:],
                m + "down_proj.weight": self.down_proj}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = F.linear(x, self.gate_up_proj).split(self.inter, dim=-1)
        return F.linear(F.silu(gate) * up, self.down_proj)


class MoE(nn.Module):
    def __init__(self, a: DeepseekV3Args, dtype: torch.dtype) -> None:
        super().__init__()
        self.a = a
        e, h, f = a.n_routed_experts, a.hidden_size, a.moe_intermediate_size
        self.first_expert, hi = a.local_experts
        self.partial = hi - self.first_expert < e   # an expert-parallel shard: some experts elsewhere
        self.gate = _param(e, h, dtype=dtype)       # the router scores every expert, local or not
        self.register_buffer("e_score_correction_bias", torch.zeros(e, dtype=torch.float32))
        self.experts_gate_up = _param(hi - self.first_expert, 2 * f, h, dtype=dtype)
        self.experts_down = _param(hi - self.first_expert, h, f, dtype=dtype)
        self.shared = DenseMLP(h, a.shared_inter, dtype) if a.n_shared_experts else None
        self._experts: GroupedExperts | None = None
        self._shared: GroupedExperts | None = None

    def experts(self) -> GroupedExperts:
        """The routed experts (rebuilt, and repacked, when the weight tensors are replaced)."""
        w = self.experts_gate_up
        if self._experts is None or self._experts.gate_up.data_ptr() != w.data_ptr() or self._experts.gate_up.device != w.device:
            self._experts = GroupedExperts(self.experts_gate_up.data, self.experts_down.data)
        return self._experts

    def shared_experts(self) -> GroupedExperts | None:
        """The shared experts as one always-on expert of the same kernels (None without any)."""
        if self.shared is None:
            return None
        w = self.shared.gate_up_proj
        if self._shared is None or self._shared.gate_up.data_ptr() != w.data_ptr() or self._shared.gate_up.device != w.device:
            self._shared = GroupedExperts(w.data.unsqueeze(0), self.shared.down_proj.data.unsqueeze(0))
        return self._shared

    def hf_tensors(self, m: str) -> dict[str, torch.Tensor]:
        """Router, fused experts and shared experts under HF names, prefixed by ``m`` (``...mlp.``)."""
        out = {m + "gate.weight": self.gate, m + "gate.e_score_correction_bias": self.e_score_correction_bias,
               m + "experts.gate_up_proj": self.experts_gate_up, m + "experts.down_proj": self.experts_down}
        if self.shared is not None:
            out.update(self.shared.hf_tensors(m + "shared_experts."))
        else:  # HF builds zero-width shared experts when there are none
            h = self.a.hidden_size
            out[m + "shared_experts.gate_proj.weight"] = self.gate.new_empty(0, h)
            out[m + "shared_experts.up_proj.weight"] = self.gate.new_empty(0, h)
            out[m + "shared_experts.down_proj.weight"] = self.gate.new_empty(h, 0)
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = self.a
        weights, ids = route_sigmoid_grouped(
            x, self.gate, self.e_score_correction_bias, top_k=a.num_experts_per_tok, n_group=a.n_group,
            topk_group=a.topk_group, norm_topk_prob=a.norm_topk_prob, routed_scaling_factor=a.routed_scaling_factor)
        shared = self.shared_experts()
        if self.partial:   # this shard's experts only: a partial sum, completed by an all-reduce
            out = self.experts().local_sum(x, weights, ids, self.first_expert)
            return out if shared is None else shared.dense(x, out=out)
        return self.experts()(x, weights, ids, out=shared.dense(x) if shared is not None else None)


class DeepseekV3DecoderLayer(nn.Module):
    def __init__(self, a: DeepseekV3Args, index: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.self_attn = MLA(a, dtype)
        self.mlp: nn.Module = MoE(a, dtype) if a.is_moe_layer(index) else DenseMLP(a.hidden_size, a.intermediate_size, dtype)
        self.input_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps)

    def forward(self, h: torch.Tensor, cs: CosSin, kv_cache: Any, ctx: ForwardContext) -> torch.Tensor:
        h = h + self.self_attn(self.input_layernorm(h), cs, kv_cache, ctx)
        return h + self.mlp(self.post_attention_layernorm(h))


_EXPERT = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


def decoder_stack_forward(model: Any, ctx: ForwardContext) -> torch.Tensor:
    """Embedding, every decoder layer over its KV entry, final norm and LM head on the logits rows.
    Shared by the models whose layers take ``(h, cos_sin, kv_cache, ctx)`` (DeepSeek-V3, Ling)."""
    batch = ctx.batch
    if len(ctx.kv_caches) != len(model.layers):
        raise ValueError(f"expected {len(model.layers)} KV cache entries, got {len(ctx.kv_caches)}")
    cs = model.rotary.lookup(batch.positions, model.dtype, batch.max_seq_len)
    h = F.embedding(batch.input_ids, model.embed_tokens)
    ctx.capture(-1, h)
    for i, (layer, cache) in enumerate(zip(model.layers, ctx.kv_caches)):
        h = layer(h, cs, cache, ctx)
        ctx.capture(i, h)
    h = model.norm(h[batch.logits_indices])
    return F.linear(h, model.lm_head).float()


class DeepseekV3ForCausalLM(CausalLM):
    """DeepSeek-V3 / Kimi K2 over a paged latent cache. Build, then ``load_weights``."""

    def __init__(self, args: DeepseekV3Args, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu") -> None:
        super().__init__()
        self.args = args  # type: ignore[assignment]
        self.dtype = dtype
        self.embed_tokens = _param(args.vocab_size, args.hidden_size, dtype=dtype)
        self.layers = nn.ModuleList(DeepseekV3DecoderLayer(args, i, dtype) for i in range(args.num_layers))
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.lm_head = self.embed_tokens if args.tie_word_embeddings else _param(
            args.vocab_size, args.hidden_size, dtype=dtype)
        self.rotary = RotaryEmbedding(args.qk_rope_head_dim, args.rope_theta, args.rope_scaling,
                                      initial_positions=min(args.max_position_embeddings, 4096))
        self.mtp_weights: dict[str, torch.Tensor] = {}

    def kv_cache_spec(self) -> KVCacheSpec:
        layer = LatentKV(self.args.kv_lora_rank, self.args.qk_rope_head_dim)
        return KVCacheSpec(tuple(layer for _ in range(self.args.num_layers)), str(self.dtype).removeprefix("torch."))

    @torch.no_grad()
    def forward(self, ctx: ForwardContext) -> torch.Tensor:
        return decoder_stack_forward(self, ctx)

    # ---- weights -------------------------------------------------------------------------
    def _hf_layout(self) -> dict[str, tuple[int, ...]]:
        """HF module name -> shape of every tensor (experts in HF's fused in-memory layout)."""
        a = self.args
        h, qk, heads = a.hidden_size, a.qk_head_dim, a.num_heads
        out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (a.vocab_size, h), "model.norm.weight": (h,)}
        if not a.tie_word_embeddings:
            out["lm_head.weight"] = (a.vocab_size, h)
        for i in range(a.num_layers):
            p = f"model.layers.{i}."
            s = p + "self_attn."
            if a.q_lora_rank is None:
                out[s + "q_proj.weight"] = (heads * qk, h)
            else:
                out[s + "q_a_proj.weight"] = (a.q_lora_rank, h)
                out[s + "q_a_layernorm.weight"] = (a.q_lora_rank,)
                out[s + "q_b_proj.weight"] = (heads * qk, a.q_lora_rank)
                if a.attention_bias:
                    out[s + "q_a_proj.bias"] = (a.q_lora_rank,)
            out[s + "kv_a_proj_with_mqa.weight"] = (a.kv_lora_rank + a.qk_rope_head_dim, h)
            if a.attention_bias:
                out[s + "kv_a_proj_with_mqa.bias"] = (a.kv_lora_rank + a.qk_rope_head_dim,)
                out[s + "o_proj.bias"] = (h,)
            out[s + "kv_a_layernorm.weight"] = (a.kv_lora_rank,)
            out[s + "kv_b_proj.weight"] = (heads * (a.qk_nope_head_dim + a.v_head_dim), a.kv_lora_rank)
            out[s + "o_proj.weight"] = (h, heads * a.v_head_dim)
            out[p + "input_layernorm.weight"] = (h,)
            out[p + "post_attention_layernorm.weight"] = (h,)
            m = p + "mlp."
            if a.is_moe_layer(i):
                e, f = a.n_routed_experts, a.moe_intermediate_size
                lo, hi = a.local_experts
                out[m + "gate.weight"] = (e, h)
                out[m + "gate.e_score_correction_bias"] = (e,)
                out[m + "experts.gate_up_proj"] = (hi - lo, 2 * f, h)
                out[m + "experts.down_proj"] = (hi - lo, h, f)
                if a.n_shared_experts:
                    fs = a.shared_inter
                    out[m + "shared_experts.gate_proj.weight"] = (fs, h)
                    out[m + "shared_experts.up_proj.weight"] = (fs, h)
                    out[m + "shared_experts.down_proj.weight"] = (h, fs)
            else:
                out[m + "gate_proj.weight"] = (a.intermediate_size, h)
                out[m + "up_proj.weight"] = (a.intermediate_size, h)
                out[m + "down_proj.weight"] = (h, a.intermediate_size)
        return out

    def _fuse_experts(self, weights: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return fuse_expert_weights(weights, self.args.n_routed_experts)

    def _split_mtp(self, weights: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        main, mtp = split_mtp_weights(weights, self.args.num_layers, self.args.num_mtp_layers, self.dtype)
        self.mtp_weights.update(mtp)
        return main

    def load_weights(self, weights: Mapping[str, torch.Tensor]) -> None:
        weights = self._fuse_experts(self._split_mtp(weights))
        if not self.args.n_shared_experts:  # HF saves zero-size shared experts when there are none
            weights = {k: v for k, v in weights.items() if not (".shared_experts." in k and v.numel() == 0)}
        layout = self._hf_layout()
        self.check_weights(weights, layout)

        def get(name: str) -> torch.Tensor:
            return weights[name].to(self.dtype).contiguous()

        self.embed_tokens.data = get("model.embed_tokens.weight")
        if not self.args.tie_word_embeddings:
            self.lm_head.data = get("lm_head.weight")
        self.norm.weight.data = get("model.norm.weight")
        a = self.args
        for i, layer in enumerate(self.layers):
            p = f"model.layers.{i}."
            s, att = p + "self_attn.", layer.self_attn
            if a.q_lora_rank is None:
                att.q_proj.data = get(s + "q_proj.weight")
            else:
                att.q_a_proj.data = get(s + "q_a_proj.weight")
                att.q_a_layernorm.weight.data = get(s + "q_a_layernorm.weight")
                att.q_b_proj.data = get(s + "q_b_proj.weight")
                if a.attention_bias:
                    att.q_a_bias.data = get(s + "q_a_proj.bias")
            att.kv_a_proj.data = get(s + "kv_a_proj_with_mqa.weight")
            if a.attention_bias:
                att.kv_a_bias.data = get(s + "kv_a_proj_with_mqa.bias")
                att.o_bias.data = get(s + "o_proj.bias")
            att.kv_a_layernorm.weight.data = get(s + "kv_a_layernorm.weight")
            att.kv_b_proj.data = get(s + "kv_b_proj.weight")
            att.o_proj.data = get(s + "o_proj.weight")
            layer.input_layernorm.weight.data = get(p + "input_layernorm.weight")
            layer.post_attention_layernorm.weight.data = get(p + "post_attention_layernorm.weight")
            m = p + "mlp."
            mlp = layer.mlp
            if isinstance(mlp, MoE):
                mlp.gate.data = get(m + "gate.weight")
                mlp.e_score_correction_bias.copy_(weights[m + "gate.e_score_correction_bias"].float())
                mlp.experts_gate_up.data = get(m + "experts.gate_up_proj")
                mlp.experts_down.data = get(m + "experts.down_proj")
                if mlp.shared is not None:
                    mlp.shared.gate_up_proj.data = torch.cat(
                        (get(m + "shared_experts.gate_proj.weight"), get(m + "shared_experts.up_proj.weight")))
                    mlp.shared.down_proj.data = get(m + "shared_experts.down_proj.weight")
            else:
                assert isinstance(mlp, DenseMLP)
                mlp.gate_up_proj.data = torch.cat((get(m + "gate_proj.weight"), get(m + "up_proj.weight")))
                mlp.down_proj.data = get(m + "down_proj.weight")

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        """Weights under HF transformers' in-memory names (fused experts), as views."""
        out = {"model.embed_tokens.weight": self.embed_tokens, "model.norm.weight": self.norm.weight,
               "lm_head.weight": self.lm_head}
        for i, layer in enumerate(self.layers):
            p = f"model.layers.{i}."
            out.update(layer.self_attn.hf_tensors(p + "self_attn."))
            out[p + "input_layernorm.weight"] = layer.input_layernorm.weight
            out[p + "post_attention_layernorm.weight"] = layer.post_attention_layernorm.weight
            out.update(layer.mlp.hf_tensors(p + "mlp."))
        return {k: v.detach() for k, v in out.items()}


def fuse_expert_weights(weights: Mapping[str, torch.Tensor], num_experts: int) -> dict[str, torch.Tensor]:
    """Checkpoints store one tensor per expert (``experts.{j}.gate_proj.weight``): stack them into
    HF's fused ``experts.gate_up_proj`` [E, 2I, H] / ``experts.down_proj`` [E, H, I]."""
    out: dict[str, torch.Tensor] = {}
    per_expert: dict[str, dict[int, dict[str, torch.Tensor]]] = {}
    for name, t in weights.items():
        m = _EXPERT.match(name)
        if m:
            per_expert.setdefault(m.group(1), {}).setdefault(int(m.group(2)), {})[m.group(3)] = t
        else:
            out[name] = t
    e = num_experts
    for prefix, experts in per_expert.items():
        if prefix + ".gate_up_proj" in out:
            raise ModelLoadError(f"checkpoint has both fused and per-expert weights for {prefix}")
        missing = [f"{prefix}.{j}.{w}.weight" for j in range(e) for w in ("gate_proj", "up_proj", "down_proj")
                   if w not in experts.get(j, {})]
        extra = sorted(j for j in experts if not 0 <= j < e)
        if extra:
            raise ModelLoadError(f"checkpoint has expert {extra[0]} in {prefix}, but the config has {e} experts")
        if missing:
            raise ModelLoadError(f"checkpoint is missing tensor(s) {', '.join(missing[:5])}")
        try:
            out[prefix + ".gate_up_proj"] = torch.stack(
                [torch.cat((experts[j]["gate_proj"], experts[j]["up_proj"]), dim=0) for j in range(e)])
            out[prefix + ".down_proj"] = torch.stack([experts[j]["down_proj"] for j in range(e)])
        except RuntimeError as err:
            raise ModelLoadError(f"expert weights of {prefix} have inconsistent shapes: {err}") from err
    return out


def split_mtp_weights(weights: Mapping[str, torch.Tensor], num_layers: int, num_mtp_layers: int,
                      dtype: torch.dtype) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """``(main, mtp)``: the MTP layers (``model.layers.{num_layers}`` and up) split from the rest;
    a layer beyond ``num_layers + num_mtp_layers`` is refused."""
    main: dict[str, torch.Tensor] = {}
    mtp: dict[str, torch.Tensor] = {}
    for name, t in weights.items():
        m = re.match(r"^model\.layers\.(\d+)\.", name)
        if m and int(m.group(1)) >= num_layers:
            if int(m.group(1)) >= num_layers + num_mtp_layers:
                raise ModelLoadError(f"checkpoint tensor {name} belongs to layer {m.group(1)}, beyond "
                                     f"num_hidden_layers={num_layers} + num_mtp_layers={num_mtp_layers}")
            mtp[name] = t.to(dtype) if t.is_floating_point() else t
        else:
            main[name] = t
    return main, mtp
