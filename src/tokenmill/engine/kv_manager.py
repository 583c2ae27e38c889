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

Invariant (checked by :meth:`KVManager.check`):
``pool.num_free() + cache.num_cached_pages + sum(request-only pages) == pool.num_pages``.
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from tokenmill.cache.page_pool import PagePool
from tokenmill.engine.request import Request

if TYPE_CHECKING:
    from tokenmill.cache.radix import RadixCache


class KVManager:
    def __init__(self, pool: PagePool, page_size: int, cache: RadixCache | None = None) -> None:
        if page_size <= 0:
            raise ValueError(f"page_size must be positive, got {page_size}")
        self.pool = pool
        self.page_size = page_size
        self.cache = cache

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

    # -- request pages ---------------------------------------------------------------------------
    def match(self, req: Request) -> int:
        """At admission: reuse the longest cached whole-page prefix of ``req``'s tokens.

        Matches ``all_token_ids[:-1]`` so at least one token is left to compute (its logits give
        the next token). Locks the matched node; sets the page table and ``num_computed_tokens``.
        Returns the number of tokens matched.
        """
        if self.cache is None or req.page_table:
            return 0
        m = self.cache.match_prefix(req.all_token_ids[:-1])
        if m.num_tokens == 0:
            return 0
        self.cache.lock(m.node)
        req.cache_node = m.node
        req.page_table = list(m.pages)
        req.num_tree_pages = len(m.pages)
        req.num_computed_tokens = m.num_tokens
        return m.num_tokens

    def cached_prefix_tokens(self, req: Request) -> int:
        """Tokens :meth:`match` would reuse for ``req`` now: a probe that locks nothing and
        leaves cache recency alone (for cache-aware admission)."""
        if self.cache is None or req.page_table:
            return 0
        return self.cache.cached_prefix_length(req.all_token_ids, req.num_tokens - 1)

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

    def cache_computed(self, req: Request) -> None:
        """Insert ``req``'s whole computed pages into the cache and adopt the canonical pages."""
        if self.cache is None:
            return
        full = req.num_computed_tokens // self.page_size
        if full <= req.num_tree_pages:
            return
        res = self.cache.insert(req.all_token_ids[: full * self.page_size], req.page_table[:full],
                                session_id=req.session_id)
        req.page_table[:full] = res.pages
        self.cache.lock(res.node)
        if req.cache_node is not None:
            self.cache.unlock(req.cache_node)
        req.cache_node = res.node
        req.num_tree_pages = full

    def release(self, req: Request, *, keep_in_cache: bool = True) -> None:
        """``req`` leaves (finished, aborted or preempted): hand its pages back.

        With ``keep_in_cache`` its whole computed pages stay in the prefix cache (unlocked, so
        they become evictable); the rest go back to the pool.
        """
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
        """Drop every cached page (only valid while no request holds pages)."""
        if self.cache is not None:
            self.cache.reset()

    def check(self, requests: Iterable[Request]) -> None:
        """Verify page accounting; raise AssertionError naming the mismatch."""
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
