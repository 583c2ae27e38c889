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
rows goes through one fused ``[rows, hidden] x [hidden, 2 * inter]`` gate-and-up matmul,
SiLU-and-multiply (in place, times the routing weight: on the ``inter``-wide side, not the
hidden-wide output), and one ``[rows, inter] x [inter, hidden]`` matmul: on the CPU with oneDNN
weights prepacked once per expert (see :class:`GroupedExperts` for why), else one
``torch.nn.functional.grouped_mm`` call for all experts, else one ``F.linear`` pair per expert
that has rows. No work is done for experts without tokens, nothing loops over tokens, and no
per-expert mask is built. ``index_add_`` sums each token's rows back into token order (into the
shared experts' output when given, so there is no separate add).

Expert parallelism (:meth:`GroupedExperts.local_sum`): a shard holding experts ``lo .. hi-1``
computes only the (token, slot) pairs routed to them and adds each weighted output into its
token's row; the other rows stay zero, and an all-reduce over the shards completes the sum.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from tokenmill.layers.linear import onednn_available, onednn_linear, onednn_pack

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


PACK_BATCH_HINT = 256   # rows per call oneDNN blocks the packed weights for (measured best of 1/64/256)


class GroupedExperts:
    """The routed experts of one MoE layer, weights stacked as ``[E, 2 * inter, hidden]`` (gate
    rows then up rows) and ``[E, hidden, inter]`` (HF's fused layout).

    Three ways to run each expert's run of rows, chosen once (``mode``):

    * ``packed`` (default on CPU for fp32 / bf16 when torch has oneDNN): each expert's two
      weights are reordered once, at first use, into oneDNN's blocked layout, and every call is
      one prepacked oneDNN matmul. A plain ``F.linear`` (MKL) repacks the weight on every call,
      which at the few dozen rows an expert sees per step costs about as much as the matmul
      itself: prepacked, the same fp32 math runs about 2x faster here. The packed copies cost
      one more copy of the expert weights in memory.
    * ``grouped``: ``torch.nn.functional.grouped_mm`` over all experts in one call.
    * ``loop``: one ``F.linear`` pair per expert with rows.
    """

    MODES = ("packed", "grouped", "loop")

    def __init__(self, gate_up: torch.Tensor, down: torch.Tensor, use_grouped_mm: bool | None = None,
                 mode: str | None = None) -> None:
        if gate_up.dim() != 3 or down.dim() != 3 or gate_up.shape[0] != down.shape[0]:
            raise ValueError(f"expert weights must be [E, 2I, H] and [E, H, I], got {tuple(gate_up.shape)}, "
                             f"{tuple(down.shape)}")
        self.gate_up, self.down = gate_up, down
        self.num_experts = gate_up.shape[0]
        self.inter = down.shape[2]
        if mode is None:
            if use_grouped_mm is not None:       # the older switch: grouped_mm or the loop
                mode = "grouped" if use_grouped_mm else "loop"
            elif self._packed_works():
                mode = "packed"
            else:
                mode = "grouped" if _GROUPED_MM is not None and self._grouped_mm_works() else "loop"
        if mode not in self.MODES:
            raise ValueError(f"mode must be one of {self.MODES}, got {mode!r}")
        self.mode = mode
        self.use_grouped_mm = mode == "grouped"
        # grouped_mm takes [E, K, N] right-hand sides: transposed views (no copy; as fast here).
        self._gate_up_t = gate_up.transpose(1, 2) if self.use_grouped_mm else None
        self._down_t = down.transpose(1, 2) if self.use_grouped_mm else None
        self._packed: list[tuple[torch.Tensor, torch.Tensor]] | None = None

    def _packed_works(self) -> bool:
        if (not onednn_available() or self.gate_up.device.type != "cpu"
                or self.gate_up.dtype not in (torch.float32, torch.bfloat16)):
            return False
        try:
            w = torch.zeros(4, 8, dtype=self.gate_up.dtype)
            y = onednn_linear(torch.ones(2, 8, dtype=w.dtype), onednn_pack(w, 2))
            return tuple(y.shape) == (2, 4)
        except (RuntimeError, TypeError, ValueError):
            return False

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

    def _packed_weights(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        if self._packed is None:
            self._packed = [(onednn_pack(self.gate_up[e], PACK_BATCH_HINT), onednn_pack(self.down[e], PACK_BATCH_HINT))
                            for e in range(self.num_experts)]
        return self._packed

    def _act(self, h: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
        """SiLU(gate) * up (times the routing weight), in place on a fresh tensor."""
        act = F.silu(h[:, :self.inter])
        act.mul_(h[:, self.inter:])
        return act if scale is None else act.mul_(scale)

    def dense(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Every token of ``x`` through expert 0 (a shared expert held as one expert), no routing;
        added into ``out`` when given."""
        if self.mode == "packed":
            gu, dn = self._packed_weights()[0]
            y = onednn_linear(self._act(onednn_linear(x, gu), None), dn)
        else:
            y = F.linear(self._act(F.linear(x, self.gate_up[0]), None), self.down[0])
        return y if out is None else out.add_(y)

    def _run(self, rows: torch.Tensor, counts: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
        """Expert ``e``'s MLP over its run of ``counts[e]`` consecutive rows of ``rows``, each row's
        result times ``scale`` (its routing weight, [rows, 1]) when given."""
        if self.mode == "grouped":
            assert _GROUPED_MM is not None and self._gate_up_t is not None and self._down_t is not None
            offs = counts.cumsum(0).to(torch.int32)
            act = self._act(_GROUPED_MM(rows, self._gate_up_t, offs=offs), scale)   # weight on the narrow side
            return _GROUPED_MM(act, self._down_t, offs=offs)
        out_sorted = torch.empty_like(rows)
        start = 0
        if self.mode == "packed":
            packed = self._packed_weights()
        for e, n in enumerate(counts.tolist()):   # one matmul pair per expert with rows
            if n:
                sl = slice(start, start + n)
                sc = None if scale is None else scale[sl]
                if self.mode == "packed":
                    gu, dn = packed[e]
                    out_sorted[sl] = onednn_linear(self._act(onednn_linear(rows[sl], gu), sc), dn)
                else:
                    out_sorted[sl] = F.linear(self._act(F.linear(rows[sl], self.gate_up[e]), sc), self.down[e])
                start += n
        return out_sorted

    def __call__(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                 out: torch.Tensor | None = None) -> torch.Tensor:
        """``sum_k weights[t, k] * expert_{ids[t, k]}(x[t])`` for every token ``t`` of ``x`` [T, H].

        ``out`` ([T, H], e.g. the shared experts' output): added to in place and returned.
        """
        t, k = ids.shape
        flat = ids.reshape(-1)
        order = torch.argsort(flat, stable=True)          # (token, slot) pairs grouped by expert
        token = order // k                                 # the token of each sorted row
        scale = weights.reshape(-1).index_select(0, order).to(x.dtype).unsqueeze(1)
        counts = torch.bincount(flat, minlength=self.num_experts)
        out_sorted = self._run(x.index_select(0, token), counts, scale)
        if out is None:
            out = torch.zeros_like(x)
        # one pass back to token order, summing each token's k rows (in expert order: the same
        # order whatever else is in the batch)
        return out.index_add_(0, token, out_sorted)

    def local_sum(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, first: int) -> torch.Tensor:
        """The part of :meth:`__call__`'s sum that falls on experts ``first .. first + E - 1`` (the
        experts held here, numbered from ``first`` in ``ids``; expert parallelism); zero rows for
        tokens routed elsewhere. Only the (token, slot) pairs routed here are computed."""
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
        scale = weights.reshape(-1)[pairs].to(x.dtype).unsqueeze(1)
        return out.index_add_(0, tokens, self._run(x.index_select(0, tokens), counts, scale))
