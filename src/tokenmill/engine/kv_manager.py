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
:meth:`release`, which gives back both.

Prefix hits of a hybrid model (the cache has ``snapshot_slots``): the tree also holds state
snapshots, slots of the same state pool holding the linear layers' state after a page-aligned
prefix, and a match ends only at one (:meth:`_match_hybrid`). The snapshot is locked and named in
``req.snapshot_restore``; the model runner copies it into the request's slot before the
request's first step, after which :meth:`after_step` unlocks it. Computation then continues from
the snapshot's position, exactly as if the prefix had been computed. Snapshots are taken in
:meth:`after_step` by copying the request's slot (``copy_state``, set by the engine) right after
a step whose computed tokens end on a page boundary:

* every ``snapshot_interval`` tokens (the scheduler cuts prefill chunks there, :meth:`chunk_limit`);
* at a *branch point*: where a request's cached pages run further than its snapshot match (the
  prompt diverges from a cached one there), the request's chunk is cut at the end of those pages
  and the state there is kept, so the next request sharing that prefix hits all of it;
* at the request's latest page boundary (decodes crossing one; the prefill is cut at the
  prompt's last one when ``max_tokens`` cannot reach the next): the request keeps one such
  *tail* snapshot, replaced as it advances, so when it leaves (finished, aborted or preempted)
  the tree holds the state at the last page boundary of its prompt + output; turn 2 of a
  session hits turn 1's prompt + output there.

With lower tiers, a hybrid match continues past the L1 pages through L2/L3 pages and ends at the
deepest boundary whose snapshot a tier holds (:meth:`_match_hybrid_tiers`): the pages are loaded
and inserted, the snapshot is written into a new snapshot slot of the tree there and restored
from it as an L1 snapshot would be. Snapshots taken are reported to the tiers (write-through).

Invariants (checked by :meth:`KVManager.check`):
``pool.num_free() + cache.num_cached_pages + sum(request-only pages) == pool.num_pages``;
with slots, every running request holds a distinct request slot that is not on the free list,
and ``slots.num_free() + running requests == slots.num_request_slots``; with snapshots, the tree's
snapshot accounting holds (``RadixCache.check_invariants``) and its locked snapshots are exactly
the pending restores of running requests.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from tokenmill.cache.page_pool import PagePool
from tokenmill.engine.request import Request

if TYPE_CHECKING:
    from tokenmill.cache.radix import RadixCache
    from tokenmill.cache.state_slots import StateSlotPool


class KVManager:
    def __init__(self, pool: PagePool, page_size: int, cache: RadixCache | None = None,
                 tiers: Any = None, slots: StateSlotPool | None = None,
                 snapshot_interval: int = 0) -> None:
        if page_size <= 0:
            raise ValueError(f"page_size must be positive, got {page_size}")
        if tiers is not None and cache is None:
            raise ValueError("lower cache tiers need the prefix cache")
        self.pool = pool
        self.page_size = page_size
        self.cache = cache
        self.tiers = tiers
        self.slots = slots
        if cache is not None and slots is not None and not cache.uses_snapshots:
            raise ValueError("a hybrid model's prefix cache needs snapshot_slots (its matches end at "
                             "state snapshots)")
        if snapshot_interval < 0 or snapshot_interval % page_size:
            raise ValueError(f"snapshot_interval must be 0 or a multiple of page_size {page_size}, "
                             f"got {snapshot_interval}")
        self.snapshot_interval = snapshot_interval
        # Whether admission may reuse cached pages (a hybrid model's hits end at snapshots).
        self.prefix_reuse = cache is not None
        # Hybrid models: copy_state(src_slot, dst_slot) copies every linear layer's state; the
        # engine sets it to the model runner's StatePool.copy (None: no snapshot is taken).
        self.copy_state: Callable[[int, int], None] | None = None
        self.num_snapshots_taken = 0
        self.num_snapshot_hits = 0

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
        """The prefix hit of a hybrid model's request: up to the deepest cached snapshot.

        The snapshot is locked (with its path) until the model runner has restored it into
        ``req.state_slot`` (``req.snapshot_restore``); with no snapshot on the path the request
        is computed from position 0 (a zero state). Where the cached pages run further than the
        snapshot, that branch point joins ``req.snapshot_cuts`` (positions to snapshot at).
        """
        assert self.cache is not None
        P = self.page_size
        per = self.cache.page_size
        max_pages = (req.num_tokens - 1) // P
        key = req.cache_key(max_pages * per)[:max_pages * per]
        m = self.cache.match_prefix(key)
        node, pages, snapshot = m.node, list(m.pages), m.snapshot
        by_tier = {"l1": len(pages) * P, "l2": 0, "l3": 0}
        if self.tiers is not None:
            hit = self._match_hybrid_tiers(req, key, len(pages), max_pages)
            if hit is not None:
                node, pages, snapshot, by_tier = hit
        paged = self.cache.page_prefix_length(key) // per * P
        req.snapshot_cuts = [paged] if paged > len(pages) * P else []
        if req.num_cached_tokens is None:
            req.cached_tokens_by_tier = by_tier
        if snapshot is None:
            req.page_table = []
            return 0
        self.cache.lock(node)
        self.cache.lock_snapshot(snapshot)
        req.snapshot_restore = snapshot
        req.cache_node = node
        req.page_table = pages
        req.num_tree_pages = len(pages)
        req.num_computed_tokens = len(pages) * P
        self.num_snapshot_hits += 1
        return req.num_computed_tokens

    def _match_hybrid_tiers(self, req: Request, key: list[Any], snap_pages: int,
                            max_pages: int) -> tuple[Any, list[int], int, dict[str, int]] | None:
        """Continue a hybrid model's L1 match through L2/L3 to a snapshot a lower tier holds.

        Every cached L1 page counts (the L1 snapshot may sit earlier or be gone); the lower tiers
        add pages after them and a snapshot at the deepest boundary they can; the pages are loaded
        into fresh L1 pages and inserted, and the snapshot is written into a new snapshot slot of
        the tree at that boundary. Returns (node, pages, snapshot slot, tokens by tier), with
        nothing locked, or None when no lower tier improves on ``snap_pages`` (the L1 hit)."""
        cache = self.cache
        assert cache is not None
        P = self.page_size
        per = cache.page_size
        pm = cache.match_prefix(key, ignore_snapshots=True)
        node, pages = pm.node, list(pm.pages)
        cache.lock(node)
        try:
            l1 = len(pages)
            plan = self.tiers.plan_hybrid(req, l1, snap_pages, max_pages)
            b = plan.boundary
            if b <= snap_pages:
                return None
            need = len(plan.pages)
            loaded = {"l2": 0, "l3": 0}
            if need:
                fresh = self.pool.alloc(need)
                if fresh is None:
                    cache.evict(need - self.pool.num_free())
                    fresh = self.pool.alloc(need)
                if fresh is None:
                    return None
                loaded = self.tiers.load(plan.pages, fresh)
                k = loaded["l2"] + loaded["l3"]
                self.pool.free(fresh[k:])
                if k:   # pages that did arrive are kept in L1 either way
                    res = cache.insert(key[:(l1 + k) * per], pages + fresh[:k], session_id=req.session_id)
                    cache.lock(res.node)
                    cache.unlock(node)
                    node, pages = res.node, list(res.pages)
                if k < need:
                    return None
            else:   # the snapshot sits inside the L1 pages: find (split) the node ending there
                res = cache.insert(key[:b * per], pages[:b], session_id=req.session_id)
                cache.lock(res.node)
                cache.unlock(node)
                node, pages = res.node, list(res.pages)
            slot = cache.add_snapshot(key[:b * per])
            if slot is None:
                return None
            self.tiers.restore_snapshot(plan, slot)
            return node, pages[:b], slot, {"l1": min(l1, b) * P, "l2": loaded["l2"] * P,
                                          "l3": loaded["l3"] * P}
        finally:
            cache.unlock(node)

    def chunk_limit(self, req: Request, num_tokens: int) -> int:
        """A prefill chunk of ``num_tokens`` from ``req.num_computed_tokens``, cut (hybrid models)
        at the next snapshot point: the next multiple of ``snapshot_interval``, a branch point, or
        the last page boundary of the request's tokens when its ``max_tokens`` cannot take decoding
        to the next one (so the state at the end of its prompt + output is still kept; the rest
        of the chunk is under a page). A request that may decode past the next boundary gets its
        tail snapshot there instead, and its prefill is not cut."""
        if self.slots is None or self.cache is None or num_tokens <= 1:
            return num_tokens
        P = self.page_size
        start = req.num_computed_tokens
        end = start + num_tokens
        n = req.num_tokens
        last = n // P * P
        if start < last < end and n + req.params.max_tokens - req.num_output_tokens - 1 < last + P:
            end = last
        if self.snapshot_interval:
            nxt = (start // self.snapshot_interval + 1) * self.snapshot_interval
            if nxt < end:
                end = nxt
        for cut in req.snapshot_cuts:
            if start < cut < end:
                end = cut
        return end - start

    def max_drafts(self, req: Request, k: int) -> int:
        """At most ``k`` drafts for decoding ``req`` (one uncomputed token), fewer for a hybrid
        model with snapshots so that the step cannot carry its computed tokens past the next
        page boundary: every boundary a request reaches is then the end of some step, where
        :meth:`after_step` snapshots the state (drafts accepted up to exactly the boundary
        included)."""
        if self.slots is None or self.cache is None or not self.cache.uses_snapshots:
            return k
        P = self.page_size
        nxt = (req.num_computed_tokens // P + 1) * P
        return max(0, min(k, nxt - req.num_tokens))

    def request_snapshot(self, req: Request, num_tokens: int) -> None:
        """Have running ``req`` snapshot its state after ``num_tokens`` tokens (a page boundary it
        has not computed yet); the scheduler asks for it where a waiting request shares ``req``'s
        prompt up to there. A no-op for attention-only models."""
        if (self.slots is None or self.cache is None or num_tokens % self.page_size
                or num_tokens <= req.num_computed_tokens or num_tokens in req.snapshot_cuts):
            return
        req.snapshot_cuts.append(num_tokens)

    def after_step(self, req: Request) -> None:
        """A hybrid model's request after a step (``num_computed_tokens`` updated): the restore
        is done, and when the computed tokens end on a page boundary the state is snapshotted."""
        cache = self.cache
        if self.slots is None or cache is None:
            return
        if req.snapshot_restore is not None:
            cache.unlock_snapshot(req.snapshot_restore)
            req.snapshot_restore = None
        p = req.num_computed_tokens
        P = self.page_size
        if p == 0 or p % P or self.copy_state is None or req.state_slot is None:
            return
        self.cache_computed(req)                      # the pages up to p join the tree first
        per = cache.page_size
        n = p // P * per
        slot = cache.add_snapshot(req.cache_key(n)[:n])
        if slot is not None:
            self.copy_state(req.state_slot, slot)
            self.num_snapshots_taken += 1
            if self.tiers is not None:
                self.tiers.on_snapshot(req, p // P, slot)
        cuts = req.snapshot_cuts
        at_cut = p in cuts
        if cuts:
            req.snapshot_cuts = [c for c in cuts if c > p]
        if (self.snapshot_interval and p % self.snapshot_interval == 0) or at_cut:
            return                                    # kept for others: not the request's tail
        tail = req.tail_snapshot
        if tail is not None and cache.snapshot(tail.slot) is tail:
            cache.drop_snapshot(tail.slot)            # superseded by the one at p (unless locked)
        req.tail_snapshot = cache.snapshot(slot) if slot is not None else None

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
        if req.snapshot_restore is not None:          # left before its first step
            assert self.cache is not None
            self.cache.unlock_snapshot(req.snapshot_restore)
            req.snapshot_restore = None
        req.tail_snapshot = None                      # stays in the tree as an ordinary snapshot
        req.snapshot_cuts = []
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
            if self.cache is not None:
                self._check_restores(requests)
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

    def _check_restores(self, requests: list[Request]) -> None:
        """The tree's snapshot locks are exactly the running requests' pending restores."""
        assert self.cache is not None
        want: dict[int, int] = {}
        for r in requests:
            if r.snapshot_restore is not None:
                want[r.snapshot_restore] = want.get(r.snapshot_restore, 0) + 1
        for slot, n in want.items():
            snap = self.cache.snapshot(slot)
            if snap is None or snap.lock_ref != n:
                raise AssertionError(f"snapshot accounting broken: slot {slot} is being restored by {n} "
                                     f"requests but holds {snap.lock_ref if snap else 'no snapshot'} locks")
        if len(want) != self.cache.num_locked_snapshots:
            raise AssertionError(f"snapshot accounting broken: {self.cache.num_locked_snapshots} locked "
                                 f"snapshots but {len(want)} being restored")

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
