"""Page bookkeeping between the scheduler and the (optional) radix prefix cache.

The scheduler decides *who* runs; this module decides *which pages* they use. It owns no
tensors: pages are integer ids from :class:`~tokenmill.cache.page_pool.PagePool`, and the
prefix cache is a :class:`~tokenmill.cache.radix.RadixCache` (or ``None`` when disabled).

Life of a request's pages::

    admission   match_prefix(prompt[:-1]) -> leading tree pages, locked   (num_tree_pages = k)
    each step   allocate(): pool pages appended for the tokens scheduled  (request-only pages)
    prefill     cache_computed(): whole computed pages inserted into the tree; the request
                switches to the canonical page ids and its lock moves to the deeper node
    leaving     release(): cache_computed() once more, unlock, free the request-only tail

Cache keys come from :meth:`Request.cache_key`: by default the request's own token ids, in a
cache whose ``page_size`` is this manager's (the engine). A request may instead key each page by
one element (the fleet simulator keys a page by its block id), in a cache of ``page_size`` 1;
the manager counts matches in pages either way, so the two behave alike.

Lower tiers (optional ``tiers``, see :mod:`tokenmill.engine.kv_tiers`; duck-typed, so this
module stays torch-free and the simulator can plug in its own model): at admission the L1
match continues through pages that L2/L3 can supply; they are copied into fresh L1 pages and
inserted in the tree before the request's prefill. Newly computed pages are reported to the
tiers (write-through), and the radix tree's eviction hook demotes evicted pages.

Hybrid models (``slots``, a :class:`~tokenmill.cache.state_slots.StateSlotPool`): each running
request also owns one state slot (the recurrent and conv state of every linear-attention layer).
Admission takes a slot *and* pages (:meth:`take_slot` first, then :meth:`allocate`); whatever
makes a request leave (finish, abort, preemption, a failed admission) goes through
:meth:`release`, which gives back both. A prefix hit on a hybrid model would also have to
restore the linear layers' state at the end of the match; :meth:`_match_hybrid` is the hook that
decides it (today: no hit, so every request computes its state from position 0 and results are
exact).

Invariants (checked by :meth:`KVManager.check`):
``pool.num_free() + cache.num_cached_pages + sum(request-only pages) == pool.num_pages``;
with slots, every running request holds a distinct request slot that is not on the free list,
and ``slots.num_free() + running requests == slots.num_request_slots``.
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from tokenmill.cache.page_pool import PagePool
from tokenmill.engine.request import Request

if TYPE_CHECKING:
    from tokenmill.cache.radix import RadixCache
    from tokenmill.cache.state_slots import StateSlotPool


class KVManager:
    def __init__(self, pool: PagePool, page_size: int, cache: RadixCache | None = None,
                 tiers: Any = None, slots: StateSlotPool | None = None) -> None:
        if page_size <= 0:
            raise ValueError(f"page_size must be positive, got {page_size}")
        if tiers is not None and cache is None:
            raise ValueError("lower cache tiers need the prefix cache")
        if tiers is not None and slots is not None:
            raise ValueError("lower cache tiers do not hold the state of a hybrid model's linear layers")
        self.pool = pool
        self.page_size = page_size
        self.cache = cache
        self.tiers = tiers
        self.slots = slots
        # Whether admission may reuse cached pages: always for attention-only models; for hybrid
        # models only once a hit can restore the linear layers' state (see _match_hybrid).
        self.prefix_reuse = cache is not None and slots is None

    # -- capacity ------------------------------------------------------------------------------
    @property
    def num_pages(self) -> int:
        return self.pool.num_pages

    @property
    def capacity_tokens(self) -> int:
        return self.pool.num_pages * self.page_size

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def num_reclaimable_pages(self) -> int:
        """Pages free now or freeable by eviction (cached but locked by no request)."""
        evictable = self.cache.num_evictable_pages if self.cache is not None else 0
        return self.pool.num_free() + evictable

    def usage(self) -> float:
        """Share of the pool pinned by running requests (evictable cached pages count as free)."""
        return 1.0 - self.num_reclaimable_pages() / self.pool.num_pages

    def state_usage(self) -> float:
        """Share of the request state slots held by running requests (0 without a state pool)."""
        if self.slots is None:
            return 0.0
        return self.slots.num_used() / self.slots.num_request_slots

    # -- state slots (hybrid models) -------------------------------------------------------------
    def take_slot(self, req: Request) -> bool:
        """At admission: give ``req`` a request state slot (a no-op without a state pool).

        Returns False, changing nothing, when every slot is taken. The slot's old contents are
        never read: a request's first chunk starts at position 0 from a zero state.
        """
        if self.slots is None or req.state_slot is not None:
            return True
        slot = self.slots.alloc()
        if slot is None:
            return False
        req.state_slot = slot
        return True

    def _release_slot(self, req: Request) -> None:
        if req.state_slot is not None:
            assert self.slots is not None
            self.slots.free(req.state_slot)
            req.state_slot = None

    # -- request pages ---------------------------------------------------------------------------
    def match(self, req: Request) -> int:
        """At admission: reuse the longest cached whole-page prefix of ``req``'s tokens.

        Matches ``all_token_ids[:-1]`` so at least one token is left to compute (its logits give
        the next token). Locks the matched node; sets the page table and ``num_computed_tokens``.
        With lower tiers, the match continues through pages loaded from L2/L3 into L1.
        Returns the number of tokens matched (all tiers); on first admission also sets
        ``req.cached_tokens_by_tier``.
        A request asking for prompt logprobs matches nothing (its prompt rows must all be computed).
        """
        if self.cache is None or req.page_table or req.prompt_logprobs is not None:
            return 0
        if self.slots is not None:
            return self._match_hybrid(req)
        P = self.page_size
        per = self.cache.page_size   # key elements per page (P for the engine, 1 in the sim)
        max_pages = (req.num_tokens - 1) // P
        key = req.cache_key(max_pages * per)
        m = self.cache.match_prefix(key[:max_pages * per])
        pages = list(m.pages)
        node = m.node
        self.cache.lock(node)
        loaded = {"l2": 0, "l3": 0}
        if self.tiers is not None:
            plan = self.tiers.plan(req, len(pages), max_pages)
            if len(plan):
                fresh = self.pool.alloc(len(plan))
                if fresh is None:
                    self.cache.evict(len(plan) - self.pool.num_free())
                    fresh = self.pool.alloc(min(len(plan), self.pool.num_free()))
                if fresh:
                    loaded = self.tiers.load(plan, fresh)
                    k = loaded["l2"] + loaded["l3"]
                    self.pool.free(fresh[k:])
                    if k:
                        res = self.cache.insert(key[:(len(pages) + k) * per], pages + fresh[:k],
                                                session_id=req.session_id)
                        self.cache.lock(res.node)
                        self.cache.unlock(node)
                        node, pages = res.node, list(res.pages)
        if req.num_cached_tokens is None:
            # Pages an earlier, failed admission try loaded are L1 hits now; keep their tier.
            prev = req.cached_tokens_by_tier or {}
            carried = {t: prev.get(t, 0) // P for t in ("l2", "l3")}
            by_tier = {"l1": max(len(m.pages) - carried["l2"] - carried["l3"], 0),
                       "l2": carried["l2"] + loaded["l2"], "l3": carried["l3"] + loaded["l3"]}
            req.cached_tokens_by_tier = {t: n * P for t, n in by_tier.items()}
        if not pages:
            self.cache.unlock(node)
            req.page_table = []
            return 0
        req.cache_node = node
        req.page_table = pages
        req.num_tree_pages = len(pages)
        req.num_computed_tokens = len(pages) * P
        return len(pages) * P

    def _match_hybrid(self, req: Request) -> int:
        """The prefix hit of a hybrid model's request (the snapshot hook).

        A hit is usable only where the state of every linear layer at the end of the matched
        tokens can be restored into ``req.state_slot``. Until the cache holds such snapshots no
        hit is taken: the request is computed from position 0 (its first chunk starts from a
        zero state), so outputs are exactly those of an uncached run.
        """
        if req.num_cached_tokens is None:
            req.cached_tokens_by_tier = {"l1": 0, "l2": 0, "l3": 0}
        req.page_table = []
        return 0

    def admitted(self, req: Request) -> None:
        """``req`` was admitted for the first time: count its hits per tier."""
        if self.tiers is not None and req.cached_tokens_by_tier is not None:
            self.tiers.record_hits(req, {t: n // self.page_size for t, n in req.cached_tokens_by_tier.items()})

    def cached_prefix_tokens(self, req: Request) -> int:
        """Tokens :meth:`match` would reuse for ``req`` now: a probe that locks nothing and
        leaves cache recency alone (for cache-aware admission)."""
        if not self.prefix_reuse or req.page_table or req.prompt_logprobs is not None:
            return 0
        per_page = self.cache.page_size
        n = (req.num_tokens - 1) // self.page_size * per_page
        return self.cache.cached_prefix_length(req.cache_key(n), n) // per_page * self.page_size

    def allocate(self, req: Request, num_tokens: int) -> bool:
        """Grow ``req.page_table`` to hold ``num_tokens`` tokens, evicting cached pages if needed.

        All or nothing: returns False (and changes nothing) when the pages cannot be found.
        """
        need = self.pages_for(num_tokens) - len(req.page_table)
        if need <= 0:
            return True
        pages = self.pool.alloc(need)
        if pages is None and self.cache is not None:
            self.cache.evict(need - self.pool.num_free())
            pages = self.pool.alloc(need)
        if pages is None:
            return False
        req.page_table.extend(pages)
        return True

    def trim(self, req: Request, num_tokens: int) -> None:
        """Free ``req``'s request-only pages past the first ``num_tokens`` tokens.

        Used after speculative verification: rejected drafts' K/V sits past the request's
        new end. Pages shared with the tree are never freed here (they hold only computed,
        accepted tokens, since :meth:`cache_computed` inserts whole computed pages only).
        """
        keep = max(self.pages_for(num_tokens), req.num_tree_pages)
        if len(req.page_table) > keep:
            self.pool.free(req.page_table[keep:])
            del req.page_table[keep:]

    def cache_computed(self, req: Request) -> None:
        """Insert ``req``'s whole computed pages into the cache and adopt the canonical pages."""
        if self.cache is None:
            return
        full = req.num_computed_tokens // self.page_size
        if full <= req.num_tree_pages:
            return
        n = full * self.cache.page_size
        res = self.cache.insert(req.cache_key(n)[:n], req.page_table[:full], session_id=req.session_id)
        req.page_table[:full] = res.pages
        if self.tiers is not None:
            self.tiers.on_computed(req, req.num_tree_pages, full)
        self.cache.lock(res.node)
        if req.cache_node is not None:
            self.cache.unlock(req.cache_node)
        req.cache_node = res.node
        req.num_tree_pages = full

    def release(self, req: Request, *, keep_in_cache: bool = True) -> None:
        """``req`` leaves (finished, aborted or preempted): hand its pages and state slot back.

        With ``keep_in_cache`` its whole computed pages stay in the prefix cache (unlocked, so
        they become evictable); the rest go back to the pool.
        """
        self._release_slot(req)
        if keep_in_cache:
            self.cache_computed(req)
        if req.cache_node is not None:
            assert self.cache is not None
            self.cache.unlock(req.cache_node)
            req.cache_node = None
        self.pool.free(req.page_table[req.num_tree_pages:])
        req.page_table = []
        req.num_tree_pages = 0

    def session_finished(self, session_id: str | None) -> None:
        if self.cache is not None and session_id is not None:
            self.cache.session_finished(session_id)

    # -- whole cache -----------------------------------------------------------------------------
    def flush(self) -> None:
        """Drop every cached page of L1 and L2 (only valid while no request holds pages)."""
        if self.cache is not None:
            self.cache.reset()
        if self.tiers is not None:
            self.tiers.flush_host()

    def check(self, requests: Iterable[Request]) -> None:
        """Verify page (and state-slot) accounting; raise AssertionError naming the mismatch.

        ``requests`` are the running requests (the only ones that hold pages or slots)."""
        requests = list(requests)
        if self.slots is not None:
            self._check_slots(requests)
        request_only = sum(len(r.page_table) - r.num_tree_pages for r in requests)
        cached = 0
        if self.cache is not None:
            self.cache.check_invariants()
            cached = self.cache.num_cached_pages
        free = self.pool.num_free()
        if free + cached + request_only != self.pool.num_pages:
            raise AssertionError(
                f"page accounting broken: free {free} + cached {cached} + request-only "
                f"{request_only} != total {self.pool.num_pages}")

    def _check_slots(self, requests: list[Request]) -> None:
        assert self.slots is not None
        held = [r.state_slot for r in requests]
        if any(s is None for s in held):
            missing = next(r.request_id for r in requests if r.state_slot is None)
            raise AssertionError(f"state-slot accounting broken: running request {missing!r} holds no slot")
        if len(set(held)) != len(held):
            raise AssertionError(f"state-slot accounting broken: two running requests share a slot ({sorted(held)})")
        for slot in held:
            if not 0 <= slot < self.slots.num_request_slots or self.slots.is_free(slot):
                raise AssertionError(f"state-slot accounting broken: slot {slot} is held but not allocated")
        if self.slots.num_free() + len(held) != self.slots.num_request_slots:
            raise AssertionError(
                f"state-slot accounting broken: free {self.slots.num_free()} + held {len(held)} != "
                f"total {self.slots.num_request_slots}")
