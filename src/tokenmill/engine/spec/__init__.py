"""Speculative decoding: proposers (ngram, suffix, dflash) and the per-step controller.

:class:`SpeculativeDecoder` is what the engine holds. After each step it

1. rolls back the K/V of rejected drafts (:meth:`Scheduler.rollback`: pages past each request's
   new end go back to the pool; nothing rejected was ever counted as computed, so nothing
   rejected reaches the radix cache);
2. records acceptance (:class:`~tokenmill.engine.spec.base.SpecStats`) and updates each
   request's acceptance rate;
3. hands a learned drafter the target's hidden states of the newly accepted tokens (of the
   requests the step captured for: see *Hidden-state capture* below);
4. asks the proposer for the next drafts of every decoding request, with a per-request draft
   length from the adaptive rule below, and stores them on the request
   (``spec_token_ids`` / ``spec_probs``) for the scheduler to pick up.

Adaptive ``k`` (``speculative_adaptive``), in two stages:

1. *Expected gain per draft position.* A cheap model-free proposer (``drafts_then_cuts``:
   ngram, suffix) drafts the longest allowed every step, and its draft tokens state a
   confidence each (:attr:`Draft.confidence`). The *draft gate* calibrates confidences online
   (:class:`~tokenmill.engine.spec.base.ConfidenceCalibration`: a scale shared by all of them
   and a bias per confidence bucket, from the acceptance observed, pooled over requests); a
   row's gain is the product of the calibrated rates up to it. With ``gate=False`` (or a draft
   without confidences) the draft's *kind* (the length of the match it came from) decides
   instead: acceptance per position pooled per kind over all requests
   (:class:`~tokenmill.engine.spec.base.KindStats`, with a prior by kind). Other proposers use
   two per-request moving averages: ``f``, how often the first draft of a step is accepted, and
   ``c``, how often a draft is accepted after an accepted one; position ``j`` (1-based) holds
   with probability about ``f * c**(j-1)`` and the request asks for drafts while that is
   ``>= MIN_GAIN``, capped at ``k``. Below ``f = MIN_GAIN`` (a learned drafter may set the
   starting ``f``, :attr:`Proposer.first_rate_prior`) it stops and tries a one-token draft after
   ``PROBE_EVERY`` steps, doubling the wait after each failed probe (up to ``MAX_PROBE_EVERY``).
2. *Against the measured cost.* Decode-only step times are kept per step size
   (:class:`StepTable`, seeded at start-up by :meth:`SpeculativeDecoder.calibrate` with verify
   forwards of ``1 .. k + 1`` rows, whose shape then only scales with one shared load factor;
   a line fitted over all steps,
   :class:`~tokenmill.engine.step_cost.TokenLine`, extends it to unseen sizes), and the
   proposer's own time ``D`` is measured. The draft rows of all requests are ranked by gain and
   the step sends the number ``R`` of best rows that maximises ``(B + gains) / (T(B + R) + D)``
   (``B`` decodes), trying every ``R``: a step's time is not a line in its rows (on the int4
   weights the second row nearly doubles a step, rows 3-4 add little), so a lone draft may not
   pay while three do.
   Where rows are nearly free (a weight-bound step) every promising draft goes out; where they
   are dear only likely ones do; if no ``R > 0`` pays, the step drafts nothing, with a one-token
   probe every ``COST_PROBE_EVERY`` (``CUT_PROBE_EVERY`` for draft-then-cut proposers) steps,
   or rarer, so that probes take at most ``PROBE_BUDGET`` of the decode time. Gated drafts
   must beat sending none by ``GATE_MARGIN`` (a miss costs a multi-row step).
   On top, one step's drafts are capped at ``speculative_max_draft_tokens`` in total.

Hidden-state capture (learned drafters, ``Proposer.capture_layers``): capturing costs the
target forward something (the fused decode stack is split at the captured layers) and so does
handing the drafter the new rows, so a step captures only for the requests that may draft soon
(:meth:`SpeculativeDecoder.plan_capture`): a request whose drafts are verified in the step (an
accepted probe turns drafting back on at once, with its context unbroken), and one whose next
possible draft, as the adaptive rule above will decide it, is at most
``Proposer.resume_context`` steps away (its next one-token probe, or the next cost probe while
no row pays). Those steps give the drafter the ``resume_context`` most recent positions before
it drafts; the proposer itself refuses to draft from a context broken by a gap until it holds
that many (so a wrong guess costs a probe or a few steps, never a draft from a stale context).
Without adaptive ``k``, every step captures.
"""
from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from tokenmill.engine.spec.base import ConfidenceCalibration, Draft, KindStats, Proposer, SpecStats
from tokenmill.engine.step_cost import TokenLine

if TYPE_CHECKING:
    from tokenmill.engine.config import EngineConfig
    from tokenmill.engine.model_runner import StepResult
    from tokenmill.engine.request import Request
    from tokenmill.engine.scheduler import Scheduler, SchedulerOutput

log = logging.getLogger(__name__)

MIN_GAIN = 0.15      # draft position j while accept_rate ** j >= MIN_GAIN
PROBE_EVERY = 8      # steps between one-token probes of a request whose drafts are poor ...
MAX_PROBE_EVERY = 64  # ... doubling after each probe that fails, up to this
COST_PROBE_EVERY = 32  # steps between short drafts while drafting does not pay for its cost
PROBE_BUDGET = 0.02   # share of decode time that cost probes may take
CUT_PROBE_EVERY = 128  # the same for draft-then-cut proposers (their kinds are pooled over requests)
GATE_MARGIN = 0.03   # the draft gate sends rows only if they raise expected tokens/s by this share
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
                 constrained: bool = True, gate: bool = True) -> None:
        """``constrained``: requests with a grammar draft too (their drafts cut by the grammar,
        their rows masked per draft position); False leaves them to plain decoding.
        ``gate``: drafts that carry a per-token confidence are cut by the draft gate (its
        calibrated confidences give each row's gain); False: by the pooled acceptance of
        their kind instead (the rule before the gate)."""
        self.proposer = proposer
        self.scheduler = scheduler
        self.k = num_speculative_tokens
        self.max_model_len = max_model_len
        self.adaptive = adaptive
        self.max_draft_tokens = max_draft_tokens
        self.constrained = constrained
        self.gate = gate
        self.calibration = ConfidenceCalibration()   # the draft gate's (confidence -> acceptance)
        self.stats = SpecStats(proposer.name, num_speculative_tokens)
        # decode-only step time as a line in its tokens (fed by the engine), and the proposer's
        # own time per step (observe + propose): the costs stage 2 of adaptive k weighs
        self.cost = TokenLine(decay=0.97, min_samples=8.0)
        self.table = StepTable()   # ... and per step size, for sizes seen often enough
        self.propose_seconds = 0.0
        self._steps = 0
        self.steps_off = 0     # steps on which drafting did not pay and was skipped (not probes)
        self.kinds: dict[int, KindStats] = {}   # acceptance per draft kind (drafts_then_cuts proposers)
        # stage 2's last verdict: 0 while rows pay (or it has not decided yet), else the
        # period of its cost probes while none pays
        self._cost_every = 0
        self._capturing: set[str] = set()   # requests handed the hidden states of the step being run

    def calibrate(self, time_rows: Callable[[int], float]) -> None:
        """Seed the step-time table with ``time_rows(n)``, the measured forward time of a
        single-sequence step of ``n`` rows, for ``n = 1 .. k + 1`` (online steps refine it)."""
        times = []
        for n in range(1, self.k + 2):
            seconds = time_rows(n)
            times.append(seconds)
            self.table.calibrate(n, seconds)
            for _ in range(int(StepTable.MIN_WEIGHT)):
                self.cost.observe(n, seconds)
        log.info("speculative decoding: a step of 1..%d rows takes %s ms", self.k + 1,
                 " / ".join(f"{1000 * t:.1f}" for t in times))

    def observe_step(self, out: SchedulerOutput, seconds: float) -> None:
        """The engine's wall time for the forward + verification of ``out``; decode-only
        steps (every request one token behind, plus its drafts) feed the cost line."""
        if out.scheduled and all(s.num_tokens == 1 + s.num_draft for s in out.scheduled):
            expected = self.step_time(out.num_tokens)
            if expected is not None and expected > 0:   # a step slowed by another process: clip it
                seconds = min(seconds, 1.5 * expected)
            self.cost.observe(out.num_tokens, seconds)
            self.table.observe(out.num_tokens, seconds)

    def plan_capture(self, out: SchedulerOutput) -> frozenset[int]:
        """The target layers the step ``out`` is about to run captures (module doc): the
        proposer's when some scheduled request may draft soon, else none. The requests chosen
        are the ones :meth:`after_step` hands the hidden states to."""
        layers = self.proposer.capture_layers
        self._capturing.clear()
        if not layers:
            return layers
        for s in out.scheduled:
            if s.num_draft or self._wants_context(s.request):
                self._capturing.add(s.request.request_id)
        return layers if self._capturing else frozenset()

    def _wants_context(self, req: Request) -> bool:
        if not req.params.speculative or (req.grammar is not None and not self.constrained):
            return False
        lead = self.proposer.resume_context
        if not self.adaptive or lead <= 0 or self.proposer.drafts_then_cuts:
            return True
        self._seed_estimates(req)
        return self._steps_to_draft(req) <= lead

    def _steps_to_draft(self, req: Request) -> int:
        """In how many steps the adaptive rule may next draft for ``req`` (1: at the end of the
        coming step), as its counters stand now; a large number when its next probe will be
        dropped (stage 2 pays for no row and the probe does not fall on a cost probe)."""
        if req.spec_first_rate >= MIN_GAIN:
            m = 1
        else:
            m = max(1, req.spec_probe_every - req.spec_steps_off)
        if self._cost_every:
            to_probe = -(self._steps + m) % self._cost_every
            if req.spec_first_rate >= MIN_GAIN:
                return m + to_probe
            if to_probe:
                return 1 << 30
        return m

    def _seed_estimates(self, req: Request) -> None:
        if not req.spec_seen:
            req.spec_seen = True
            if self.proposer.first_rate_prior is not None:
                req.spec_first_rate = self.proposer.first_rate_prior

    def after_step(self, out: SchedulerOutput, result: StepResult) -> None:
        """Roll back, record, feed the drafter, and propose the next drafts (see module doc)."""
        for s in result.sampled:
            if s.num_draft:
                req = s.request
                self.scheduler.rollback(req)
                self.stats.record(s.num_draft, s.num_accepted)
                if req.spec_confidence is not None:
                    self.calibration.record(req.spec_confidence, s.num_draft, s.num_accepted)
                if req.spec_kind is not None:
                    self._kind(req.spec_kind).record(s.num_draft, s.num_accepted)
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
            s.request.spec_kind = None
            s.request.spec_confidence = None
        if self._propose():
            dt = time.perf_counter() - t0
            self.propose_seconds += COST_WEIGHT * (dt - self.propose_seconds) if self.propose_seconds else dt

    def _observe(self, out: SchedulerOutput, result: StepResult) -> None:
        layers = sorted(self.proposer.capture_layers)
        import torch

        feats = torch.cat([result.captured[i] for i in layers], dim=-1)
        for s, row in zip(out.scheduled, result.query_start):
            req = s.request
            if req.is_finished or req.num_computed_tokens <= s.start or req.request_id not in self._capturing:
                continue
            n = req.num_computed_tokens - s.start   # the step's real tokens + accepted drafts
            self.proposer.observe(req, s.start, feats[row:row + n])

    def _propose(self) -> bool:
        """Draft for the decoding requests; True when the proposer ran."""
        self._steps += 1
        reqs: list[Request] = []
        ks: list[int] = []
        num_decode = 0
        # a cheap proposer that tags its drafts drafts the longest allowed, and the drafts are
        # cut after (stage 1 then uses the pooled acceptance of each draft's kind)
        cuts = self.adaptive and self.proposer.drafts_then_cuts
        for req in self.scheduler.running:
            if req.num_uncomputed_tokens != 1:
                continue
            num_decode += 1
            if not req.params.speculative or (req.grammar is not None and not self.constrained):
                continue
            self._seed_estimates(req)
            k = self.k if cuts else self._draft_len(req)
            # never draft past max_tokens or the context limit (the step emits up to k + 1)
            k = min(k, req.params.max_tokens - req.num_output_tokens - 1,
                    self.max_model_len - req.num_tokens - 1)
            k = self.scheduler.kv.max_drafts(req, k)   # hybrid: stop at the next page boundary
            if k > 0:
                reqs.append(req)
                ks.append(k)
        if not reqs:
            return False
        if cuts:
            drafts = self.proposer.propose(reqs, ks)
            ks = self._cut(reqs, drafts, num_decode)
        else:
            if self.adaptive:
                ks = self._worth_drafting(reqs, ks, num_decode)
                if not any(ks):
                    return False
                keep = [i for i, k in enumerate(ks) if k > 0]
                reqs, ks = [reqs[i] for i in keep], [ks[i] for i in keep]
            drafts = None
        if sum(ks) > self.max_draft_tokens:
            share = max(1, self.max_draft_tokens // max(1, sum(1 for k in ks if k)))
            ks = [min(k, share) for k in ks]
        if drafts is None:
            drafts = self.proposer.propose(reqs, ks)
        for req, k, draft in zip(reqs, ks, drafts):
            tokens = list(draft.token_ids[:k])
            if req.grammar is not None and tokens:   # cut at the first draft the grammar rejects
                tokens = tokens[:req.grammar.draft_prefix(tokens, keep_rejected=draft.probs is not None)]
            if req.draft_validator is not None and tokens:
                tokens = list(req.draft_validator(req, tokens))
            req.spec_token_ids = tokens
            req.spec_probs = draft.probs[: len(tokens)] if draft.probs is not None and tokens else None
            req.spec_kind = draft.kind if tokens else None
            req.spec_confidence = (list(draft.confidence[:len(tokens)])
                                   if self.gate and tokens and draft.confidence is not None else None)
        return True

    def _kind(self, kind: int) -> KindStats:
        st = self.kinds.get(kind)
        if st is None:
            priors = self.proposer.kind_first_prior
            below = [k for k in priors if k <= kind]
            first = priors[max(below)] if below else 0.5
            st = self.kinds[kind] = KindStats(self.k, first)
        return st

    def _cut(self, reqs: list[Request], drafts: list[Draft], num_decode: int) -> list[int]:
        """How many of each (already proposed) draft to send (the draft gate): stage 2 over
        each row's gain, from the draft's calibrated per-token confidences (or, with the gate
        off or without confidences, its kind's pooled acceptance; the request's own averages
        for an untagged draft); before the cost line is known, positions whose gain is at
        least ``MIN_GAIN``."""
        gains = []
        for req, d in zip(reqs, drafts):
            n = len(d.token_ids)
            if self.gate and d.confidence is not None:
                gains.append(self.calibration.gains(d.confidence[:n]))
            elif d.kind is not None:
                gains.append(self._kind(d.kind).gains(n))
            else:
                gains.append([_row_gain(req, j) for j in range(n)])
        # the proposer's time is spent already
        margin = GATE_MARGIN if self.gate and any(d.confidence is not None for d in drafts) else 0.0
        chosen = self._choose_rows(gains, num_decode, 0.0, CUT_PROBE_EVERY, margin)
        if chosen is None:
            return [sum(1 for g in gs if g >= MIN_GAIN) for gs in gains]
        return chosen

    def _worth_drafting(self, reqs: list[Request], ks: list[int], num_decode: int) -> list[int]:
        """Stage 2 of adaptive ``k`` for a proposer asked for ``ks`` drafts (module doc)."""
        gains = [[_row_gain(r, j) for j in range(k)] for r, k in zip(reqs, ks)]
        chosen = self._choose_rows(gains, num_decode, self.propose_seconds)
        return ks if chosen is None else chosen

    def _choose_rows(self, gains: list[list[float]], num_decode: int, propose_seconds: float,
                     probe_every: int = COST_PROBE_EVERY, margin: float = 0.0) -> list[int] | None:
        """Stage 2 of adaptive ``k`` (module doc): how many draft rows of each request give the
        step the most expected tokens per second, given each row's expected gain
        (non-increasing per request), the measured step times and the proposer's time. The
        rows are taken best first and every count is tried, because the time of a step is not
        a line in its rows (a multi-row kernel may cost as much for two rows as for four).
        ``margin``: rows must raise the rate by at least this share over sending none (a
        guard against noise in the estimates: a miss costs a multi-row step). None: too
        little measured yet."""
        n = max(num_decode, 1)
        line = self.cost.fit()
        base_time = self.table.predict(n, line)
        if base_time is None:
            self._cost_every = 0
            return None
        base_time = max(base_time, 1e-6)
        rows = sorted(((g, i) for i, gs in enumerate(gains) for g in gs), reverse=True)
        floor = n / base_time
        best_rate, best_r = floor * (1.0 + margin), 0
        tokens = float(n)
        t_prev = base_time
        for r, (g, _) in enumerate(rows, start=1):
            tokens += g
            t = self.table.predict(n + r, line)
            # a size with no estimate costs at least the largest smaller one (never less)
            t = t_prev = max(t if t is not None else t_prev, t_prev)
            rate = tokens / (t + propose_seconds)
            if rate > best_rate:
                best_rate, best_r = rate, r
        if best_r == 0:
            # keep the estimates fresh: a short draft now and then, rarer when a probe is dear
            # (its extra row and the proposer's pass), so probing costs at most PROBE_BUDGET
            probe_time = max((self.step_time(n + 1) or base_time) - base_time, 0.0) + propose_seconds
            every = self._cost_every = max(probe_every, int(probe_time / (PROBE_BUDGET * base_time)))
            if self._steps % every == 0:
                return [min(1, len(g)) for g in gains]
            self.steps_off += 1
            return [0] * len(gains)
        self._cost_every = 0
        chosen = [0] * len(gains)
        for _, i in rows[:best_r]:
            chosen[i] += 1
        return chosen

    def step_time(self, num_tokens: int) -> float | None:
        """Predicted wall time of a decode-only step of ``num_tokens`` tokens: the measured
        mean at that size, else interpolated between the nearest measured sizes, else the
        fitted line (None while neither exists)."""
        return self.table.predict(num_tokens, self.cost.fit())

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


class StepTable:
    """Decode-only step time per step size (tokens).

    A line fits a weight-bound step well but not a kernel whose cost jumps at row-count
    boundaries (on the int4 weights the second row nearly doubles a step, rows 3-4 add
    little); the table records each size actually seen, and :meth:`predict` interpolates
    between seen sizes.

    Sizes measured at start-up (:meth:`calibrate`) keep their measured *shape* and share one
    *load factor*: every decode-only step of such a size moves the factor towards its time over
    the calibrated time, and the prediction is ``factor x calibrated``. A plain per-size mean
    would go stale unevenly: the size the engine runs most (one row, when drafting does not pay)
    follows the machine's load step by step while the sizes it seldom runs keep their quiet
    start-up times, so under load drafted steps would look cheaper than they are (on a busy
    2-core machine a one-row step ran 1.35x its start-up time while 4-row steps were still
    predicted at theirs, and suffix drafts that did not pay went out: 0.91x on prose).
    Sizes not calibrated keep a moving average of their own.

    The start-up shape can be wrong for the workload: it is timed at a short context, and a
    verify row's attention grows with the context (int4 weights, 2 threads: a 4-row step took
    1.85x a one-row step at 128 tokens of context, 2.07x at 600 and 2.35x at 2,000), and it leaves
    out the verification after the forward. So every calibrated size above the smallest also
    learns a *shape correction*, its observed time over ``load x calibrated`` (a slow moving
    average), and is predicted as ``load x calibrated x correction``. The smallest size anchors
    the load factor (its correction stays 1), so a change of the machine's load moves the load
    factor and leaves every correction where it was.
    """

    MIN_WEIGHT = 2.0    # observations of a size before its mean is used
    WEIGHT = 0.2        # weight of the newest observation once a size has 1 / WEIGHT of them
    LOAD_WEIGHT = 0.1   # weight of the newest calibrated-size step in the load factor
    SHAPE_WEIGHT = 0.05  # weight of the newest step in its size's shape correction, after 1 / SHAPE_WEIGHT

    def __init__(self) -> None:
        self.mean: dict[int, float] = {}
        self.count: dict[int, float] = {}
        self.calibrated: dict[int, float] = {}
        self.load = 1.0
        self.shape: dict[int, float] = {}           # calibrated size -> shape correction
        self.shape_count: dict[int, float] = {}
        self.anchor: int | None = None              # the smallest calibrated size
        self._cache: dict[int, float] | None = None   # _known() until the next change

    def calibrate(self, num_tokens: int, seconds: float) -> None:
        """The start-up time of a step of ``num_tokens`` (the shape the load factor scales)."""
        self.calibrated[num_tokens] = max(seconds, 1e-9)
        self.anchor = min(self.calibrated)
        self._cache = None

    def observe(self, num_tokens: int, seconds: float) -> None:
        self._cache = None
        cal = self.calibrated.get(num_tokens)
        if cal is not None:
            ratio, shape = seconds / cal, 1.0
            if num_tokens != self.anchor:   # the anchor's shape is the calibration's
                shape = self.shape.get(num_tokens, 1.0)
                c = self.shape_count.get(num_tokens, 0.0) + 1.0
                self.shape_count[num_tokens] = c
                shape += max(1.0 / c, self.SHAPE_WEIGHT) * (ratio / self.load - shape)
                self.shape[num_tokens] = shape
            self.load += self.LOAD_WEIGHT * (ratio / shape - self.load)
            return
        c = self.count.get(num_tokens, 0.0) + 1.0
        self.count[num_tokens] = c
        m = self.mean.get(num_tokens, seconds)
        self.mean[num_tokens] = m + max(1.0 / c, self.WEIGHT) * (seconds - m)

    def _known(self) -> dict[int, float]:
        if self._cache is None:
            known = {k: self.mean[k] for k, c in self.count.items() if c >= self.MIN_WEIGHT}
            known.update((k, self.load * t * self.shape.get(k, 1.0)) for k, t in self.calibrated.items())
            self._cache = known
        return self._cache

    def predict(self, n: int, line: tuple[float, float] | None) -> float | None:
        known = self._known()
        if n in known:
            return known[n]
        lo = max((k for k in known if k < n), default=None)
        hi = min((k for k in known if k > n), default=None)
        if lo is not None and hi is not None:
            return known[lo] + (known[hi] - known[lo]) * (n - lo) / (hi - lo)
        slope = line[1] if line is not None else None
        if lo is not None and slope is not None:
            return known[lo] + max(slope, 0.0) * (n - lo)
        if hi is not None and slope is not None:
            return max(known[hi] - max(slope, 0.0) * (hi - n), 1e-6)
        return None if line is None else line[0] + line[1] * n


def _row_gain(req: Request, j: int) -> float:
    """Expected tokens the request's draft at position ``j`` (0-based) adds: the chance it is
    reached and accepted, ``f * c**j``."""
    return req.spec_first_rate * req.spec_continue_rate ** j
