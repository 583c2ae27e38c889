"""Unit tests of the radix cache: matching, splits, duplicates, LRU order, session retention."""
from __future__ import annotations

import pytest

from tokenmill.cache.page_pool import PagePool
from tokenmill.cache.radix import RadixCache


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def make(num_pages: int = 32, page_size: int = 4, retention: float = 10.0):
    pool = PagePool(num_pages)
    clock = Clock()
    cache = RadixCache(pool, page_size, session_retention_s=retention, clock=clock)
    return pool, cache, clock


def put(pool: PagePool, cache: RadixCache, tokens: list[int], session: str | None = None):
    """Insert ``tokens`` as a finished request would: reuse cached pages, allocate the rest."""
    m = cache.match_prefix(tokens)
    n = len(tokens) // cache.page_size
    own = pool.alloc(n - len(m.pages))
    assert own is not None
    res = cache.insert(tokens, m.pages + own, session_id=session)
    cache.check_invariants()
    return res


def test_match_whole_pages_only_and_split() -> None:
    pool, cache, _ = make()
    res = put(pool, cache, list(range(12)))          # 3 pages
    assert res.num_new_tokens == 12 and len(res.pages) == 3
    assert cache.match_prefix(list(range(11))).num_tokens == 8   # partial 3rd page: no
    assert cache.match_prefix(list(range(3))).num_tokens == 0
    m = cache.match_prefix([0, 1, 2, 3, 4, 5, 6, 7, 99, 9, 10, 11])
    assert m.num_tokens == 8 and m.pages == res.pages[:2]
    assert cache.num_nodes == 2    # the edge was split at the page boundary
    # A diverging branch shares the first two pages.
    res2 = put(pool, cache, [0, 1, 2, 3, 4, 5, 6, 7, 50, 51, 52, 53])
    assert res2.num_new_tokens == 4 and res2.pages[:2] == res.pages[:2]
    assert cache.num_cached_pages == 4
    cache.check_invariants()


def test_insert_truncates_and_frees_duplicates() -> None:
    pool, cache, _ = make(num_pages=8)
    first = pool.alloc(2)
    cache.insert(list(range(10)), first + [7])   # 2 whole pages; page 7 stays with the caller
    assert cache.num_cached_pages == 2
    dup = pool.alloc(3)                            # a second request computed the same pages
    free_before = pool.num_free()
    res = cache.insert(list(range(12)), dup)
    assert res.pages[:2] == first and res.pages[2] == dup[2]
    assert res.num_new_tokens == 4
    assert pool.is_free(dup[0]) and pool.is_free(dup[1])
    assert pool.num_free() == free_before + 2
    with pytest.raises(ValueError):
        cache.insert(list(range(8)), [1])          # too few page ids
    cache.check_invariants()


def test_lock_protects_path_and_unlock_errors() -> None:
    pool, cache, _ = make(num_pages=6)
    put(pool, cache, list(range(8)))
    m = cache.match_prefix(list(range(8)))
    cache.lock(m.node)
    assert cache.num_locked_pages == 2 and cache.num_evictable_pages == 0
    assert cache.evict(5) == 0                     # never raises, frees nothing locked
    # Inserting below a locked path is fine; the new part is evictable.
    put(pool, cache, list(range(16)))
    assert cache.num_evictable_pages == 2
    assert cache.evict(10) == 2
    assert cache.match_prefix(list(range(16))).num_tokens == 8
    with pytest.raises(RuntimeError):
        cache.reset()
    cache.unlock(m.node)
    with pytest.raises(ValueError):
        cache.unlock(m.node)
    assert cache.evict(10) == 2
    with pytest.raises(ValueError):
        cache.lock(m.node)                         # evicted nodes cannot be pinned
    assert pool.num_free() == 6
    cache.check_invariants()


def test_lru_order_and_partial_leaf_eviction() -> None:
    pool, cache, _ = make(num_pages=32)
    a, b, c = [1] * 12, [2] * 12, [3] * 12
    for t in (a, b, c):
        put(pool, cache, t)
    cache.match_prefix(a)                          # a is now the most recent
    assert cache.evict(2) == 2                     # tail of b, the oldest
    assert cache.match_prefix(b).num_tokens == 4
    assert cache.match_prefix(c).num_tokens == 12
    assert cache.match_prefix(a).num_tokens == 12
    # b was touched by the matches above; order is now c (oldest), b, a.
    cache.match_prefix(b)
    cache.match_prefix(a)
    assert cache.evict(3) == 3                     # all of c
    assert cache.match_prefix(c).num_tokens == 0
    assert cache.match_prefix(b, touch=False).num_tokens == 4
    assert cache.evict(1) == 1                     # then b
    assert cache.match_prefix(b, touch=False).num_tokens == 0
    assert cache.match_prefix(a, touch=False).num_tokens == 12
    cache.check_invariants()


def test_touch_false_does_not_refresh() -> None:
    pool, cache, _ = make()
    put(pool, cache, [1] * 4)
    put(pool, cache, [2] * 4)
    cache.match_prefix([1] * 4, touch=False)
    cache.evict(1)
    assert cache.match_prefix([1] * 4).num_tokens == 0
    assert cache.match_prefix([2] * 4).num_tokens == 4


def test_retained_session_outlives_newer_one_off_requests() -> None:
    pool, cache, clock = make(num_pages=40, retention=10.0)
    convo = [7] * 16
    put(pool, cache, convo, session="agent")
    cache.session_finished("agent")
    assert cache.is_session_retained("agent")
    clock.now += 5.0                               # the tool call takes 5 s
    for i in range(6):                             # a flood of newer one-off requests
        put(pool, cache, [100 + i] * 8)
        cache.evict(2)                             # the pool is under pressure
    assert cache.match_prefix(convo, touch=False).num_tokens == 16
    assert cache.num_cached_pages == 4             # every one-off request went first
    clock.now += 6.0                               # past the window: plain LRU again
    put(pool, cache, [200] * 8)
    assert cache.evict(1) == 1
    assert cache.match_prefix(convo, touch=False).num_tokens == 12
    cache.check_invariants()


def test_retention_order_then_expiry() -> None:
    pool, cache, clock = make(num_pages=40, retention=10.0)
    put(pool, cache, [1] * 8, session="old")       # oldest, retained
    put(pool, cache, [2] * 8)                      # no session
    put(pool, cache, [3] * 8, session="live")      # session still running (no finish yet)
    cache.session_finished("old")
    # Tier 1 first: the un-retained pages go before the retained, even though they are newer.
    assert cache.evict(4) == 4
    assert cache.match_prefix([1] * 8, touch=False).num_tokens == 8
    assert cache.match_prefix([2] * 8, touch=False).num_tokens == 0
    assert cache.match_prefix([3] * 8, touch=False).num_tokens == 0
    # With nothing else left, retained pages are evicted too (oldest first), never raising.
    put(pool, cache, [4] * 8, session="s4")
    put(pool, cache, [5] * 8, session="s5")
    cache.session_finished("s5")
    cache.session_finished("s4")
    assert cache.evict(2) == 2                     # s4 and s5 retained; [1]* is the oldest
    assert cache.match_prefix([1] * 8, touch=False).num_tokens == 0
    # After the window closes, the ordering is plain LRU again.
    clock.now += 11.0
    cache.match_prefix([4] * 8)
    assert cache.evict(2) == 2
    assert cache.match_prefix([5] * 8, touch=False).num_tokens == 0
    assert cache.match_prefix([4] * 8, touch=False).num_tokens == 8
    cache.check_invariants()


def test_shared_node_protected_while_any_session_retained() -> None:
    pool, cache, clock = make(num_pages=40, retention=10.0)
    system = [9] * 8
    put(pool, cache, system + [1] * 4, session="a")
    put(pool, cache, system + [2] * 4, session="b")
    put(pool, cache, [3] * 8)
    cache.session_finished("a")
    clock.now += 6.0
    cache.session_finished("b")
    clock.now += 6.0                               # a expired, b still retained
    assert cache.evict(3) == 3                     # [3]* (unprotected) then a's own leaf
    assert cache.match_prefix(system + [1] * 4, touch=False).num_tokens == 8
    assert cache.match_prefix(system + [2] * 4, touch=False).num_tokens == 12
    cache.check_invariants()


def test_a_leaf_set_aside_while_protected_is_evicted_in_lru_order_once_its_window_closes() -> None:
    pool, cache, clock = make(num_pages=40, retention=10.0)
    put(pool, cache, [1] * 8, session="a")         # oldest
    put(pool, cache, [2] * 8)
    cache.session_finished("a")
    assert cache.evict(2) == 2                     # [2]* goes; a's leaf is protected: set aside
    assert cache.match_prefix([1] * 8, touch=False).num_tokens == 8
    put(pool, cache, [3] * 8)                      # newer, unprotected
    put(pool, cache, [4] * 8, session="b")
    cache.session_finished("b")                    # b protected until now + 10
    clock.now += 11.0                              # a's window has closed, b's too
    assert cache.evict(2) == 2                     # the oldest leaf again: a's, not [3]*
    assert cache.match_prefix([1] * 8, touch=False).num_tokens == 0
    assert cache.match_prefix([3] * 8, touch=False).num_tokens == 8
    cache.session_finished("b")                    # b protected again (a fresh window)
    assert cache.evict(2) == 2                     # [3]* before the protected [4]*
    assert cache.match_prefix([3] * 8, touch=False).num_tokens == 0
    assert cache.evict(2) == 2                     # tier 2: protected [4]* when nothing else is left
    assert cache.num_cached_pages == 0
    cache.check_invariants()


def test_zero_retention_disables_windows() -> None:
    pool, cache, _ = make(retention=0.0)
    put(pool, cache, [1] * 4, session="a")
    cache.session_finished("a")
    assert not cache.is_session_retained("a")
    put(pool, cache, [2] * 4)
    assert cache.evict(1) == 1
    assert cache.match_prefix([1] * 4).num_tokens == 0


def test_reset_frees_everything() -> None:
    pool, cache, _ = make(num_pages=16)
    put(pool, cache, list(range(20)))
    put(pool, cache, list(range(8)) + [5] * 8)
    assert cache.num_cached_pages == 7
    cache.reset()
    assert cache.num_cached_pages == 0 and pool.num_free() == 16
    assert cache.match_prefix(list(range(20))).num_tokens == 0
    cache.check_invariants()


def test_check_invariants_detects_corruption() -> None:
    pool, cache, _ = make()
    put(pool, cache, list(range(8)))
    node = cache.match_prefix(list(range(8))).node
    pool.free([node.pages[0]])                     # someone freed a cached page
    with pytest.raises(AssertionError):
        cache.check_invariants()


def test_bad_arguments() -> None:
    with pytest.raises(ValueError):
        RadixCache(PagePool(4), 0)
    with pytest.raises(ValueError):
        RadixCache(PagePool(4), 4, session_retention_s=-1)


def test_prefix_length_probe_agrees_with_match_and_changes_nothing() -> None:
    import random

    rng = random.Random(5)
    pool, cache, _ = make(num_pages=400, page_size=4)
    base = [rng.randrange(6) for _ in range(40)]
    for _ in range(25):   # branching sequences with shared prefixes of every length
        cut = rng.randrange(len(base))
        put(pool, cache, base[:cut] + [rng.randrange(6) for _ in range(rng.randrange(1, 30))])
    for _ in range(200):
        cut = rng.randrange(len(base) + 1)
        probe = base[:cut] + [rng.randrange(6) for _ in range(rng.randrange(0, 20))]
        limit = rng.choice([None, rng.randrange(len(probe) + 1)])
        nodes, pages = cache.num_nodes, cache.num_cached_pages
        got = cache.cached_prefix_length(probe, limit)
        assert (cache.num_nodes, cache.num_cached_pages) == (nodes, pages)   # no split
        want = cache.match_prefix(probe if limit is None else probe[:limit], touch=False).num_tokens
        assert got == want
    cache.check_invariants()
