"""Continuous-batching scheduler: pure Python over token counts and page ids (no torch).

One rule, in the style of vLLM v1: each step, every running request is given tokens so that its
``num_computed_tokens`` catches up with ``num_tokens``, within a shared token budget
(``max_batch_tokens``). There is no prefill or decode phase: a decode is a request one token
behind; a long prompt is a request many tokens behind and gets a chunk of what is left.

Order within a step:

1. running requests one token behind (decodes), in priority order; a decode with speculative
   drafts (``req.spec_token_ids``) is given ``1 + k`` tokens (drafts are just more tokens
   behind, and count as decode tokens for the prefill bound); drafts are cut to what the
   budget allows, and dropped rather than preempting anyone for their pages;
2. running requests further behind (prefill chunks), in priority order; when the step already
   carries decodes, prefill (this and admission, chunk by chunk, one allowance per step) gets
   only what :class:`~tokenmill.engine.step_cost.PrefillBound` allows, so a decode's next token
   is not held up by seconds of prefill (step time is learned online from the engine's own
   steps, over token rows and attention reads, so a chunk after a long context is smaller).
   The bound holds when at least one of the step's decodes is ``streamed``: a response sent
   whole is seen only at its end, so its decodes alone leave the step to throughput;
   a short prefill (one that fits a looser bound, ``finish_slowdown``, whole) is done at once,
   since cutting it would only delay its first token, not the decodes;
   Under that bound the prefill with the fewest tokens left goes first, and a waiting request
   with fewer left (after its cached prefix) than every running prefill is admitted before
   them (``shortest_prefill_first``), so a new agent turn is not queued behind a long first
   prompt; a prefill passed over ``prefill_max_passes`` steps in a row goes first;
3. waiting requests, admitted while budget, pages and ``max_running_requests`` allow (none in
   a step that had to preempt); a hybrid model's request also needs a free state slot
   (:meth:`KVManager.take_slot`), and every way out (finish, abort, preemption) frees both.
   From the front of the queue, except that while the queue is
   short (``prefer_cached_max_queue``) the request with the longest cached prefix goes first;
   a request passed over ``admission_max_skips`` times, or one resuming after preemption, is
   never passed over again, so nobody starves. ``prefer_cached_prefix = False`` gives FIFO.

Priority is admission order: ``running[0]`` is the most important. When pages run out the
KV manager first evicts unlocked prefix-cache pages; if that is not enough, the *last* running
request is preempted: its whole computed pages go to the prefix cache, the rest are freed, and
it goes back to the *front* of the waiting queue with ``num_computed_tokens = 0`` so it is later
recomputed (prompt + output so far; a prefix-cache hit makes that cheap).
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import NamedTuple

from tokenmill.engine.kv_manager import KVManager
from tokenmill.engine.request import Request, RequestStatus
from tokenmill.engine.step_cost import PrefillBound, StepCost, StepShape, chunk_pairs


class ScheduledRequest(NamedTuple):
    request: Request
    start: int        # num_computed_tokens before this step: first position computed
    num_tokens: int   # tokens computed this step
    samples: bool     # the step reaches the request's last token, so a new token is sampled
    draft_token_ids: tuple[int, ...] = ()  # speculative drafts scheduled after the last token

    @property
    def num_draft(self) -> int:
        return len(self.draft_token_ids)


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled

    @property
    def shape(self) -> StepShape:
        """Token rows and attention query-key pairs: what the step-cost model is fitted on."""
        return StepShape.of(self.scheduled)


class _StepPlan:
    """Working state while one step is being planned."""

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self.tokens: dict[Request, int] = {}
        self.preempted: list[Request] = []
        self.bound: PrefillBound | None = None   # the step-time bound on prefill (decodes run)
        self.stagger = 0                         # Scheduler.prefill_stagger_tokens, with a bound
        self.holds: dict[Request, int] = {}      # Scheduler._holds: steps each prefill was held
        self.held: set[Request] = set()          # prefills held in this step

    def prefill_limit(self, req: Request, context: int) -> int:
        """Tokens a prefill chunk of ``req`` after ``context`` computed tokens may take: what
        the bound allows, or the whole remainder of a short prefill when the bound's finishing
        exception takes it (a prefill that could be done in one step is; the tail of a long one
        is not: that would stall the decodes once per long prompt for little gain in its time to
        first token)."""
        n = min(req.num_uncomputed_tokens, self.budget)
        if self.bound is None:
            return n
        start = req.num_cached_tokens if req.num_cached_tokens is not None else context
        start = min(start, context)   # where the prefill's uncached part begins
        cap = self.bound.cap(context, n, prefill_tokens=req.num_tokens - start)
        if cap < n and n == req.num_uncomputed_tokens and self.bound.finishes(context, n):
            if self.bound.short(start, req.num_tokens - start):
                return n
        if self.hold(req, cap, n, req.num_tokens - start):
            return 0
        return cap

    def hold(self, req: Request, cap: int, n: int, uncached: int) -> bool:
        """Whether ``req``, a long prefill (more than ``StepCost.lone_min_prefill`` uncached
        tokens) whose bounded chunk would be ``cap`` of the ``n`` it could take, waits this step
        instead (``StepCost.hold_below``). A chunk of a token or two beside a decode costs the
        decode a large part of its step (on packed int4 weights, the rows past the first cost
        most of a one-row step) and moves the prefill by almost nothing; the decodes of short
        answers end in a few steps, and the prefill then takes whole chunks. Each prefill waits
        at most ``StepCost.hold_steps`` steps in all, so that long answers do not starve it; the
        count is kept across steps (``holds``) and once per step (``held``). A prefill that gets
        nothing anyway (another took the step's room: ``cap`` 0) is not held, nor one while the
        step-cost fit is warming up (it must see mixed steps to learn them)."""
        if self.bound is None or self.bound.target is None:   # no bound, or its fit is warming up
            return False
        cost = self.bound.cost
        if not cost.hold_below or cap <= 0 or cap >= min(cost.hold_below, n):
            return False
        if uncached <= cost.lone_min_prefill:
            return False
        if req in self.held:
            return True
        if self.holds.get(req, 0) >= cost.hold_steps:
            return False
        self.holds[req] = self.holds.get(req, 0) + 1
        self.held.add(req)
        return True

    def staggered(self, req: Request, n: int) -> int:
        """``n`` tokens for ``req``, or ``stagger`` fewer where they would complete its prefill
        while another streamed prefill completes in this step and no streamed decode runs (see
        ``Scheduler.prefill_stagger_tokens``). A prefill with no more than ``stagger`` tokens left
        completes: beside the decodes it would finish within a step or two anyway (the bound's
        finishing exception), so holding it back would only cost the room of this step."""
        if (self.stagger and self.bound is None and req.streamed and n == req.num_uncomputed_tokens
                and n > self.stagger
                and any(r.streamed and t == r.num_uncomputed_tokens for r, t in self.tokens.items())):
            return n - self.stagger
        return n

    def add(self, req: Request, n: int, context: int | None = None) -> None:
        """``n`` tokens for ``req``; ``context``: a prefill chunk's start (counted by the bound)."""
        self.tokens[req] = n
        self.budget -= n
        if context is not None and self.bound is not None:
            self.bound.add(context, n)

    def drop(self, req: Request) -> None:
        self.budget += self.tokens.pop(req, 0)


class Scheduler:
    """Owns the waiting queue and the running list; the KV manager owns the pages."""

    def __init__(self, kv: KVManager, *, max_batch_tokens: int, max_running_requests: int,
                 step_cost: StepCost | None = None) -> None:
        if max_batch_tokens <= 0 or max_running_requests <= 0:
            raise ValueError("max_batch_tokens and max_running_requests must be positive")
        self.kv = kv
        self.max_batch_tokens = max_batch_tokens
        self.max_running_requests = max_running_requests
        # Bounds prefill tokens in steps that carry decodes (None: prefill may fill the budget).
        self.step_cost = step_cost
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        # counters
        self.num_preemptions = 0
        self.prompt_tokens_total = 0
        self.cached_tokens_total = 0
        # Cache-aware admission (issue 3; added by the prefix-cache engineer, see _next_waiting).
        self.prefer_cached_prefix = True
        self.prefer_cached_max_queue = 16
        self.admission_max_skips = 4
        self._skips: dict[Request, int] = {}
        # A waiting request that shares this many pages of prompt with one still prefilling
        # waits for those pages to be cached (see _waits_for_shared_prefill).
        self.shared_prefill_min_pages = 2
        # While decodes bound the prefill budget, the prefill with the least left goes first (a
        # new turn of an agent session is done in a step or two instead of queueing behind a
        # long first prompt); one passed over prefill_max_passes steps in a row goes first.
        self.shortest_prefill_first = True
        self.prefill_max_passes = 4
        self._prefill_passes: dict[Request, int] = {}
        # steps each long prefill has waited for decodes so far (StepCost.hold_below; _StepPlan.hold)
        self._holds: dict[Request, int] = {}
        # With the step-time bound on and this set (EngineConfig.prefill_stagger_tokens), a step
        # without streamed decodes completes one streamed prefill with more than this many tokens
        # left at most: another that would complete there stops this many tokens short, and
        # finishes beside the first one's decodes under the bound, a few tokens a step
        # (_StepPlan.staggered). Prompts completed together start decoding together, and every
        # step of their decodes costs what a batch of them costs. On the Mooncake replay at
        # concurrency 4 (int4 weights, an AVX-512 host without AMX) 32 took TPOT p50 from 16 to
        # 13 ms, but on agent sessions it cost 30-50% of TTFT p50: off by default
        # (docs/benchmarks.md, thirty-fourth landing).
        self.prefill_stagger_tokens = 0

    # -- queue -----------------------------------------------------------------------------------
    def add_request(self, req: Request) -> None:
        if req.request_id in self.requests:
            raise ValueError(f"request id {req.request_id!r} is already in use")
        req.status = RequestStatus.WAITING
        self.requests[req.request_id] = req
        self.waiting.append(req)

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def get(self, request_id: str) -> Request | None:
        return self.requests.get(request_id)

    # -- planning --------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        plan = _StepPlan(self.max_batch_tokens)
        plan.stagger = self.prefill_stagger_tokens if self.step_cost is not None else 0
        plan.holds = self._holds
        decodes = [r for r in self.running if r.num_uncomputed_tokens == 1]
        prefills = [r for r in self.running if r.num_uncomputed_tokens > 1]
        drafts = self._schedule_decodes(decodes, plan)
        num_decode = sum(plan.tokens.values())
        if (num_decode and self.step_cost is not None and plan.budget > 0
                and any(r.streamed for r in plan.tokens)):
            # Prefill shares this step with decodes that a client watches token by token: give
            # it only what keeps them moving. (Decodes of responses sent whole are not paced:
            # their client sees only the end, and the step is left to throughput.)
            decode_pairs = sum(chunk_pairs(r.num_computed_tokens, n) for r, n in plan.tokens.items())
            plan.bound = self.step_cost.bound(num_decode, decode_pairs)
            if self.shortest_prefill_first:
                prefills = self._shortest_first(prefills)
                if self.waiting and not plan.preempted:
                    # a waiting request with less left to prefill than every running one goes first
                    self._admit(plan, max_remaining=prefills[0].num_uncomputed_tokens - 1 if prefills else None)
        self._schedule_running(prefills, plan)
        if not plan.preempted:
            self._admit(plan)
        if self._prefill_passes:
            for r in prefills:
                if r in plan.tokens:
                    self._prefill_passes.pop(r, None)
                elif r.status is RequestStatus.RUNNING:
                    self._prefill_passes[r] = self._prefill_passes.get(r, 0) + 1
            for r in [r for r in self._prefill_passes if r.status is not RequestStatus.RUNNING]:
                del self._prefill_passes[r]
        scheduled = []
        for r, n in plan.tokens.items():
            d = drafts.get(r, ())
            scheduled.append(ScheduledRequest(r, r.num_computed_tokens, n,
                                              r.num_computed_tokens + n - len(d) == r.num_tokens, d))
        return SchedulerOutput(scheduled, plan.preempted)

    def _schedule_decodes(self, reqs: list[Request], plan: _StepPlan) -> dict[Request, tuple[int, ...]]:
        """Schedule decodes (with their drafts where pages and budget allow); returns the drafts."""
        drafts: dict[Request, tuple[int, ...]] = {}
        for req in reqs:
            if plan.budget == 0:
                break
            if req.status is not RequestStatus.RUNNING:
                continue
            d = req.spec_token_ids[: plan.budget - 1]
            if d and self.kv.allocate(req, req.num_tokens + len(d)):
                drafts[req] = tuple(d)
                plan.add(req, 1 + len(d))
            elif self._allocate_or_preempt(req, req.num_tokens, plan):
                plan.add(req, 1)
        for req in reqs:   # drafts not scheduled now are stale next step
            if req not in drafts:
                req.spec_token_ids = []
                req.spec_probs = None
        return drafts

    def _schedule_running(self, reqs: list[Request], plan: _StepPlan) -> None:
        for req in reqs:
            if plan.budget == 0:
                break
            if req.status is not RequestStatus.RUNNING:  # preempted earlier in this step
                continue
            n = self.kv.chunk_limit(req, plan.staggered(req, plan.prefill_limit(req, req.num_computed_tokens)))
            if n <= 0:
                if req in plan.held:   # waits for the decodes; another prefill may still go
                    continue
                break
            if self._allocate_or_preempt(req, req.num_computed_tokens + n, plan):
                plan.add(req, n, req.num_computed_tokens)

    def _shortest_first(self, prefills: list[Request]) -> list[Request]:
        """Running prefills by tokens left (stable), those passed over too often first."""
        limit = self.prefill_max_passes
        for r in prefills:
            if r.status is RequestStatus.RUNNING and r not in self._prefill_passes:
                self._prefill_passes[r] = 0
        return sorted(prefills, key=lambda r: (self._prefill_passes.get(r, 0) < limit, r.num_uncomputed_tokens))

    def _admit(self, plan: _StepPlan, max_remaining: int | None = None) -> None:
        """Admit waiting requests into the step; with ``max_remaining``, only while the next one
        has at most that many tokens left to compute after its cached prefix."""
        while self.waiting and plan.budget > 0 and len(self.running) < self.max_running_requests:
            req = self._next_waiting()
            if self._waits_for_shared_prefill(req, plan):
                req = self._first_not_waiting(plan)
                if req is None:
                    return
            if max_remaining is not None and req.num_tokens - self.kv.cached_prefix_tokens(req) > max_remaining:
                return
            if plan.bound is not None:
                req = self._bounded_admission(req, plan)
                if req is None:
                    return
            if not self.kv.take_slot(req):   # hybrid models: every state slot is taken
                return
            matched = self.kv.match(req)
            n = self.kv.chunk_limit(req, plan.staggered(req, plan.prefill_limit(req, req.num_computed_tokens)))
            if n <= 0 or not self.kv.allocate(req, req.num_computed_tokens + n):
                self.kv.release(req, keep_in_cache=False)
                req.num_computed_tokens = 0
                return
            self._admitted(req)
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            if req.num_cached_tokens is None:  # first admission (not a recompute)
                req.num_cached_tokens = matched
                self.prompt_tokens_total += req.num_prompt_tokens
                self.cached_tokens_total += matched
                self.kv.admitted(req)
            plan.add(req, n, req.num_computed_tokens)

    def _next_waiting(self) -> Request:
        """The waiting request to admit next: the queue front, or (short queue, cache on) the
        one with the longest cached prefix, unless someone was passed over too often."""
        head = self.waiting[0]
        if (not self.prefer_cached_prefix or not self.kv.prefix_reuse or len(self.waiting) == 1
                or len(self.waiting) > self.prefer_cached_max_queue or head.num_preemptions):
            return head
        best, best_hit = head, -1
        for req in self.waiting:
            if self._skips.get(req, 0) >= self.admission_max_skips:
                return req
            hit = self.kv.cached_prefix_tokens(req)
            if hit > best_hit:
                best, best_hit = req, hit
        return best

    def _waits_for_shared_prefill(self, req: Request, plan: _StepPlan | None = None) -> bool:
        """Hold ``req`` back while a running request is still prefilling a prompt it shares.

        Parallel requests with one prompt (``n > 1``, parallel tool calls, sessions sharing a
        long system prompt) would otherwise be admitted together and each compute the shared
        part. Held for now, ``req`` is admitted once those pages are in the prefix cache
        (prefill chunks publish whole pages as they complete) and then reuses them. A request is
        held only for a shared part of at least ``shared_prefill_min_pages`` pages that it does
        not already have cached, and only while the other one is still prefilling, so the wait
        is bounded by one prefill. A hybrid model's hit must end at a state snapshot, so the
        other request is asked to take one where the shared part ends (its chunk in ``plan`` is
        cut there), and ``req`` waits only until the other has computed that far.
        """
        if not self.kv.prefix_reuse or req.num_preemptions or req.page_table:
            return False
        hybrid = self.kv.slots is not None
        P = self.kv.page_size
        E = self.kv.cache.page_size   # cache-key elements per page (P: the token ids themselves)
        need = self.shared_prefill_min_pages * P
        n = req.num_tokens
        if n <= need:
            return False
        ids = req.cache_key((n - 1) // P * E)
        head = ids[:E]
        for other in self.running:
            if other.num_computed_tokens >= other.num_prompt_tokens - P:   # its prompt is published
                continue
            o = other.cache_key(other.num_prompt_tokens // P * E)
            if o[:E] != head:
                continue
            pages = min(n - 1, other.num_prompt_tokens) // P
            common = 1
            while common < pages and o[common * E:(common + 1) * E] == ids[common * E:(common + 1) * E]:
                common += 1
            if hybrid and other.num_computed_tokens >= common * P:   # past the shared part already
                continue
            if common * P - self.kv.cached_prefix_tokens(req) >= need:
                if hybrid:
                    self.kv.request_snapshot(other, common * P)
                    planned = plan.tokens.get(other) if plan is not None else None
                    if planned and other.num_computed_tokens + planned > common * P:
                        cut = common * P - other.num_computed_tokens
                        plan.budget += planned - cut
                        plan.tokens[other] = cut
                return True
        return False

    def _bounded_admission(self, req: Request, plan: _StepPlan) -> Request | None:
        """``req`` when the step-time bound has room for a chunk of it (or the finishing exception
        takes it whole); when the hold keeps it waiting (``StepCost.hold_below``), a short request
        behind it, which no hold applies to; None when neither may go in this step."""
        bound = plan.bound
        assert bound is not None
        hit = self.kv.cached_prefix_tokens(req)
        left = req.num_tokens - hit
        whole = bound.finishes(hit, left) and bound.short(hit, left)
        if bound.cap(hit, 1, prefill_tokens=left) <= 0 and not whole:
            return None                      # the step-time bound has no room for another chunk
        if bound.cost.hold_below and not whole:
            lim = min(left, plan.budget)
            if plan.hold(req, bound.cap(hit, lim, prefill_tokens=left), lim, left):
                behind = self._short_behind(req, plan)   # never held itself: one level deep
                return None if behind is None else self._bounded_admission(behind, plan)
        return req

    def _short_behind(self, held: Request, plan: _StepPlan) -> Request | None:
        """The first of the queue's front requests other than ``held`` (a long prompt waiting for
        the decodes) with at most ``StepCost.lone_min_prefill`` tokens to compute after its
        cached prefix, which no hold applies to; None if there is none."""
        assert self.step_cost is not None
        for i, req in enumerate(self.waiting):
            if i >= self.prefer_cached_max_queue:
                return None
            if (req is not held and req.num_tokens - self.kv.cached_prefix_tokens(req) <= self.step_cost.lone_min_prefill
                    and not self._waits_for_shared_prefill(req, plan)):
                return req
        return None

    def _first_not_waiting(self, plan: _StepPlan | None = None) -> Request | None:
        """The first of the queue's front requests that is not held by a shared prefill."""
        for i, req in enumerate(self.waiting):
            if i >= self.prefer_cached_max_queue:
                return None
            if not self._waits_for_shared_prefill(req, plan):
                return req
        return None

    def _admitted(self, req: Request) -> None:
        """Take ``req`` off the queue; everyone ahead of it was passed over once more."""
        if self.waiting[0] is req:
            self.waiting.popleft()
        else:
            for other in self.waiting:
                if other is req:
                    break
                self._skips[other] = self._skips.get(other, 0) + 1
            self.waiting.remove(req)
        self._skips.pop(req, None)

    def _allocate_or_preempt(self, req: Request, num_tokens: int, plan: _StepPlan) -> bool:
        """Find pages for ``req`` up to ``num_tokens``, preempting lower-priority requests.

        Returns False when ``req`` itself had to be preempted (it was the lowest priority left).
        """
        while not self.kv.allocate(req, num_tokens):
            victim = self.running[-1]
            self.preempt(victim)
            plan.drop(victim)
            plan.preempted.append(victim)
            if victim is req:
                return False
        return True

    # -- state changes ---------------------------------------------------------------------------
    def preempt(self, req: Request) -> None:
        """Take a running request off the batch; it is recomputed later from the queue front."""
        self.running.remove(req)
        self.kv.release(req, keep_in_cache=True)
        req.num_computed_tokens = 0
        req.spec_token_ids = []
        req.spec_probs = None
        req.status = RequestStatus.WAITING
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    def post_step(self, out: SchedulerOutput) -> None:
        """After the forward pass: count the computed tokens; cache whole prefill pages.

        Drafts are not counted here: the engine counts each accepted one as it appends it, and
        then :meth:`rollback` frees the pages past the new end (and, for a hybrid model, takes
        the step's snapshot then, at the accepted end, where the state slot now is).
        """
        for s in out.scheduled:
            req = s.request
            req.num_computed_tokens = s.start + s.num_tokens - s.num_draft
            if self.kv.slots is not None and not s.num_draft:   # hybrid: restores, snapshots
                self.kv.after_step(req)
            if s.num_tokens - s.num_draft > 1 or not s.samples:
                # a prefill chunk, the last one included: publish its whole pages at once, so
                # requests sharing the prompt reuse them (decode pages join at release)
                self.kv.cache_computed(req)

    def rollback(self, req: Request) -> None:
        """After verification: free ``req``'s pages past its tokens (rejected drafts' K/V)."""
        if req.status is RequestStatus.RUNNING:
            self.kv.trim(req, req.num_tokens)
            if self.kv.slots is not None:
                self.kv.after_step(req)

    def finish(self, req: Request, finish_reason: str, stop_reason: str | int | None = None) -> None:
        """Request is done (its last sampled token appended): cache its pages and drop it."""
        if req.status is RequestStatus.FINISHED:
            return
        if req.status is RequestStatus.RUNNING:
            self.running.remove(req)
            self.kv.release(req, keep_in_cache=True)
        else:
            self.waiting.remove(req)
            self._skips.pop(req, None)
        self._holds.pop(req, None)
        req.status = RequestStatus.FINISHED
        req.finish_reason = finish_reason
        req.stop_reason = stop_reason
        del self.requests[req.request_id]
        self.kv.session_finished(req.session_id)

    def abort(self, request_id: str) -> Request | None:
        """Drop a request wherever it is; unknown or finished ids are ignored (returns None)."""
        req = self.requests.get(request_id)
        if req is None:
            return None
        self.finish(req, "abort")
        return req

    # -- accounting ------------------------------------------------------------------------------
    def check_pages(self) -> None:
        self.kv.check(self.running)
