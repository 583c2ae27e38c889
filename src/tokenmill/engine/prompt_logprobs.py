"""Prompt logprobs: log-probabilities of the prompt tokens, computed from the prompt rows of the
forward pass.

The model computes logits only at ``ForwardBatch.logits_indices``. For a request with
``params.prompt_logprobs`` set, the model runner adds the rows of its prompt positions that this
step computes: the logits at position ``p`` give the distribution of token ``p + 1``. With
chunked prefill each chunk contributes its own rows; ``Request.prompt_logprobs`` grows until it
holds one entry per prompt token (the first is ``None``: nothing predicts it).

Such a request bypasses the prefix cache for its prompt (:meth:`KVManager.match` matches
nothing for it), so every prompt row is computed; its pages still go into the cache when it
finishes. After a preemption the recomputed rows already covered are skipped.

Values are the log-softmax of the raw model logits (no penalties, temperature or grammar mask).
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, NamedTuple

import torch

from tokenmill.engine.request import TokenLogprob, TopLogprob

if TYPE_CHECKING:
    from tokenmill.engine.request import Request
    from tokenmill.engine.scheduler import ScheduledRequest


class PromptRows(NamedTuple):
    request: Request
    first_pos: int   # position of the first row; its logits predict prompt token first_pos + 1
    count: int


def plan_prompt_rows(scheduled: Sequence[ScheduledRequest],
                     query_start: Sequence[int]) -> tuple[list[int], list[PromptRows]]:
    """Token rows (into the step's concatenated tokens) whose logits are needed for prompt
    logprobs, and which request each run of rows belongs to (in the same order)."""
    rows: list[int] = []
    plans: list[PromptRows] = []
    for k, s in enumerate(scheduled):
        req = s.request
        if req.prompt_logprobs is None:
            continue
        lo = max(s.start, len(req.prompt_logprobs) - 1)
        hi = min(s.start + s.num_tokens, req.num_prompt_tokens - 1)
        if hi <= lo:
            continue
        q0 = query_start[k] - s.start
        rows.extend(range(q0 + lo, q0 + hi))
        plans.append(PromptRows(req, lo, hi - lo))
    return rows, plans


def record_prompt_logprobs(logits: torch.Tensor, plans: Sequence[PromptRows]) -> None:
    """Append the logprobs of ``logits`` (one row per planned row, in plan order) to each request."""
    offset = 0
    for plan in plans:
        req = plan.request
        sub = logits[offset:offset + plan.count]
        offset += plan.count
        lp = torch.log_softmax(sub.float(), dim=-1)
        targets = req.prompt_token_ids[plan.first_pos + 1:plan.first_pos + 1 + plan.count]
        chosen = lp.gather(1, torch.tensor(targets, dtype=torch.long, device=lp.device)[:, None])[:, 0].tolist()
        n = req.params.prompt_logprobs or 0
        tops: list[list[TopLogprob]] = [[] for _ in targets]
        if n:
            top = lp.topk(n, dim=-1)
            tops = [[TopLogprob(t, v) for t, v in zip(ids, vals)]
                    for ids, vals in zip(top.indices.tolist(), top.values.tolist())]
        assert req.prompt_logprobs is not None
        req.prompt_logprobs.extend(TokenLogprob(t, c, tp) for t, c, tp in zip(targets, chosen, tops))
