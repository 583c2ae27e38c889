"""One simulated replica: the engine's own scheduler and KV manager, a cost model for the forward pass.

Admission, chunked prefill, preemption and prefix caching are not modelled here: a replica runs
the engine's :class:`~tokenmill.engine.scheduler.Scheduler` over the engine's
:class:`~tokenmill.engine.kv_manager.KVManager`, a real :class:`~tokenmill.cache.radix.RadixCache`
and a :class:`~tokenmill.cache.page_pool.PagePool` whose pages hold nothing. Where the engine
runs the model, the replica asks the profile how long the step takes (:func:`step_seconds`) and
appends the request's next token.

Tokens and pages. One page holds ``block_tokens`` tokens. A request carries the *keys* of its
pages (block ids chosen by the caller: equal ids mean equal blocks of tokens) instead of token
ids, and the radix cache is keyed one element per page (``page_size`` 1), so a match or an insert
costs one element per page, not one per token. Token counts (prompt, output, chunk sizes, the
step budget) are real tokens. Pages past the caller's keys (outputs of trace requests) get keys
of their own that match nothing.

Time. A step scheduled at ``t`` ends at ``t + step_seconds``; its tokens appear then, and a
request that arrives meanwhile waits for the next step, as in the engine loop. A run of steps in
which every running request decodes and nothing else can change (no admission possible, no
prefill, free pages enough for every step, nobody finishing before the last step) is planned in
one go; an arrival cuts it at the step then in flight. A waiting request whose admission failed
for want of pages does not stop a run: until a request finishes or arrives, every step's
admission try repeats the failed one (same candidate, same cache match, nothing left to evict).
This is exact: a run does what the same steps one by one would do (``fast_forward=False`` turns
runs off, and the tests compare both).
"""
from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any, overload

from tokenmill.cache.page_pool import PagePool
from tokenmill.cache.radix import RadixCache
from tokenmill.engine.kv_manager import KVManager
from tokenmill.engine.request import Request
from tokenmill.contracts.sampling import SamplingParams
from tokenmill.engine.scheduler import Scheduler, SchedulerOutput
from tokenmill.engine.step_cost import StepCost
from tokenmill.sim.profiles import ReplicaProfile
from tokenmill.sim.tiers import SimTiers

_TOKEN_ID_MASK = (1 << 31) - 1


class SimTokenIds(Sequence[int]):
    """A request's token ids held as page keys: a length that grows, no stored tokens.

    Token ``i`` has a synthetic id derived from its page's key and its offset in the page, so
    two requests share a token prefix exactly when they share page keys.
    """

    __slots__ = ("keys", "page_tokens", "uid", "n")

    def __init__(self, keys: list[Any], page_tokens: int, uid: int, n: int) -> None:
        self.keys = keys
        self.page_tokens = page_tokens
        self.uid = uid
        self.n = n

    def __len__(self) -> int:
        return self.n

    def grow(self, k: int) -> None:
        self.n += k

    def page_keys(self, num_pages: int) -> list[Any]:
        """The keys of (at least) the first ``num_pages`` pages, in place."""
        keys = self.keys
        if num_pages > len(keys):   # pages the caller gave no key: unique to this request
            keys.extend((self.uid, j) for j in range(len(keys), num_pages))
        return keys

    def _token(self, i: int) -> int:
        page = i // self.page_tokens
        return hash((self.page_keys(page + 1)[page], i % self.page_tokens)) & _TOKEN_ID_MASK

    @overload
    def __getitem__(self, i: int) -> int: ...
    @overload
    def __getitem__(self, i: slice) -> list[int]: ...

    def __getitem__(self, i: int | slice) -> int | list[int]:
        if isinstance(i, slice):
            return [self._token(j) for j in range(*i.indices(self.n))]
        if i < 0:
            i += self.n
        if not 0 <= i < self.n:
            raise IndexError("token index out of range")
        return self._token(i)

    def __iter__(self) -> Iterator[int]:
        return (self._token(j) for j in range(self.n))


class SimEngineRequest(Request):
    """The engine's Request, keyed by page (see :class:`SimTokenIds`)."""

    sim: SimRequest

    # The scheduler reads these every step: straight from the counters, same values as the base.
    @property
    def num_tokens(self) -> int:
        return self.all_token_ids.n  # type: ignore[attr-defined, no-any-return]

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.all_token_ids.n - self.num_computed_tokens  # type: ignore[attr-defined, no-any-return]

    @property
    def num_output_tokens(self) -> int:
        return self.all_token_ids.n - self.prompt_token_ids.n  # type: ignore[attr-defined, no-any-return]

    def cache_key(self, num_elements: int) -> Sequence[Any]:
        return self.all_token_ids.page_keys(num_elements)  # type: ignore[attr-defined, no-any-return]


class SimRequest:
    """A request inside the simulator: its page keys, lengths, timings and where it is.

    ``key`` holds the block ids of the prompt followed by the output (block ``j`` covers tokens
    ``j*block_tokens .. (j+1)*block_tokens - 1``); blocks past its end get keys unique to the
    request. ``engine`` is the engine request that the replica's scheduler runs.
    """

    __slots__ = ("rid", "session_id", "key", "prompt_tokens", "output_tokens", "arrival", "owner",
                 "meta", "branch", "replica_id", "decision_kind", "cached_tokens", "t_admit",
                 "t_first_token", "t_finish", "engine")

    def __init__(self, rid: int, session_id: str | None, key: list[Any], prompt_tokens: int,
                 output_tokens: int, arrival: float, owner: Any = None, branch: int = 0) -> None:
        if prompt_tokens < 1 or output_tokens < 1:
            raise ValueError(f"request needs >= 1 prompt and output token, got {prompt_tokens}/{output_tokens}")
        self.rid = rid
        self.session_id = session_id
        self.key = key
        self.prompt_tokens = prompt_tokens
        self.output_tokens = output_tokens
        self.arrival = arrival
        self.owner = owner            # the session (or trace entry) that sent it
        self.branch = branch
        self.meta: Any = None         # the RequestMeta given to the policy
        self.replica_id: str | None = None
        self.decision_kind = ""
        self.cached_tokens = 0
        self.t_admit = -1.0
        self.t_first_token = -1.0
        self.t_finish = -1.0
        self.engine: SimEngineRequest | None = None

    @property
    def ttft(self) -> float:
        return self.t_first_token - self.arrival

    def make_engine_request(self, block_tokens: int) -> SimEngineRequest:
        keys = list(self.key)
        er = SimEngineRequest(str(self.rid), SimTokenIds(keys, block_tokens, self.rid, self.prompt_tokens),  # type: ignore[arg-type]
                              SamplingParams(max_tokens=self.output_tokens, ignore_eos=True),
                              session_id=self.session_id, arrival_index=self.rid,
                              all_token_ids=SimTokenIds(keys, block_tokens, self.rid, self.prompt_tokens))  # type: ignore[arg-type]
        er.sim = self
        self.engine = er
        return er


def step_seconds(profile: ReplicaProfile, out: SchedulerOutput) -> float:
    """Time of one engine step from its scheduled token counts.

    Rows of one token (decodes) cost a decode step of the profile over their batch and the
    context they read; rows of more tokens (prefill chunks) cost the prefill model, its fixed
    part once per step. A profile decode step yields ``tokens_per_step`` tokens per request
    (speculative decoding), while the scheduler gives each decode one token per step, so a
    decode step costs ``1 / tokens_per_step`` of the profile's.
    """
    rows = ctx = 0
    chunk = 0.0
    chunks = False
    pre = profile.prefill
    for s in out.scheduled:
        n = s.num_tokens
        if n == 1:
            rows += 1
            ctx += s.start + 1
        else:
            chunks = True
            chunk += n * (pre.per_token_s + pre.per_token_context_s * (s.start + n / 2))
    t = 0.0
    if rows:
        t = profile.decode.step_s(rows, ctx) / profile.decode.tokens_per_step
    if chunks:
        t += pre.fixed_s + chunk
    return t


def _pages_needed(room: list[int], k: int, page_tokens: int) -> int:
    """New pages for ``k`` more tokens each, given the free token slots each request has."""
    return sum(-(-(k - g) // page_tokens) for g in room if g < k)


class _DecodeRun:
    """``k`` decode-only steps of a fixed batch, planned at ``t0``. Step ``j`` (1-based) ends at
    ``t0 + j*a + c*j*(j-1)/2``: every step reads one more token per request than the last."""

    __slots__ = ("k", "t0", "a", "c")

    def __init__(self, k: int, t0: float, a: float, c: float) -> None:
        self.k, self.t0, self.a, self.c = k, t0, a, c

    def end(self, j: int) -> float:
        return self.t0 + j * self.a + self.c * j * (j - 1) / 2


class SimReplica:
    """A replica's scheduler and cache state; advanced by the fleet's event loop.

    The loop calls ``submit`` when the router sends a request, and ``on_event`` at the time
    ``next_event_time`` returned (after which it asks again). Both return the requests that
    finished. ``version`` increases at every change, so the loop can drop stale events.
    """

    def __init__(self, replica_id: str, profile: ReplicaProfile, block_tokens: int,
                 clock: Callable[[], float], *, session_retention_s: float = 60.0,
                 created_at: float = 0.0, fast_forward: bool = True, store: Any = None) -> None:
        if block_tokens < 1:
            raise ValueError(f"block_tokens must be >= 1, got {block_tokens}")
        num_pages = profile.kv_capacity_tokens // block_tokens
        if num_pages < 1:
            raise ValueError(f"block_tokens {block_tokens} exceeds the KV capacity {profile.kv_capacity_tokens}")
        self.id = replica_id
        self.profile = profile
        self.block_tokens = block_tokens
        self.pool = PagePool(num_pages)
        self.cache = RadixCache(self.pool, 1, session_retention_s=session_retention_s, clock=clock)
        self.kv = KVManager(self.pool, block_tokens, self.cache)
        self.tiers: SimTiers | None = None
        tp = profile.tier_profile()
        if tp.host_cache_tokens > 0 or store is not None:
            self.tiers = SimTiers(tp, block_tokens, store)
            self.kv.tiers = self.tiers
            self.cache.evict_hook = self.tiers.on_evict
        step_cost = (StepCost(profile.decode_slowdown, finish_slowdown=profile.prefill_finish_slowdown,
                              lone_slowdown=profile.decode_slowdown_lone,
                              hold_below=profile.prefill_hold_below, hold_steps=profile.prefill_hold_steps)
                     if profile.decode_slowdown is not None else None)
        self.scheduler = Scheduler(self.kv, max_batch_tokens=profile.max_prefill_tokens,
                                   max_running_requests=profile.max_running_requests, step_cost=step_cost)
        self.fast_forward = fast_forward
        self.created_at = created_at
        self.draining = False
        self.version = 0
        self.sessions: dict[str, int] = {}   # session id -> its requests on this replica
        self.last_output: SchedulerOutput | None = None   # the step the last event planned
        self._step: SchedulerOutput | None = None          # the step in flight, or
        self._run: _DecodeRun | None = None                # the run of decode steps in flight
        self._busy_until = 0.0
        self._step_s = 0.0
        self._wake: float | None = None      # requests arrived while idle: plan a step then
        self._blocked = False                # the waiting queue's head cannot get its pages
        # totals, for the summary
        self.busy_s = 0.0
        self.num_steps = 0
        self.num_finished = 0
        self.output_tokens = 0

    # ----------------------------------------------------------------- load figures
    @property
    def waiting(self) -> Sequence[Request]:
        return self.scheduler.waiting

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    @property
    def inflight(self) -> int:
        return len(self.scheduler.requests)

    @property
    def kv_cache_usage(self) -> float:
        """Pages held by requests or pinned by them, over all pages (evictable cache is free)."""
        return self.kv.usage()

    @property
    def idle(self) -> bool:
        return not self.scheduler.requests and self._step is None and self._run is None

    @property
    def prompt_tokens(self) -> int:
        return self.scheduler.prompt_tokens_total

    @property
    def cached_tokens(self) -> int:
        return self.scheduler.cached_tokens_total

    @property
    def num_preemptions(self) -> int:
        return self.scheduler.num_preemptions

    def next_event_time(self) -> float | None:
        """When the step (or run of steps) in flight ends, or when a step is to be planned."""
        if self._step is not None or self._run is not None:
            return self._busy_until
        return self._wake

    # ----------------------------------------------------------------- calls from the loop
    def submit(self, req: SimRequest, now: float) -> list[SimRequest]:
        """Queue a request routed here; it joins the next step. Returns [] (nothing finishes)."""
        if self._run is not None:
            self._cut_run(now)
        self._blocked = False
        req.replica_id = self.id
        self.scheduler.add_request(req.make_engine_request(self.block_tokens))
        if req.session_id is not None:
            self.sessions[req.session_id] = self.sessions.get(req.session_id, 0) + 1
        if self._step is None and self._run is None and self._wake is None:
            self._wake = now
        self.version += 1
        return []

    def on_event(self, now: float) -> list[SimRequest]:
        """Finish the step in flight if it has ended, then plan the next one."""
        done: list[SimRequest] = []
        if self._step is not None or self._run is not None:
            if now < self._busy_until:
                return done
            if self._step is not None:
                self._complete_step(self._step, self._busy_until, done)
            else:
                assert self._run is not None
                self._complete_run(self._run, done)
        self._wake = None
        self._plan(now)
        self.version += 1
        return done

    def fits(self, req: SimRequest) -> bool:
        """Whether the request could ever run here (prompt + output fit in the whole pool)."""
        return self.kv.pages_for(req.prompt_tokens + req.output_tokens) <= self.pool.num_pages

    # ----------------------------------------------------------------- stepping
    def _plan(self, now: float) -> None:
        sched = self.scheduler
        self.last_output = None
        if not sched.requests:
            return
        if self.fast_forward:
            k = self._run_length()
            if k >= 2:
                self._start_run(k, now)
                return
        waiting = len(sched.waiting)
        out = sched.schedule()
        self.last_output = out
        # Admission was tried and failed for want of pages: the tries of the next steps repeat
        # it exactly (same candidate, same match, nothing left to evict) until something changes.
        # (With a prefill running the try may instead have been held for a shared prefill.)
        self._blocked = (waiting > 0 and len(sched.waiting) == waiting and not out.preempted
                         and len(sched.running) < sched.max_running_requests
                         and out.num_tokens < sched.max_batch_tokens
                         and all(s.num_tokens == 1 for s in out.scheduled))
        if out.is_empty:   # nothing can run: only a request that never fits (the fleet checks)
            return
        for s in out.scheduled:
            sim = s.request.sim  # type: ignore[attr-defined]
            if sim.t_admit < 0:
                sim.t_admit = now
                sim.cached_tokens = s.request.num_cached_tokens or 0
        dt = step_seconds(self.profile, out)
        if self.tiers is not None:   # pages loaded from L2/L3 at admission, copied before the forward
            dt += self.tiers.take_load_seconds()
        self._step = out
        self._step_s = dt
        self._busy_until = now + dt
        self.busy_s += dt
        self.num_steps += 1

    def _complete_step(self, out: SchedulerOutput, t: float, done: list[SimRequest]) -> None:
        self._step = None
        if self.scheduler.step_cost is not None:   # the engine learns its step time likewise
            self.scheduler.step_cost.observe_step(out.scheduled, self._step_s)
        self.scheduler.post_step(out)
        for s in out.scheduled:
            if s.samples:
                req = s.request
                req.all_token_ids.grow(1)  # type: ignore[attr-defined]
                sim = req.sim  # type: ignore[attr-defined]
                if sim.t_first_token < 0:
                    sim.t_first_token = t
                if req.num_output_tokens >= req.params.max_tokens:
                    self._finish(req, t, done)

    def _finish(self, req: Request, t: float, done: list[SimRequest]) -> None:
        self._blocked = False
        self.scheduler.finish(req, "length")
        sim: SimRequest = req.sim  # type: ignore[attr-defined]
        sim.t_finish = t
        sim.engine = None
        self.num_finished += 1
        self.output_tokens += sim.output_tokens
        sid = sim.session_id
        if sid is not None:
            left = self.sessions[sid] - 1
            if left:
                self.sessions[sid] = left
            else:
                del self.sessions[sid]
        done.append(sim)

    # ----------------------------------------------------------------- runs of decode steps
    def _run_length(self) -> int:
        """How many decode-only steps can be planned at once (0 or 1: plan one step)."""
        sched = self.scheduler
        running = sched.running
        if not running or len(running) > sched.max_batch_tokens:
            return 0
        if sched.waiting and len(running) < sched.max_running_requests and (
                not self._blocked or sched.step_cost is not None):
            return 0           # the next step may admit someone (with a step-cost bound, the
            #                    prefill budget of each try moves with the fit: try every step)
        k = 1 << 62
        P = self.block_tokens
        room: list[int] = []   # tokens each request can still add before it needs a new page
        for r in running:
            n = r.all_token_ids.n  # type: ignore[attr-defined]
            if n - r.num_computed_tokens != 1:
                return 0       # a prefill is going on
            left = r.params.max_tokens - (n - r.prompt_token_ids.n)  # type: ignore[attr-defined]
            if left < k:
                k = left
            # step j computes token n - 1 + j - 1, so it needs ceil((n - 1 + j) / P) pages
            room.append(len(r.page_table) * P - n + 1)
        if k < 2:
            return 0
        free = self.pool.num_free()
        if _pages_needed(room, k, P) <= free:
            return k
        lo, hi = 0, k          # the longest run whose pages are all free (no eviction in it)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if _pages_needed(room, mid, P) <= free:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def _start_run(self, k: int, now: float) -> None:
        running = self.scheduler.running
        prof = self.profile
        ctx = sum(r.all_token_ids.n for r in running)  # type: ignore[attr-defined]  # each decode reads its context
        tps = prof.decode.tokens_per_step
        a = prof.decode.step_s(len(running), ctx) / tps
        c = prof.decode.per_context_token_s * len(running) / tps
        run = _DecodeRun(k, now, a, c)
        self._run = run
        self._busy_until = run.end(k)
        self.busy_s += self._busy_until - now
        self.num_steps += k

    def _cut_run(self, now: float) -> None:
        """An arrival at ``now``: keep the steps up to the one in flight, drop the rest."""
        run = self._run
        assert run is not None
        if run.end(run.k) <= now:
            return
        lo, hi = 1, run.k      # the first step that ends at or after now
        while lo < hi:
            mid = (lo + hi) // 2
            if run.end(mid) >= now:
                hi = mid
            else:
                lo = mid + 1
        end = run.end(lo)
        self.busy_s -= self._busy_until - end
        self.num_steps -= run.k - lo
        run.k = lo
        self._busy_until = end

    def _complete_run(self, run: _DecodeRun, done: list[SimRequest]) -> None:
        """Apply ``run.k`` decode steps at once: what ``schedule`` + ``post_step`` would do."""
        self._run = None
        k = run.k
        kv = self.kv
        t1 = run.end(1)
        t = run.end(k)
        finished: list[Request] = []
        sc = self.scheduler.step_cost
        if sc is not None:   # decode step j reads each request's context, one token longer each step
            b = len(self.scheduler.running)
            ctx = sum(r.num_computed_tokens + 1 for r in self.scheduler.running)
            for j in range(k):
                sc.observe(b, run.a + run.c * j, ctx + b * j)
        for r in self.scheduler.running:
            ok = kv.allocate(r, r.num_computed_tokens + k)
            assert ok, "a decode run was planned without the pages for it"
            r.num_computed_tokens += k
            r.all_token_ids.grow(k)  # type: ignore[attr-defined]
            sim = r.sim  # type: ignore[attr-defined]
            if sim.t_first_token < 0:
                sim.t_first_token = t1
            if r.num_output_tokens >= r.params.max_tokens:
                finished.append(r)
        for r in finished:
            self._finish(r, t, done)

    # ----------------------------------------------------------------- checks
    def check_invariants(self) -> None:
        """Page accounting: free + cached + pages held only by requests == all pages."""
        try:
            self.kv.check(self.scheduler.running)
        except AssertionError as e:
            raise AssertionError(f"replica {self.id}: {e}") from None
