"""Mixture-of-experts: DeepSeek's sigmoid router with group-limited selection, and the routed
experts computed grouped by expert.

Router (:func:`route_sigmoid_grouped`, DeepSeek-V3 / Kimi K2 ``noaux_tc``), per token::

    s      = sigmoid(x @ W_gate^T)                      in fp32, [T, E]
    choice = s + e_score_correction_bias                the bias steers *selection* only
    groups: E experts in n_group groups; a group's score is the sum of its two best choices;
            keep the topk_group best groups, mask the other experts to -inf
    ids    = top-k of choice;  weights = s[ids]  (normalised to sum 1 when norm_topk_prob)
    weights *= routed_scaling_factor

It runs the same torch operations in the same order as HF transformers' ``DeepseekV3TopkRouter``,
so selections agree bit for bit, ties included (``torch.topk`` breaks them the same way on the
same tensor).

Experts (:class:`GroupedExperts`): the ``T x top_k`` (token, expert) pairs are sorted by expert
once (a stable argsort), the tokens gathered in that order, and each expert's contiguous run of
rows goes through one ``[rows, hidden] x [hidden, 2 * inter]`` matmul, SiLU-and-multiply, and one
``[rows, inter] x [inter, hidden]`` matmul. The runs are handed to ``torch.nn.functional.grouped_mm``
(one call for all experts) when this torch has it, else to one ``F.linear`` per expert that has
rows. No work is done for experts without tokens, and nothing loops over tokens. The outputs are
scattered back to (token, slot) order, weighted and summed over the ``top_k`` slots.

Expert parallelism (:meth:`GroupedExperts.local_sum`): a shard holding experts ``lo .. hi-1``
computes only the (token, slot) pairs routed to them and adds each weighted output into its
token's row; the other rows stay zero, and an all-reduce over the shards completes the sum.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

_GROUPED_MM = getattr(F, "grouped_mm", None)


def route_sigmoid_grouped(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, *, top_k: int,
                          n_group: int, topk_group: int, norm_topk_prob: bool,
                          routed_scaling_factor: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(weights [T, top_k] fp32, ids [T, top_k] int64)`` for hidden states ``x`` [T, hidden]."""
    num_experts = weight.shape[0]
    logits = F.linear(x.float(), weight.float())
    scores = logits.sigmoid()
    choice = scores + bias
    per_group = num_experts // n_group
    group_scores = choice.view(-1, n_group, per_group).topk(2, dim=-1)[0].sum(dim=-1)
    best_groups = torch.topk(group_scores, k=topk_group, dim=-1, sorted=False)[1]
    group_mask = torch.zeros_like(group_scores)
    group_mask.scatter_(1, best_groups, 1)
    expert_mask = group_mask.unsqueeze(-1).expand(-1, n_group, per_group).reshape(-1, num_experts)
    choice = choice.masked_fill(~expert_mask.bool(), float("-inf"))
    ids = torch.topk(choice, k=top_k, dim=-1, sorted=False)[1]
    weights = scores.gather(1, ids)
    if norm_topk_prob:
        weights /= weights.sum(dim=-1, keepdim=True) + 1e-20
    return weights * routed_scaling_factor, ids


class GroupedExperts:
    """The routed experts of one MoE layer, weights stacked as ``[E, 2 * inter, hidden]`` (gate
    rows then up rows) and ``[E, hidden, inter]`` (HF's fused layout)."""

    def __init__(self, gate_up: torch.Tensor, down: torch.Tensor, use_grouped_mm: bool | None = None) -> None:
        if gate_up.dim() != 3 or down.dim() != 3 or gate_up.shape[0] != down.shape[0]:
            raise ValueError(f"expert weights must be [E, 2I, H] and [E, H, I], got {tuple(gate_up.shape)}, "
                             f"{tuple(down.shape)}")
        self.gate_up, self.down = gate_up, down
        self.num_experts = gate_up.shape[0]
        self.inter = down.shape[2]
        if use_grouped_mm is None:
            use_grouped_mm = _GROUPED_MM is not None and self._grouped_mm_works()
        self.use_grouped_mm = bool(use_grouped_mm)
        # grouped_mm takes [E, K, N] right-hand sides: transposed views (no copy; as fast here).
        self._gate_up_t = gate_up.transpose(1, 2) if self.use_grouped_mm else None
        self._down_t = down.transpose(1, 2) if self.use_grouped_mm else None

    def _grouped_mm_works(self) -> bool:
        """grouped_mm needs 16-byte aligned strides; probe once with this layer's shapes."""
        h, i2 = self.gate_up.shape[2], self.gate_up.shape[1]
        try:
            assert _GROUPED_MM is not None
            a = torch.zeros(2, h, dtype=self.gate_up.dtype, device=self.gate_up.device)
            w = torch.zeros(1, h, i2, dtype=self.gate_up.dtype, device=self.gate_up.device)
            _GROUPED_MM(a, w, offs=torch.tensor([2], dtype=torch.int32, device=a.device))
            a2 = torch.zeros(2, i2 // 2, dtype=self.gate_up.dtype, device=self.gate_up.device)
            w2 = torch.zeros(1, i2 // 2, h, dtype=self.gate_up.dtype, device=self.gate_up.device)
            _GROUPED_MM(a2, w2, offs=torch.tensor([2], dtype=torch.int32, device=a.device))
            return True
        except (RuntimeError, TypeError, ValueError):
            return False

    def _run(self, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Expert ``e``'s MLP over its run of ``counts[e]`` consecutive rows of ``rows``."""
        if self.use_grouped_mm:
            assert _GROUPED_MM is not None and self._gate_up_t is not None and self._down_t is not None
            offs = counts.cumsum(0).to(torch.int32)
            h = _GROUPED_MM(rows, self._gate_up_t, offs=offs)
            gate, up = h.split(self.inter, dim=-1)
            return _GROUPED_MM(F.silu(gate) * up, self._down_t, offs=offs)
        out_sorted = torch.empty_like(rows)
        start = 0
        for e, n in enumerate(counts.tolist()):   # one pair of matmuls per expert with rows
            if n:
                gate, up = F.linear(rows[start:start + n], self.gate_up[e]).split(self.inter, dim=-1)
                out_sorted[start:start + n] = F.linear(F.silu(gate) * up, self.down[e])
                start += n
        return out_sorted

    def __call__(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """``sum_k weights[t, k] * expert_{ids[t, k]}(x[t])`` for every token ``t`` of ``x`` [T, H]."""
        t, k = ids.shape
        flat = ids.reshape(-1)
        order = torch.argsort(flat, stable=True)          # (token, slot) pairs grouped by expert
        rows = x.index_select(0, order // k)               # [T*k, H] tokens in expert order
        counts = torch.bincount(flat, minlength=self.num_experts)
        out_sorted = self._run(rows, counts)
        out = torch.empty_like(out_sorted)
        out[order] = out_sorted                              # back to (token, slot) order
        w = weights.to(out.dtype).view(t, k, 1)
        return (out.view(t, k, -1) * w).sum(dim=1)

    def local_sum(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, first: int) -> torch.Tensor:
        """The part of :meth:`__call__`'s sum that falls on experts ``first .. first + E - 1`` (the
        experts held here, numbered from ``first`` in ``ids``); zero rows for tokens routed
        elsewhere. Only the (token, slot) pairs routed here are computed."""
        t, k = ids.shape
        local = ids.reshape(-1) - first
        pairs = ((local >= 0) & (local < self.num_experts)).nonzero().squeeze(1)   # local (token, slot) pairs
        out = x.new_zeros(t, x.shape[1])
        if pairs.numel() == 0:
            return out
        local = local[pairs]
        order = torch.argsort(local, stable=True)
        pairs = pairs[order]                                # grouped by local expert
        tokens = pairs // k
        counts = torch.bincount(local, minlength=self.num_experts)
        out_sorted = self._run(x.index_select(0, tokens), counts)
        w = weights.reshape(-1)[pairs].to(out.dtype).unsqueeze(1)
        return out.index_add_(0, tokens, out_sorted * w)
