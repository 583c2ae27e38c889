"""Lossless verification of speculative drafts against the target model's logits.

A request with ``k`` drafts ``d_0 .. d_{k-1}`` brings ``k + 1`` rows of logits: row ``j`` is the
target's next-token distribution after the context plus ``d_0 .. d_{j-1}``. Each row is
processed exactly as :class:`~tokenmill.layers.sampling.Sampler` processes a single row
(penalties counting the drafts before it as output, temperature, top-k/top-p/min-p), giving the
target distribution ``p_j``. Then, position by position:

* greedy rows accept ``d_j`` while it is the argmax of ``p_j``; the first mismatch emits the argmax;
* sampled rows whose drafts came with no distribution (model-free proposers: a point mass
  ``q = 1[d_j]``) draw the target's token ``t_j ~ p_j`` with the same exponential race as the
  plain sampler and accept while ``t_j == d_j``; a mismatch emits ``t_j``. That is the rule of
  Leviathan et al. for a point mass (accept with probability ``p_j(d_j)``; otherwise the token is
  distributed as ``p_j`` restricted to ``!= d_j``, which is the normalised residual), and because
  the draws come from the request's stream one per emitted token, a seeded request gives the
  same tokens with or without speculation;
* sampled rows with a draft distribution ``q_j`` accept ``d_j`` with probability
  ``min(1, p_j(d_j) / q_j(d_j))``; the first rejection emits a token from the normalised residual
  ``max(0, p_j - q_j)``;
* when every draft is accepted, row ``k`` gives a bonus token (drawn from ``p_k``).

So every step emits between 1 and ``k + 1`` tokens, with the distribution of sampling them one
at a time. Logprobs of emitted tokens are those of their row (as the plain sampler reports).
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

from tokenmill.contracts.sampling import SamplingParams
from tokenmill.layers.sampling import Sampler, apply_penalties, exp1, race_keys, row_argmax, truncate


class VerifyInputs(NamedTuple):
    """Per-request inputs (one entry per request, rows of a request are consecutive)."""

    params: Sequence[SamplingParams]
    prompt_token_ids: Sequence[Sequence[int]]
    output_token_ids: Sequence[Sequence[int]]        # output so far (used by penalties)
    generators: Sequence[torch.Generator | None]
    draft_token_ids: Sequence[Sequence[int]]         # k_i drafts; the request has k_i + 1 rows
    draft_probs: Sequence[torch.Tensor | None]       # [k_i, vocab] draft distribution, or None


class Verified(NamedTuple):
    token_ids: list[int]      # accepted drafts, then one more token (1 .. k + 1 tokens)
    num_accepted: int         # drafts accepted
    logprobs: list[tuple[float, list[tuple[int, float]]]] | None


def verify(sampler: Sampler, logits: torch.Tensor, inputs: VerifyInputs,
           argmax: torch.Tensor | None = None) -> list[Verified]:
    """Verify every request's drafts against ``logits`` ([sum(k_i + 1), vocab], fp32).
    ``argmax`` (optional): each row's first largest index of ``logits`` as given (see
    ``Sampler.__call__``); greedy rows use it where no penalty changes the logits."""
    n_req = len(inputs.params)
    counts = [len(d) + 1 for d in inputs.draft_token_ids]
    starts = [0]
    for c in counts:
        starts.append(starts[-1] + c)
    if starts[-1] != logits.shape[0]:
        raise ValueError(f"{logits.shape[0]} rows of logits for {starts[-1]} verification rows")
    row_params = [inputs.params[i] for i in range(n_req) for _ in range(counts[i])]
    if any(p.uses_penalties for p in inputs.params):
        argmax = None
        row_out: list[Sequence[int]] = []
        row_prompt: list[Sequence[int]] = []
        for i in range(n_req):
            uses = inputs.params[i].uses_penalties
            base = list(inputs.output_token_ids[i]) if uses else []
            for j in range(counts[i]):
                row_out.append(base + list(inputs.draft_token_ids[i][:j]) if uses else ())
                row_prompt.append(inputs.prompt_token_ids[i])
        logits = apply_penalties(logits, row_params, row_prompt, row_out)
    temps = [p.temperature for p in row_params]
    if any(t not in (0.0, 1.0) for t in temps):
        scale = torch.tensor([t if t > 0 else 1.0 for t in temps], dtype=logits.dtype, device=logits.device)
        logits = logits / scale[:, None]

    greedy_rows = [r for r, p in enumerate(row_params) if p.greedy]
    greedy_best: dict[int, int] = {}
    if greedy_rows:   # a greedy row's temperature is 0, so the scaling above left it as it was
        best = argmax[greedy_rows] if argmax is not None else row_argmax(logits[greedy_rows])
        greedy_best = dict(zip(greedy_rows, best.tolist()))
    sample_rows = [r for r, p in enumerate(row_params) if not p.greedy]
    probs_of: dict[int, int] = {r: j for j, r in enumerate(sample_rows)}
    probs = None
    if sample_rows:
        sub = logits[sample_rows]
        ps = [row_params[r] for r in sample_rows]
        dev = logits.device
        sub = truncate(sub,
                       torch.tensor([p.top_k for p in ps], dtype=torch.long, device=dev),
                       torch.tensor([p.top_p for p in ps], dtype=sub.dtype, device=dev),
                       torch.tensor([p.min_p for p in ps], dtype=sub.dtype, device=dev))
        probs = torch.softmax(sub, dim=-1).double()

    results: list[Verified] = []
    for i in range(n_req):
        params = inputs.params[i]
        drafts = list(inputs.draft_token_ids[i])
        k = len(drafts)
        r0 = starts[i]
        tokens: list[int] = []
        if params.greedy:
            for j in range(k + 1):
                t = greedy_best[r0 + j]
                tokens.append(t)
                if j == k or t != drafts[j]:
                    break
        else:
            assert probs is not None
            gen = inputs.generators[i] or sampler.generator
            q = inputs.draft_probs[i]
            for j in range(k + 1):
                p = probs[probs_of[r0 + j]]
                if q is None or j == k:
                    t = _race(p, gen)
                    tokens.append(t)
                    if j == k or t != drafts[j]:
                        break
                    continue
                d = drafts[j]
                qj = q[j].to(p.dtype)
                qd, pd = float(qj[d]), float(p[d])
                u = float(torch.rand((), generator=gen, dtype=torch.float64, device=p.device))
                if qd > 0 and u * qd < pd:
                    tokens.append(d)
                    continue
                residual = (p - qj).clamp_(min=0.0)
                tokens.append(_race(residual if float(residual.sum()) > 0 else p, gen))
                break
        results.append(Verified(tokens, len(tokens) - 1, None))

    want = [p.logprobs for p in inputs.params]
    if any(n is not None for n in want):
        rows, toks, wants = [], [], []
        for i, res in enumerate(results):
            if want[i] is None:
                continue
            for j, t in enumerate(res.token_ids):
                rows.append(starts[i] + j)
                toks.append(t)
                wants.append(want[i])
        lps = Sampler._logprobs(logits[rows], toks, wants)
        pos = 0
        for i, res in enumerate(results):
            if want[i] is None:
                continue
            n = len(res.token_ids)
            results[i] = res._replace(logprobs=[lp for lp in lps[pos:pos + n] if lp is not None])
            pos += n
    return results


def _race(p: torch.Tensor, gen: torch.Generator) -> int:
    """Draw from ``p`` (float64) by the exponential race, with one key from ``gen`` (as the plain
    sampler draws a row)."""
    return int(row_argmax(p / exp1(race_keys(gen, 1), p.shape[-1])[0].to(p.device)))
