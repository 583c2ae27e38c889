"""One simulated replica: continuous batching over a real RadixCache whose pages hold nothing.

Model (per replica, all times in simulated seconds)::

    waiting (FIFO) --admit--> prefilling (one at a time, in chunks) --first token--> decoding
         admit: match_prefix on the cache, lock the match, reserve pages for the rest of the
                prompt and the whole output (evicting LRU pages if the pool is short); wait
                if the pool cannot be freed or max_running_requests are running
         finish: insert prompt+output into the cache, unlock, free the request's tail page

Each engine step runs every decoding request (``decode_step_s(B, C)``) plus, while a prefill is
going on, one chunk of it (``prefill_chunk_s(n, x)``). Between two changes of the batch (a
chunk ends, a request finishes or arrives) every step is the same, so the replica is advanced
analytically rather than step by step: a *virtual step counter* ``V`` grows by ``dt / step_s``
and a decoding request finishes when ``V`` reaches its target. This is exact for the model up
to the fraction of a step that an arrival interrupts (the new batch takes over at once rather
than at the next step boundary), and it makes the cost per request O(log B) instead of one
Python iteration per step.

The cache works in *blocks* of ``block_tokens`` tokens: one block is one element of the key
given to the RadixCache (page_size 1) and one page of its PagePool, which has
``kv_capacity_tokens // block_tokens`` pages. Keys are block ids chosen by the caller so that
equal ids mean equal token blocks; a block is cached only once all its tokens are.
"""
from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Callable
from typing import Any

from tokenmill.cache.page_pool import PagePool
from tokenmill.cache.radix import RadixCache, RadixNode
from tokenmill.sim.profiles import ReplicaProfile

_EPS_STEPS = 1e-6   # a chunk or a decode within this many steps of its end counts as done


class SimRequest:
    """A request inside the simulator: its key, lengths, timings and where it is.

    ``key`` holds the block ids of the prompt followed by the output: its first
    ``(prompt_tokens - 1) // block_tokens`` entries are looked up at admission (the last prompt
    token is always computed) and its first ``(prompt_tokens + output_tokens) // block_tokens``
    entries are inserted when the request finishes.
    """

    __slots__ = ("rid", "session_id", "key", "prompt_tokens", "output_tokens", "arrival", "owner",
                 "meta", "branch", "replica_id", "decision_kind", "cached_tokens", "t_admit",
                 "t_first_token", "t_finish", "node", "matched_pages", "pages", "prefill_left",
                 "chunk_n", "chunk_left", "position", "target_v", "context", "insert_key_len")

    def __init__(self, rid: int, session_id: str | None, key: list[int], prompt_tokens: int,
                 output_tokens: int, arrival: float, owner: Any = None, branch: int = 0,
                 insert_key_len: int | None = None) -> None:
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
        self.node: RadixNode | None = None
        self.matched_pages: list[int] = []
        self.pages: list[int] = []
        self.prefill_left = 0
        self.chunk_n = 0
        self.chunk_left = 0.0
        self.position = 0
        self.target_v = 0.0
        self.context = 0.0
        self.insert_key_len = len(key) if insert_key_len is None else insert_key_len

    @property
    def ttft(self) -> float:
        return self.t_first_token - self.arrival


class SimReplica:
    """A replica's scheduler and cache state; advanced by the fleet's event loop.

    The loop calls ``submit`` when the router sends a request, and ``on_event`` at the time
    ``next_event_time`` returned (after which it asks again). Both return the requests that
    finished. ``version`` increases at every change, so the loop can drop stale events.
    """

    def __init__(self, replica_id: str, profile: ReplicaProfile, block_tokens: int,
                 clock: Callable[[], float], *, session_retention_s: float = 60.0,
                 created_at: float = 0.0) -> None:
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
        self.created_at = created_at
        self.draining = False
        self.waiting: deque[SimRequest] = deque()
        self.prefilling: SimRequest | None = None
        self._decoding: list[tuple[float, int, SimRequest]] = []
        self._v = 0.0              # decode steps done since creation (virtual step counter)
        self._ctx = 0.0            # sum of the decoding requests' contexts
        self._t = created_at       # time up to which the state is advanced
        self.version = 0
        self.sessions: dict[str, int] = {}   # session id -> its requests on this replica
        # totals, for the summary
        self.busy_s = 0.0
        self.num_finished = 0
        self.prompt_tokens = 0
        self.cached_tokens = 0
        self.output_tokens = 0

    # ----------------------------------------------------------------- load figures
    @property
    def num_running(self) -> int:
        return len(self._decoding) + (self.prefilling is not None)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def inflight(self) -> int:
        return self.num_running + len(self.waiting)

    @property
    def kv_cache_usage(self) -> float:
        """Pages held by requests or pinned by them, over all pages (evictable cache is free)."""
        pool = self.pool
        return (pool.num_pages - pool.num_free() - self.cache.num_evictable_pages) / pool.num_pages

    @property
    def idle(self) -> bool:
        return self.prefilling is None and not self._decoding and not self.waiting

    # ----------------------------------------------------------------- the step model
    def _step_s(self) -> float:
        s = 0.0
        b = len(self._decoding)
        if b:
            s = self.profile.decode.step_s(b, self._ctx)
        req = self.prefilling
        if req is not None:
            s += self.profile.prefill.chunk_s(req.chunk_n, req.position)
        return s

    def _advance(self, now: float) -> None:
        dt = now - self._t
        if dt <= 0:
            return
        self._t = now
        if self.prefilling is None and not self._decoding:
            return
        self.busy_s += dt
        steps = dt / self._step_s()
        b = len(self._decoding)
        if b:
            self._v += steps
            self._ctx += b * steps * self.profile.decode.tokens_per_step
        req = self.prefilling
        if req is not None:
            req.chunk_left = max(0.0, req.chunk_left - steps * req.chunk_n)

    def next_event_time(self) -> float | None:
        """When the next chunk ends or the next decode finishes, at the current batch."""
        steps = float("inf")
        if self._decoding:
            steps = max(0.0, self._decoding[0][0] - self._v)
        req = self.prefilling
        if req is not None:
            steps = min(steps, req.chunk_left / req.chunk_n)
        if steps == float("inf"):
            return None
        return self._t + steps * self._step_s()

    # ----------------------------------------------------------------- calls from the loop
    def submit(self, req: SimRequest, now: float) -> list[SimRequest]:
        """Queue a request routed here; returns requests finished on the way (none today)."""
        self._advance(now)
        req.replica_id = self.id
        self.waiting.append(req)
        if req.session_id is not None:
            self.sessions[req.session_id] = self.sessions.get(req.session_id, 0) + 1
        done = self._progress(now)
        self.version += 1
        return done

    def on_event(self, now: float) -> list[SimRequest]:
        self._advance(now)
        done = self._progress(now)
        self.version += 1
        return done

    def fits(self, req: SimRequest) -> bool:
        """Whether the request could ever run here (its blocks fit in the whole pool)."""
        return -(-(req.prompt_tokens + req.output_tokens) // self.block_tokens) <= self.pool.num_pages

    # ----------------------------------------------------------------- internals
    def _progress(self, now: float) -> list[SimRequest]:
        done: list[SimRequest] = []
        while True:
            changed = False
            heap = self._decoding
            while heap and heap[0][0] - self._v <= _EPS_STEPS:
                req = heapq.heappop(heap)[2]
                self._ctx -= req.context + req.output_tokens - 1
                self._finish(req, now)
                done.append(req)
                changed = True
            if not heap:
                self._ctx = 0.0
            req = self.prefilling
            if req is not None and req.chunk_left <= _EPS_STEPS * req.chunk_n:
                req.prefill_left -= req.chunk_n
                req.position += req.chunk_n
                if req.prefill_left > 0:
                    self._start_chunk(req)
                else:
                    self.prefilling = None
                    req.t_first_token = now
                    self._start_decode(req, now, done)
                changed = True
            if self.prefilling is None and self.waiting and self._admit(now):
                changed = True
            if not changed:
                return done

    def _start_chunk(self, req: SimRequest) -> None:
        req.chunk_n = min(self.profile.max_prefill_tokens, req.prefill_left)
        req.chunk_left = float(req.chunk_n)

    def _start_decode(self, req: SimRequest, now: float, done: list[SimRequest]) -> None:
        if req.output_tokens == 1:
            self._finish(req, now)
            done.append(req)
            return
        steps = (req.output_tokens - 1) / self.profile.decode.tokens_per_step
        req.target_v = self._v + steps
        req.context = float(req.prompt_tokens + 1)
        if not self._decoding:
            self._ctx = 0.0
        self._ctx += req.context
        heapq.heappush(self._decoding, (req.target_v, req.rid, req))

    def _admit(self, now: float) -> bool:
        """Start the head of the queue's prefill if a slot and its pages are there."""
        if self.num_running >= self.profile.max_running_requests:
            return False
        req = self.waiting[0]
        b = self.block_tokens
        m = self.cache.match_prefix(req.key[:(req.prompt_tokens - 1) // b])
        self.cache.lock(m.node)
        need = -(-(req.prompt_tokens + req.output_tokens) // b) - len(m.pages)
        short = need - self.pool.num_free()
        if short > 0:
            self.cache.evict(short)
        pages = self.pool.alloc(need)
        if pages is None:
            self.cache.unlock(m.node)
            return False
        self.waiting.popleft()
        req.node, req.matched_pages, req.pages = m.node, m.pages, pages
        req.cached_tokens = m.num_tokens * b
        req.position = req.cached_tokens
        req.prefill_left = req.prompt_tokens - req.cached_tokens
        req.t_admit = now
        self.prompt_tokens += req.prompt_tokens
        self.cached_tokens += req.cached_tokens
        self.prefilling = req
        self._start_chunk(req)
        return True

    def _finish(self, req: SimRequest, now: float) -> None:
        req.t_finish = now
        n_full = min((req.prompt_tokens + req.output_tokens) // self.block_tokens, req.insert_key_len)
        n_matched = len(req.matched_pages)
        n_own = max(0, n_full - n_matched)
        if n_full > n_matched:
            self.cache.insert(req.key[:n_full], req.matched_pages + req.pages[:n_own],
                              session_id=req.session_id)
        else:
            n_own = 0
        if len(req.pages) > n_own:
            self.pool.free(req.pages[n_own:])
        assert req.node is not None
        self.cache.unlock(req.node)
        req.node, req.pages, req.matched_pages = None, [], []
        self.num_finished += 1
        self.output_tokens += req.output_tokens
        sid = req.session_id
        if sid is not None:
            left = self.sessions[sid] - 1
            if left:
                self.sessions[sid] = left
            else:
                del self.sessions[sid]
                self.cache.session_finished(sid)

    def check_invariants(self) -> None:
        """Page accounting: free + cached + pages held only by requests == all pages."""
        self.cache.check_invariants()
        held = sum(len(r.pages) for _, _, r in self._decoding)
        if self.prefilling is not None:
            held += len(self.prefilling.pages)
        total = self.pool.num_free() + self.cache.num_cached_pages + held
        if total != self.pool.num_pages:
            raise AssertionError(f"replica {self.id}: {total} pages accounted for, pool has {self.pool.num_pages}")
