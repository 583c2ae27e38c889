"""Speculative decoding: proposers (ngram, suffix, dflash) and the per-step controller.

:class:`SpeculativeDecoder` is what the engine holds. After each step it

1. rolls back the K/V of rejected drafts (:meth:`Scheduler.rollback`: pages past each request's
   new end go back to the pool; nothing rejected was ever counted as computed, so nothing
   rejected reaches the radix cache);
2. records acceptance (:class:`~tokenmill.engine.spec.base.SpecStats`) and updates each
   request's acceptance rate;
3. hands a learned drafter the target's hidden states of the newly accepted tokens;
4. asks the proposer for the next drafts of every decoding request, with a per-request draft
   length from the adaptive rule below, and stores them on the request
   (``spec_token_ids`` / ``spec_probs``) for the scheduler to pick up.

Adaptive ``k`` (``speculative_adaptive``): each request keeps a moving average ``a`` of the
share of its drafts accepted. Draft position ``j`` is reached and accepted with probability
about ``a**j``; the request drafts ``j`` tokens while ``a**j >= MIN_GAIN``, i.e.
``k_i = floor(log(MIN_GAIN) / log(a))`` capped at ``k``. Below ``a = MIN_GAIN`` it stops drafting
and tries a one-token draft every ``PROBE_EVERY`` steps so it can recover. When the batch is
compute-bound (many decodes), the drafts of one step are capped at
``speculative_max_draft_tokens`` in total, shared evenly.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

from tokenmill.engine.spec.base import Draft, Proposer, SpecStats

if TYPE_CHECKING:
    from tokenmill.engine.config import EngineConfig
    from tokenmill.engine.model_runner import StepResult
    from tokenmill.engine.request import Request
    from tokenmill.engine.scheduler import Scheduler, SchedulerOutput

MIN_GAIN = 0.15      # draft position j while accept_rate ** j >= MIN_GAIN
PROBE_EVERY = 8      # steps between one-token probes of a request whose drafts are poor
EMA_WEIGHT = 0.3     # weight of the newest step in the acceptance-rate average

__all__ = ["Draft", "Proposer", "SpecStats", "SpeculativeDecoder", "make_proposer"]


def make_proposer(config: EngineConfig, target: object = None) -> Proposer:
    """The proposer ``config.speculative_method`` names (``target``: the loaded target model)."""
    method = config.speculative_method
    if method == "ngram":
        from tokenmill.engine.spec.ngram import NgramProposer

        return NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
    if method == "suffix":
        from tokenmill.engine.spec.suffix import SuffixProposer

        return SuffixProposer(config.suffix_max_depth, config.suffix_cache_tokens, config.suffix_min_prob)
    if method == "dflash":
        from tokenmill.engine.spec.dflash import DFlashProposer

        assert config.speculative_model is not None
        return DFlashProposer.load(config.speculative_model, target)
    raise ValueError(f"unknown speculative method {method!r}")


class SpeculativeDecoder:
    def __init__(self, proposer: Proposer, scheduler: Scheduler, *, num_speculative_tokens: int,
                 max_model_len: int, adaptive: bool = True, max_draft_tokens: int = 64) -> None:
        self.proposer = proposer
        self.scheduler = scheduler
        self.k = num_speculative_tokens
        self.max_model_len = max_model_len
        self.adaptive = adaptive
        self.max_draft_tokens = max_draft_tokens
        self.stats = SpecStats(proposer.name, num_speculative_tokens)

    def after_step(self, out: SchedulerOutput, result: StepResult) -> None:
        """Roll back, record, feed the drafter, and propose the next drafts (see module doc)."""
        for s in result.sampled:
            if s.num_draft:
                req = s.request
                self.scheduler.rollback(req)
                self.stats.record(s.num_draft, s.num_accepted)
                req.num_draft_tokens += s.num_draft
                rate = s.num_accepted / s.num_draft
                req.spec_accept_rate += EMA_WEIGHT * (rate - req.spec_accept_rate)
        if result.captured:
            self._observe(out, result)
        for s in out.scheduled:
            s.request.spec_token_ids = []
            s.request.spec_probs = None
        self._propose()

    def _observe(self, out: SchedulerOutput, result: StepResult) -> None:
        layers = sorted(self.proposer.capture_layers)
        import torch

        feats = torch.cat([result.captured[i] for i in layers], dim=-1)
        for s, row in zip(out.scheduled, result.query_start):
            req = s.request
            if req.is_finished or req.num_computed_tokens <= s.start:
                continue
            n = req.num_computed_tokens - s.start   # the step's real tokens + accepted drafts
            self.proposer.observe(req, s.start, feats[row:row + n])

    def _propose(self) -> None:
        reqs: list[Request] = []
        ks: list[int] = []
        for req in self.scheduler.running:
            if req.num_uncomputed_tokens != 1 or not req.params.speculative:
                continue
            if req.grammar is not None:
                continue   # constrained decoding does not speculate (see docs/speculative.md)
            k = self._draft_len(req)
            # never draft past max_tokens or the context limit (the step emits up to k + 1)
            k = min(k, req.params.max_tokens - req.num_output_tokens - 1,
                    self.max_model_len - req.num_tokens - 1)
            k = self.scheduler.kv.max_drafts(req, k)   # hybrid: stop at the next page boundary
            if k > 0:
                reqs.append(req)
                ks.append(k)
        if not reqs:
            return
        if sum(ks) > self.max_draft_tokens:
            share = max(1, self.max_draft_tokens // len(ks))
            ks = [min(k, share) for k in ks]
        for req, k, draft in zip(reqs, ks, self.proposer.propose(reqs, ks)):
            tokens = list(draft.token_ids[:k])
            if req.draft_validator is not None and tokens:
                tokens = list(req.draft_validator(req, tokens))
            req.spec_token_ids = tokens
            req.spec_probs = draft.probs[: len(tokens)] if draft.probs is not None and tokens else None

    def _draft_len(self, req: Request) -> int:
        if not self.adaptive:
            return self.k
        a = req.spec_accept_rate
        if a < MIN_GAIN:
            req.spec_steps_off += 1
            if req.spec_steps_off >= PROBE_EVERY:
                req.spec_steps_off = 0
                return 1
            return 0
        req.spec_steps_off = 0
        if a >= 0.999:
            return self.k
        return max(1, min(self.k, int(math.log(MIN_GAIN) / math.log(a))))

    def request_finished(self, req: Request) -> None:
        self.proposer.request_finished(req)
