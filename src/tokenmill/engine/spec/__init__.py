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

Adaptive ``k`` (``speculative_adaptive``), in two stages:

1. *Per request:* each request keeps two moving averages: ``f``, how often the first draft of a
   step is accepted, and ``c``, how often a draft is accepted after an accepted one (drafts
   that copy the context come in runs: once one holds, the next usually does too). Draft
   position ``j`` (1-based) is reached and accepted with probability about ``f * c**(j-1)``;
   the request may draft ``j`` tokens while that is ``>= MIN_GAIN``, capped at ``k``. Below
   ``f = MIN_GAIN`` (a learned drafter may set the starting ``f`` from its measured held-out
   acceptance, :attr:`Proposer.first_rate_prior`) it stops drafting and tries a one-token draft after ``PROBE_EVERY`` steps
   so it can recover; each probe that fails doubles the wait (up to ``MAX_PROBE_EVERY``), so a
   proposer that keeps missing costs almost nothing.
2. *Against the measured cost:* the decoder fits the time of decode-only steps as a line in
   their token count, ``T(n) = t0 + t1 * n`` (:class:`~tokenmill.engine.step_cost.TokenLine`),
   and times the proposer itself (``D`` per step). A step with ``B`` decodes and no drafts
   yields about ``B`` tokens in ``T(B)``. Draft rows are taken in order of their expected
   gain ``f_i * c_i**(j-1)`` while each one raises the expected tokens per second, i.e. while
   ``gain * T >= t1 * E`` (``T``, ``E``: time and expected tokens so far); then, if even the
   chosen drafts do not pay for ``D``, the step drafts nothing. So where a verify row costs
   nearly nothing (a weight-bound step) every promising draft goes out, where rows are dear
   (a compute-bound kernel or a large batch) only the likely ones do, and a proposer whose
   drafts are rarely accepted is switched off (it is tried again every ``COST_PROBE_EVERY`` steps,
   so the estimates stay fresh). Until the fit has seen enough steps, stage 1 alone decides.
   On top, one step's drafts are capped at ``speculative_max_draft_tokens`` in total.
"""
from __future__ import annotations

import math
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from tokenmill.engine.spec.base import Draft, Proposer, SpecStats
from tokenmill.engine.step_cost import TokenLine

if TYPE_CHECKING:
    from tokenmill.engine.config import EngineConfig
    from tokenmill.engine.model_runner import StepResult
    from tokenmill.engine.request import Request
    from tokenmill.engine.scheduler import Scheduler, SchedulerOutput

MIN_GAIN = 0.15      # draft position j while accept_rate ** j >= MIN_GAIN
PROBE_EVERY = 8      # steps between one-token probes of a request whose drafts are poor ...
MAX_PROBE_EVERY = 64  # ... doubling after each probe that fails, up to this
COST_PROBE_EVERY = 32  # steps between short drafts while drafting does not pay for its cost
EMA_WEIGHT = 0.3     # weight of the newest step in the acceptance-rate average
COST_WEIGHT = 0.2    # weight of the newest step in the proposer-time average

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
                 max_model_len: int, adaptive: bool = True, max_draft_tokens: int = 64,
                 constrained: bool = True) -> None:
        """``constrained``: requests with a grammar draft too (their drafts cut by the grammar,
        their rows masked per draft position); False leaves them to plain decoding."""
        self.proposer = proposer
        self.scheduler = scheduler
        self.k = num_speculative_tokens
        self.max_model_len = max_model_len
        self.adaptive = adaptive
        self.max_draft_tokens = max_draft_tokens
        self.constrained = constrained
        self.stats = SpecStats(proposer.name, num_speculative_tokens)
        # decode-only step time as a line in its tokens (fed by the engine), and the proposer's
        # own time per step (observe + propose): the costs stage 2 of adaptive k weighs
        self.cost = TokenLine(decay=0.97, min_samples=8.0)
        self.propose_seconds = 0.0
        self._steps = 0
        self.steps_off = 0     # steps on which drafting did not pay and was skipped (not probes)

    def observe_step(self, out: SchedulerOutput, seconds: float) -> None:
        """The engine's wall time for the forward + verification of ``out``; decode-only
        steps (every request one token behind, plus its drafts) feed the cost line."""
        if out.scheduled and all(s.num_tokens == 1 + s.num_draft for s in out.scheduled):
            expected = self.cost.predict(out.num_tokens)
            if expected is not None and expected > 0:   # a step slowed by another process: clip it
                seconds = min(seconds, 1.5 * expected)
            self.cost.observe(out.num_tokens, seconds)

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
                first = 1.0 if s.num_accepted else 0.0
                req.spec_first_rate += EMA_WEIGHT * (first - req.spec_first_rate)
                trials = min(s.num_accepted, s.num_draft - 1)   # positions reached after an accepted one
                if trials > 0:
                    cont = (s.num_accepted - 1) / trials
                    req.spec_continue_rate += EMA_WEIGHT * (cont - req.spec_continue_rate)
        t0 = time.perf_counter()
        if result.captured:
            self._observe(out, result)
        for s in out.scheduled:
            s.request.spec_token_ids = []
            s.request.spec_probs = None
        if self._propose():
            dt = time.perf_counter() - t0
            self.propose_seconds += COST_WEIGHT * (dt - self.propose_seconds) if self.propose_seconds else dt

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

    def _propose(self) -> bool:
        """Draft for the decoding requests; True when the proposer ran."""
        self._steps += 1
        reqs: list[Request] = []
        ks: list[int] = []
        num_decode = 0
        for req in self.scheduler.running:
            if req.num_uncomputed_tokens != 1:
                continue
            num_decode += 1
            if not req.params.speculative or (req.grammar is not None and not self.constrained):
                continue
            if not req.spec_seen:
                req.spec_seen = True
                if self.proposer.first_rate_prior is not None:
                    req.spec_first_rate = self.proposer.first_rate_prior
            k = self._draft_len(req)
            # never draft past max_tokens or the context limit (the step emits up to k + 1)
            k = min(k, req.params.max_tokens - req.num_output_tokens - 1,
                    self.max_model_len - req.num_tokens - 1)
            k = self.scheduler.kv.max_drafts(req, k)   # hybrid: stop at the next page boundary
            if k > 0:
                reqs.append(req)
                ks.append(k)
        if not reqs:
            return False
        if self.adaptive:
            ks = self._worth_drafting(reqs, ks, num_decode)
            if not any(ks):
                return False
            keep = [i for i, k in enumerate(ks) if k > 0]
            reqs, ks = [reqs[i] for i in keep], [ks[i] for i in keep]
        if sum(ks) > self.max_draft_tokens:
            share = max(1, self.max_draft_tokens // len(ks))
            ks = [min(k, share) for k in ks]
        for req, k, draft in zip(reqs, ks, self.proposer.propose(reqs, ks)):
            tokens = list(draft.token_ids[:k])
            if req.grammar is not None and tokens:   # cut at the first draft the grammar rejects
                tokens = tokens[:req.grammar.draft_prefix(tokens, keep_rejected=draft.probs is not None)]
            if req.draft_validator is not None and tokens:
                tokens = list(req.draft_validator(req, tokens))
            req.spec_token_ids = tokens
            req.spec_probs = draft.probs[: len(tokens)] if draft.probs is not None and tokens else None
        return True

    def _worth_drafting(self, reqs: list[Request], ks: list[int], num_decode: int) -> list[int]:
        """Stage 2 of adaptive ``k`` (module doc): the draft lengths that raise the expected
        tokens per second of the step, given the measured step-cost line and proposer time."""
        fit = self.cost.fit()
        if fit is None:
            return ks
        t0, t1 = fit
        n = max(num_decode, 1)
        base_time = max(t0 + t1 * n, 1e-6)
        if t1 <= 0.0:                      # extra rows look free: only the proposer's time counts
            chosen = list(ks)
            gain = sum(_row_gain(r, j) for r, k in zip(reqs, ks) for j in range(k))
            extra = 0.0
        else:
            rows = sorted(((_row_gain(r, j), i) for i, (r, k) in enumerate(zip(reqs, ks)) for j in range(k)),
                          reverse=True)
            chosen = [0] * len(ks)
            time_s, tokens = base_time, float(n)
            for g, i in rows:
                if g * time_s < t1 * tokens:
                    break
                chosen[i] += 1
                time_s += t1
                tokens += g
            gain, extra = tokens - n, time_s - base_time
        if gain <= 0.0 or (n + gain) * base_time < n * (base_time + extra + self.propose_seconds):
            if self._steps % COST_PROBE_EVERY == 0:   # keep the estimates fresh: a short draft now and then
                return [min(1, k) for k in ks]
            self.steps_off += 1
            return [0] * len(ks)
        return chosen
    def _draft_len(self, req: Request) -> int:
        if not self.adaptive:
            return self.k
        f, c = req.spec_first_rate, req.spec_continue_rate
        if f < MIN_GAIN:
            req.spec_steps_off += 1
            if req.spec_steps_off >= req.spec_probe_every:
                req.spec_steps_off = 0
                # the next probe waits twice as long unless this one brings the rate back
                req.spec_probe_every = min(2 * req.spec_probe_every, MAX_PROBE_EVERY)
                return 1
            return 0
        req.spec_steps_off = 0
        req.spec_probe_every = PROBE_EVERY
        if c >= 0.999:
            return self.k
        if c <= 0.0:
            return 1
        return max(1, min(self.k, 1 + int(math.log(MIN_GAIN / f) / math.log(c))))

    def request_finished(self, req: Request) -> None:
        self.proposer.request_finished(req)


def _row_gain(req: Request, j: int) -> float:
    """Expected tokens the request's draft at position ``j`` (0-based) adds: the chance it is
    reached and accepted, ``f * c**j``."""
    return req.spec_first_rate * req.spec_continue_rate ** j
