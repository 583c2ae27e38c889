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
``tokenmill plan`` assumes). The routed experts are split one of two ways (``moe_parallel``):

* ``"tp"`` (default), **tensor parallel inside the experts**: every rank holds every expert with
  ``1/tp`` of its intermediate dimension, so every rank does ``1/tp`` of every routed row's work;
* ``"ep"``, **expert parallelism**: rank ``r`` holds whole experts, a contiguous ``1/tp`` share of
  them (``n_routed_experts`` need not divide: the first ``E % tp`` ranks hold one more). Dispatch
  is local: the activations entering the MLP are already replicated on every rank (the attention
  all-reduce leaves them so), the router is replicated and picks the same experts everywhere, and
  each rank computes only the (token, slot) pairs routed to its own experts
  (:meth:`~tokenmill.layers.moe.GroupedExperts.local_sum`). Combine is the MLP's one all-reduce of
  those partial sums, so no all-to-all is needed; an all-to-all dispatch pays off only when the
  activations are sharded by token (data-parallel attention), which tokenmill does not do.

In both modes the router is replicated, the shared experts are tensor parallel (their
intermediate split over the ranks) and added to the same partial sum, and the dense layers
(``first_k_dense_replace``) are column/row parallel; the MLP ends in one all-reduce.

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
           "check_tensor_parallel", "expert_range", "kv_heads_per_rank", "kv_shard_of", "rank_kv_cache_spec", "shard_args", "shard_weights"]


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
    """One rank's shard of DeepSeek-V3: MLA heads split (latent replicated), experts TP-sharded
    (``moe_parallel="tp"``) or split whole over the ranks (``"ep"``)."""

    def __init__(self, full_args: DeepseekV3Args, rank: int, tp: int, dtype: torch.dtype = torch.float32,
                 group: dist.ProcessGroup | None = None, moe_parallel: str = "tp") -> None:
        super().__init__(full_args, rank, tp, dtype, group)
        self.moe_parallel = moe_parallel
        self._init_local(DeepseekV3ForCausalLM(shard_deepseek_args(full_args, tp, rank, moe_parallel), dtype=dtype))

    def _layer(self, layer: nn.Module, h: torch.Tensor, cs: CosSin, kv_cache: Any,
               ctx: ForwardContext) -> torch.Tensor:
        # MLA over this rank's heads -> o_proj slice (bias on rank 0 only) -> one all-reduce
        h = h + self._all_reduce(layer.self_attn(layer.input_layernorm(h), cs, kv_cache, ctx))
        # routed experts (router replicated; each expert's intermediate split, or this rank's
        # whole experts only) + shared expert slice, or the dense MLP slice -> one all-reduce
        return h + self._all_reduce(layer.mlp(layer.post_attention_layernorm(h)))

    def expert_weight_bytes(self) -> int:
        """Bytes of routed-expert weights this rank holds (all MoE layers)."""
        total = 0
        for layer in self.local.layers:
            mlp = layer.mlp
            if hasattr(mlp, "experts_gate_up"):
                total += sum(t.numel() * t.element_size() for t in (mlp.experts_gate_up, mlp.experts_down))
        return total


MOE_PARALLEL_MODES = ("tp", "ep")


def expert_range(num_experts: int, rank: int, tp: int) -> tuple[int, int]:
    """Rank ``rank``'s routed experts ``[lo, hi)`` under expert parallelism: contiguous, balanced
    (the first ``num_experts % tp`` ranks hold one more)."""
    base, extra = divmod(num_experts, tp)
    lo = rank * base + min(rank, extra)
    return lo, lo + base + (1 if rank < extra else 0)


def check_deepseek_tensor_parallel(args: DeepseekV3Args, tp: int, moe_parallel: str = "tp") -> None:
    if tp < 1:
        raise ValueError(f"tensor_parallel_size must be >= 1, got {tp}")
    if moe_parallel not in MOE_PARALLEL_MODES:
        raise ValueError(f"moe_parallel must be one of {MOE_PARALLEL_MODES}, got {moe_parallel!r}")
    if tp == 1:
        return
    if args.num_heads % tp:
        raise ValueError(f"tensor_parallel_size={tp} does not divide the model's {args.num_heads} attention "
                         f"heads; choose a divisor of {args.num_heads}")
    if args.first_k_dense_replace and args.intermediate_size % tp:
        raise ValueError(f"tensor_parallel_size={tp} does not divide intermediate_size={args.intermediate_size}")
    if args.first_k_dense_replace >= args.num_layers:
        return   # no MoE layer
    if moe_parallel == "tp":
        if args.moe_intermediate_size % tp:
            raise ValueError(f"tensor_parallel_size={tp} does not divide moe_intermediate_size="
                             f"{args.moe_intermediate_size} (experts split by their intermediate dimension); "
                             f"moe_parallel='ep' splits whole experts instead")
        return
    if args.n_routed_experts < tp:
        raise ValueError(f"expert parallelism over {tp} ranks needs at least {tp} routed experts; the model has "
                         f"{args.n_routed_experts} (use moe_parallel='tp')")
    shared = args.moe_intermediate_size * args.n_shared_experts
    if shared % tp:
        raise ValueError(f"tensor_parallel_size={tp} does not divide the shared experts' intermediate size "
                         f"{shared} (shared experts are tensor parallel under expert parallelism too)")


def shard_deepseek_args(args: DeepseekV3Args, tp: int, rank: int = 0, moe_parallel: str = "tp") -> DeepseekV3Args:
    check_deepseek_tensor_parallel(args, tp, moe_parallel)
    common = dict(num_heads=args.num_heads // tp, intermediate_size=args.intermediate_size // tp,
                  vocab_size=_vocab_per_rank(args.vocab_size, tp), num_mtp_layers=0)
    if moe_parallel == "ep" and tp > 1:
        return dataclasses.replace(args, **common, expert_range=expert_range(args.n_routed_experts, rank, tp),
                                   shared_intermediate_size=args.moe_intermediate_size * args.n_shared_experts // tp
                                   or None)
    return dataclasses.replace(args, **common, moe_intermediate_size=args.moe_intermediate_size // tp)


def shard_deepseek_weights(weights: Mapping[str, torch.Tensor], args: DeepseekV3Args, rank: int,
                           tp: int, moe_parallel: str = "tp") -> dict[str, torch.Tensor]:
    """Rank ``rank``'s slices of DeepSeek-V3's HF-named weights (fused experts, as hf_state_dict)."""
    check_deepseek_tensor_parallel(args, tp, moe_parallel)
    hl = args.num_heads // tp
    ep = moe_parallel == "ep" and tp > 1
    lo, hi = expert_range(args.n_routed_experts, rank, tp) if ep else (0, args.n_routed_experts)

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
        elif name.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj")) and ep:
            out[name] = w[lo:hi]                                  # whole experts, this rank's share
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


def check_model_tensor_parallel(model: CausalLM, tp: int, moe_parallel: str = "tp") -> None:
    """Raise ValueError when ``model`` cannot run over ``tp`` ranks (``moe_parallel``: how experts split)."""
    if moe_parallel not in MOE_PARALLEL_MODES:
        raise ValueError(f"moe_parallel must be one of {MOE_PARALLEL_MODES}, got {moe_parallel!r}")
    if isinstance(model, LlamaForCausalLM):
        if moe_parallel == "ep" and tp > 1:
            raise ValueError(f"moe_parallel='ep' (expert parallelism) needs a mixture-of-experts model; "
                             f"{type(model).__name__} has no experts")
        check_tensor_parallel(model.args, tp)
    elif isinstance(model, DeepseekV3ForCausalLM):
        check_deepseek_tensor_parallel(model.args, tp, moe_parallel)  # type: ignore[arg-type]
    else:
        raise ValueError(f"tensor parallelism supports Llama-family (Llama, Qwen2, Qwen3, SmolLM) and "
                         f"DeepSeek-V3 models; {type(model).__name__} runs with tensor_parallel_size=1")


def rank_kv_cache_spec(model: CausalLM, tp: int, moe_parallel: str = "tp") -> KVCacheSpec:
    """What one rank stores per token: its KV heads' share, or the whole (replicated) MLA latent."""
    check_model_tensor_parallel(model, tp, moe_parallel)
    if isinstance(model, LlamaForCausalLM):
        a = model.args
        return KVCacheSpec.dense(a.num_layers, kv_heads_per_rank(a.num_kv_heads, tp), a.head_dim,
                                 str(model.dtype).removeprefix("torch."))
    return model.kv_cache_spec()


def kv_shard_of(model: CausalLM, rank: int, tp: int) -> int:
    """Which distinct KV shard rank ``rank`` holds: ranks with the same number hold the same
    K/V bytes of every token (a replicated KV head, or DeepSeek-V3's replicated latent), so one
    copy of it is enough in a shared cache tier."""
    if isinstance(model, LlamaForCausalLM):
        k = model.args.num_kv_heads
        return rank if k >= tp else rank // (tp // k)
    return 0   # MLA: every rank caches the whole latent


def shard_weights(model: CausalLM, rank: int, tp: int,
                  moe_parallel: str = "tp") -> tuple[str, Any, dict[str, torch.Tensor]]:
    """``(kind, full args, rank's HF-named weights)`` for :func:`build_shard` on that rank."""
    check_model_tensor_parallel(model, tp, moe_parallel)
    full = model.hf_state_dict()
    if isinstance(model, LlamaForCausalLM):
        return "llama", model.args, shard_llama_weights(full, model.args, rank, tp)
    return "deepseek_v3", model.args, shard_deepseek_weights(full, model.args, rank, tp,  # type: ignore[arg-type]
                                                             moe_parallel)


def build_shard(kind: str, full_args: Any, rank: int, tp: int, dtype: torch.dtype,
                weights: Mapping[str, torch.Tensor], moe_parallel: str = "tp") -> _TensorParallelLM:
    if kind == "llama":
        shard: _TensorParallelLM = TPLlamaForCausalLM(full_args, rank, tp, dtype=dtype)
    else:
        shard = TPDeepseekV3ForCausalLM(full_args, rank, tp, dtype=dtype, moe_parallel=moe_parallel)
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
