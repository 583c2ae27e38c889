"""Tensor-parallel shards of Llama-family and DeepSeek-V3 models over a torch.distributed group.

One rank of ``tp`` holds:

* attention: ``num_heads / tp`` query heads and their KV heads. With at least as many KV heads as
  ranks, ``num_kv_heads / tp`` of them; with fewer, one KV head, replicated on the ``tp / num_kv_heads``
  ranks whose query heads read it (so the per-rank KV layout is the one ``tokenmill plan`` assumes);
* q/k/v (and their biases) column-parallel, ``o_proj`` row-parallel, then **one all-reduce**;
* MLP: gate/up column-parallel, ``down_proj`` row-parallel, then **one all-reduce**;
* vocabulary-parallel embedding (each rank looks up the ids in its vocabulary slice, zeros the
  rest, one all-reduce) and LM head (each rank computes its vocabulary slice of the logits; rank 0
  gathers them; the other ranks return ``None``);
* norms and rotary tables are replicated.

DeepSeek-V3 (MLA + MoE): the query heads split (``q_proj``/``q_b_proj`` and ``kv_b_proj`` rows,
``o_proj`` columns, its bias added by rank 0 only); the latent projections ``q_a_proj`` and
``kv_a_proj_with_mqa`` are replicated, so every rank caches the full latent of every token (as
``tokenmill plan`` assumes). The MoE is **tensor parallel inside the experts**: the router is
replicated (every rank picks the same experts for every token), each expert's intermediate
dimension and the shared expert's are split, and the MLP's one all-reduce sums the partial
outputs. No token dispatch is needed and every rank does 1/tp of every expert's work; expert
parallelism (whole experts per rank, tokens exchanged by all-to-all) is not built.

Sharding works on HF-named weights (:func:`shard_llama_weights`): the shard is an ordinary
:class:`~tokenmill.models.llama.LlamaForCausalLM` built from the per-rank sizes
(:func:`shard_args`) and loaded through its own ``load_weights``; :class:`TPLlamaForCausalLM`
wraps it and runs the forward with the collectives. Sums in the all-reduces run in a different
order from one device's matmul, so logits agree with ``tp=1`` to float rounding, not bit for bit.
"""
from __future__ import annotations

import abc
import dataclasses
import re
import time
from typing import Any, Mapping

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from tokenmill.contracts.kv import KVCacheSpec
from tokenmill.layers.attention import ForwardContext
from tokenmill.models.base import CausalLM, ModelArgs
from tokenmill.models.deepseek_v3 import DeepseekV3Args, DeepseekV3ForCausalLM
from tokenmill.models.llama import LlamaDecoderLayer, LlamaForCausalLM
from tokenmill.layers.rotary import CosSin, apply_rotary

__all__ = ["TPDeepseekV3ForCausalLM", "TPLlamaForCausalLM", "build_shard", "check_model_tensor_parallel",
           "check_tensor_parallel", "kv_heads_per_rank", "rank_kv_cache_spec", "shard_args", "shard_weights"]


def check_tensor_parallel(args: ModelArgs, tp: int) -> None:
    """Raise ValueError when ``args`` cannot be split over ``tp`` ranks, naming the size at fault."""
    if tp < 1:
        raise ValueError(f"tensor_parallel_size must be >= 1, got {tp}")
    if tp == 1:
        return
    if args.num_heads % tp:
        raise ValueError(f"tensor_parallel_size={tp} does not divide the model's {args.num_heads} attention "
                         f"heads; choose a divisor of {args.num_heads}")
    k = args.num_kv_heads
    if k >= tp and k % tp:
        raise ValueError(f"tensor_parallel_size={tp} does not divide the model's {k} KV heads")
    if k < tp and tp % k:
        raise ValueError(f"tensor_parallel_size={tp} is not a multiple of the model's {k} KV heads "
                         f"(with fewer KV heads than ranks each KV head is replicated on tp/kv_heads ranks)")
    if args.intermediate_size % tp:
        raise ValueError(f"tensor_parallel_size={tp} does not divide the MLP intermediate size "
                         f"{args.intermediate_size}")


def kv_heads_per_rank(num_kv_heads: int, tp: int) -> int:
    return max(1, num_kv_heads // tp)


def _vocab_per_rank(vocab: int, tp: int) -> int:
    return -(-vocab // tp)


def _vocab_rows(w: torch.Tensor, rank: int, tp: int) -> torch.Tensor:
    vp = _vocab_per_rank(w.shape[0], tp)
    part = w[rank * vp:(rank + 1) * vp]
    if part.shape[0] < vp:  # the last slice of a vocabulary tp does not divide: zero rows
        part = torch.cat([part, part.new_zeros(vp - part.shape[0], *part.shape[1:])])
    return part


def shard_args(args: ModelArgs, tp: int) -> ModelArgs:
    """The sizes one rank's shard is built with (vocabulary padded to ``tp`` equal slices)."""
    check_tensor_parallel(args, tp)
    return dataclasses.replace(args, num_heads=args.num_heads // tp,
                               num_kv_heads=kv_heads_per_rank(args.num_kv_heads, tp),
                               intermediate_size=args.intermediate_size // tp,
                               vocab_size=_vocab_per_rank(args.vocab_size, tp))


def shard_llama_weights(weights: Mapping[str, torch.Tensor], args: ModelArgs, rank: int,
                        tp: int) -> dict[str, torch.Tensor]:
    """Rank ``rank``'s slices of the full HF-named ``weights`` of a Llama-family model."""
    check_tensor_parallel(args, tp)
    d = args.head_dim
    hq = args.num_heads // tp
    k = args.num_kv_heads
    if k >= tp:
        hk = k // tp
        kv_first = rank * hk
    else:  # replicated: tp/k consecutive ranks share one KV head (their query heads are its group)
        hk = 1
        kv_first = rank // (tp // k)
    q_rows = slice(rank * hq * d, (rank + 1) * hq * d)
    kv_rows = slice(kv_first * d, (kv_first + hk) * d)
    inter = args.intermediate_size // tp
    i_rows = slice(rank * inter, (rank + 1) * inter)

    out: dict[str, torch.Tensor] = {}
    for name, w in weights.items():
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            out[name] = _vocab_rows(w, rank, tp)
        elif name.endswith(("self_attn.q_proj.weight", "self_attn.q_proj.bias")):
            out[name] = w[q_rows]
        elif name.endswith(("self_attn.k_proj.weight", "self_attn.k_proj.bias",
                            "self_attn.v_proj.weight", "self_attn.v_proj.bias")):
            out[name] = w[kv_rows]
        elif name.endswith("self_attn.o_proj.weight"):
            out[name] = w[:, q_rows]
        elif name.endswith(("mlp.gate_proj.weight", "mlp.up_proj.weight")):
            out[name] = w[i_rows]
        elif name.endswith("mlp.down_proj.weight"):
            out[name] = w[:, i_rows]
        else:  # norms (and q/k norms, which are per head_dim): replicated
            out[name] = w
    return out


class _TensorParallelLM(CausalLM):
    """One rank's shard; subclasses build ``self.local`` (the shard-sized model) and its layers."""

    def __init__(self, full_args, rank: int, tp: int, dtype: torch.dtype, group: dist.ProcessGroup | None) -> None:
        super().__init__()
        self.full_args = full_args
        self.rank, self.tp, self.group = rank, tp, group
        self.dtype = dtype
        self.allreduce_s = 0.0        # time spent in all-reduce (and the logits gather) so far
        self.comm_bytes = 0           # payload bytes this rank put into collectives so far

    def _init_local(self, local: CausalLM) -> None:
        self.local = local
        self.args = local.args
        self.vocab_start = self.rank * local.args.vocab_size
        self.full_vocab = self.full_args.vocab_size

    def kv_cache_spec(self) -> KVCacheSpec:
        return self.local.kv_cache_spec()

    def load_weights(self, weights: Mapping[str, torch.Tensor]) -> None:
        """Load already sliced weights (see :func:`shard_weights`)."""
        self.local.load_weights(weights)

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        return self.local.hf_state_dict()

    # ---- collectives -----------------------------------------------------------------------
    def _all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        t0 = time.perf_counter()
        dist.all_reduce(x, group=self.group)
        self.allreduce_s += time.perf_counter() - t0
        self.comm_bytes += x.numel() * x.element_size()
        return x

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.vocab_start
        outside = (local < 0) | (local >= self.args.vocab_size)
        h = _embedding(self.local.embed_tokens, local.masked_fill(outside, 0), self.local.dtype)
        h = h.masked_fill(outside.unsqueeze(-1), 0.0)
        return self._all_reduce(h)

    def _lm_head(self, h: torch.Tensor) -> torch.Tensor | None:
        part = _linear(h, self.local.lm_head).float().contiguous()
        if part.shape[0] == 0:
            return part.new_zeros(0, self.full_vocab) if self.rank == 0 else None
        t0 = time.perf_counter()
        parts = [torch.empty_like(part) for _ in range(self.tp)] if self.rank == 0 else None
        dst = dist.get_global_rank(self.group, 0) if self.group is not None else 0
        dist.gather(part, parts, dst=dst, group=self.group)
        self.allreduce_s += time.perf_counter() - t0
        self.comm_bytes += part.numel() * part.element_size()
        if parts is None:
            return None
        return torch.cat(parts, dim=-1)[:, : self.full_vocab]

    @abc.abstractmethod
    def _layer(self, layer: nn.Module, h: torch.Tensor, cs: CosSin, kv_cache: Any,
               ctx: ForwardContext) -> torch.Tensor:
        """One decoder layer over this rank's shard, with its two all-reduces."""

    @torch.no_grad()
    def forward(self, ctx: ForwardContext) -> torch.Tensor | None:  # type: ignore[override]
        """Logits ``[rows, full vocab]`` on rank 0; ``None`` on the other ranks."""
        m, batch = self.local, ctx.batch
        cs = m.rotary.lookup(batch.positions, self.dtype, batch.max_seq_len)
        h = self._embed(batch.input_ids)
        ctx.capture(-1, h)
        for i, (layer, cache) in enumerate(zip(m.layers, ctx.kv_caches)):
            h = self._layer(layer, h, cs, cache, ctx)
            ctx.capture(i, h)
        return self._lm_head(m.norm(h[batch.logits_indices]))


class TPLlamaForCausalLM(_TensorParallelLM):
    """One rank's shard of a Llama-family model; the forward runs the collectives over ``group``."""

    def __init__(self, full_args: ModelArgs, rank: int, tp: int, dtype: torch.dtype = torch.float32,
                 group: dist.ProcessGroup | None = None) -> None:
        super().__init__(full_args, rank, tp, dtype, group)
        self._init_local(LlamaForCausalLM(shard_args(full_args, tp), dtype=dtype))

    def _layer(self, layer: LlamaDecoderLayer, h: torch.Tensor, cs: CosSin, kv_cache: torch.Tensor,
               ctx: ForwardContext) -> torch.Tensor:
        t = h.shape[0]
        x = layer.input_layernorm(h)
        qkv = _linear(x, layer.qkv_proj, layer.qkv_bias)
        if layer.q_norm is not None and layer.k_norm is not None:
            q, k, v = qkv.split([layer.q_size, layer.kv_size, layer.kv_size], dim=-1)
            q = layer.q_norm(q.view(t, layer.num_heads, layer.head_dim))
            k = layer.k_norm(k.view(t, layer.num_kv_heads, layer.head_dim))
            q, k = apply_rotary(q, cs), apply_rotary(k, cs)
        else:
            qk = apply_rotary(qkv[:, : layer.q_size + layer.kv_size].view(t, -1, layer.head_dim), cs)
            q, k = qk[:, : layer.num_heads], qk[:, layer.num_heads:]
            v = qkv[:, layer.q_size + layer.kv_size:]
        v = v.view(t, layer.num_kv_heads, layer.head_dim)
        o = ctx.attn.forward(q, k, v, kv_cache, ctx.meta, layer.scale)
        h = h + self._all_reduce(_linear(o, layer.o_proj))
        x = layer.post_attention_layernorm(h)
        gate, up = _linear(x, layer.gate_up_proj).chunk(2, dim=-1)
        return h + self._all_reduce(_linear(F.silu(gate) * up, layer.down_proj))


class TPDeepseekV3ForCausalLM(_TensorParallelLM):
    """One rank's shard of DeepSeek-V3: MLA heads split (latent replicated), experts TP-sharded."""

    def __init__(self, full_args: DeepseekV3Args, rank: int, tp: int, dtype: torch.dtype = torch.float32,
                 group: dist.ProcessGroup | None = None) -> None:
        super().__init__(full_args, rank, tp, dtype, group)
        self._init_local(DeepseekV3ForCausalLM(shard_deepseek_args(full_args, tp), dtype=dtype))

    def _layer(self, layer: nn.Module, h: torch.Tensor, cs: CosSin, kv_cache: Any,
               ctx: ForwardContext) -> torch.Tensor:
        # MLA over this rank's heads -> o_proj slice (bias on rank 0 only) -> one all-reduce
        h = h + self._all_reduce(layer.self_attn(layer.input_layernorm(h), cs, kv_cache, ctx))
        # routed experts (router replicated, each expert's intermediate split) + shared expert
        # slice, or the dense MLP slice -> one all-reduce
        return h + self._all_reduce(layer.mlp(layer.post_attention_layernorm(h)))


def check_deepseek_tensor_parallel(args: DeepseekV3Args, tp: int) -> None:
    if tp < 1:
        raise ValueError(f"tensor_parallel_size must be >= 1, got {tp}")
    if tp == 1:
        return
    if args.num_heads % tp:
        raise ValueError(f"tensor_parallel_size={tp} does not divide the model's {args.num_heads} attention "
                         f"heads; choose a divisor of {args.num_heads}")
    for name in ("intermediate_size", "moe_intermediate_size"):
        if getattr(args, name) % tp:
            raise ValueError(f"tensor_parallel_size={tp} does not divide {name}={getattr(args, name)}")


def shard_deepseek_args(args: DeepseekV3Args, tp: int) -> DeepseekV3Args:
    check_deepseek_tensor_parallel(args, tp)
    return dataclasses.replace(args, num_heads=args.num_heads // tp, intermediate_size=args.intermediate_size // tp,
                               moe_intermediate_size=args.moe_intermediate_size // tp,
                               vocab_size=_vocab_per_rank(args.vocab_size, tp), num_mtp_layers=0)


def shard_deepseek_weights(weights: Mapping[str, torch.Tensor], args: DeepseekV3Args, rank: int,
                           tp: int) -> dict[str, torch.Tensor]:
    """Rank ``rank``'s slices of DeepSeek-V3's HF-named weights (fused experts, as hf_state_dict)."""
    check_deepseek_tensor_parallel(args, tp)
    hl = args.num_heads // tp

    def rows(w: torch.Tensor, per: int) -> torch.Tensor:
        return w[rank * per:(rank + 1) * per]

    f = args.moe_intermediate_size
    fl = f // tp
    out: dict[str, torch.Tensor] = {}
    for name, w in weights.items():
        if re.match(r"^model\.layers\.(\d+)\.", name) and int(name.split(".")[2]) >= args.num_layers:
            continue  # MTP layers: not run by the engine
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            out[name] = _vocab_rows(w, rank, tp)
        elif name.endswith(("self_attn.q_proj.weight", "self_attn.q_b_proj.weight")):
            out[name] = rows(w, hl * args.qk_head_dim)
        elif name.endswith("self_attn.kv_b_proj.weight"):
            out[name] = rows(w, hl * (args.qk_nope_head_dim + args.v_head_dim))
        elif name.endswith("self_attn.o_proj.weight"):
            out[name] = w[:, rank * hl * args.v_head_dim:(rank + 1) * hl * args.v_head_dim]
        elif name.endswith("self_attn.o_proj.bias"):
            out[name] = w if rank == 0 else torch.zeros_like(w)   # added once by the all-reduce
        elif name.endswith("mlp.experts.gate_up_proj"):
            out[name] = torch.cat([w[:, rank * fl:(rank + 1) * fl], w[:, f + rank * fl:f + (rank + 1) * fl]], dim=1)
        elif name.endswith("mlp.experts.down_proj"):
            out[name] = w[:, :, rank * fl:(rank + 1) * fl]
        elif name.endswith(("shared_experts.gate_proj.weight", "shared_experts.up_proj.weight")):
            out[name] = rows(w, w.shape[0] // tp)
        elif name.endswith("shared_experts.down_proj.weight"):
            per = w.shape[1] // tp
            out[name] = w[:, rank * per:(rank + 1) * per]
        elif name.endswith(("mlp.gate_proj.weight", "mlp.up_proj.weight")):
            out[name] = rows(w, args.intermediate_size // tp)
        elif name.endswith("mlp.down_proj.weight"):
            per = args.intermediate_size // tp
            out[name] = w[:, rank * per:(rank + 1) * per]
        else:  # q_a/kv_a projections (the latent), norms, router and its bias: replicated
            out[name] = w
    return out


def check_model_tensor_parallel(model: CausalLM, tp: int) -> None:
    """Raise ValueError when ``model`` cannot run over ``tp`` ranks."""
    if isinstance(model, LlamaForCausalLM):
        check_tensor_parallel(model.args, tp)
    elif isinstance(model, DeepseekV3ForCausalLM):
        check_deepseek_tensor_parallel(model.args, tp)  # type: ignore[arg-type]
    else:
        raise ValueError(f"tensor parallelism supports Llama-family (Llama, Qwen2, Qwen3, SmolLM) and "
                         f"DeepSeek-V3 models; {type(model).__name__} runs with tensor_parallel_size=1")


def rank_kv_cache_spec(model: CausalLM, tp: int) -> KVCacheSpec:
    """What one rank stores per token: its KV heads' share, or the whole (replicated) MLA latent."""
    check_model_tensor_parallel(model, tp)
    if isinstance(model, LlamaForCausalLM):
        a = model.args
        return KVCacheSpec.dense(a.num_layers, kv_heads_per_rank(a.num_kv_heads, tp), a.head_dim,
                                 str(model.dtype).removeprefix("torch."))
    return model.kv_cache_spec()


def shard_weights(model: CausalLM, rank: int, tp: int) -> tuple[str, Any, dict[str, torch.Tensor]]:
    """``(kind, full args, rank's HF-named weights)`` for :func:`build_shard` on that rank."""
    check_model_tensor_parallel(model, tp)
    full = model.hf_state_dict()
    if isinstance(model, LlamaForCausalLM):
        return "llama", model.args, shard_llama_weights(full, model.args, rank, tp)
    return "deepseek_v3", model.args, shard_deepseek_weights(full, model.args, rank, tp)  # type: ignore[arg-type]


def build_shard(kind: str, full_args: Any, rank: int, tp: int, dtype: torch.dtype,
                weights: Mapping[str, torch.Tensor]) -> _TensorParallelLM:
    cls = {"llama": TPLlamaForCausalLM, "deepseek_v3": TPDeepseekV3ForCausalLM}[kind]
    shard = cls(full_args, rank, tp, dtype=dtype)
    shard.load_weights(weights)
    return shard


def _linear(x: torch.Tensor, w, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ w.T (+ bias)`` for a plain weight or a linear method (``layers.linear``)."""
    if isinstance(w, torch.Tensor):
        return F.linear(x, w, bias)
    return w(x, bias) if bias is not None else w(x)


def _embedding(w, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    if isinstance(w, torch.Tensor):
        return F.embedding(ids, w)
    return w.embedding(ids, dtype)
