"""Unit tests of state snapshots in the radix cache (hybrid models): match ends at snapshots,
fallback when one is dropped, their own LRU and budget, eviction of pages dropping snapshots,
locks, and accounting."""
from __future__ import annotations

import pytest

from tokenmill.cache.page_pool import PagePool
from tokenmill.cache.radix import RadixCache
from tokenmill.cache.state_slots import StateSlotPool

P = 4


def make(num_pages: int = 32, num_snapshots: int = 3):
    pool = PagePool(num_pages)
    slots = StateSlotPool(2, num_snapshots)   # request slots 0..1, snapshot slots from 2
    cache = RadixCache(pool, P, snapshot_slots=slots)
    return pool, slots, cache


def put(pool: PagePool, cache: RadixCache, tokens: list[int]):
    n = len(tokens) // P
    own = pool.alloc(n)
    assert own is not None
    res = cache.insert(tokens, own)
    cache.check_invariants()
    return res


def test_match_ends_at_the_deepest_snapshot() -> None:
    pool, slots, cache = make()
    seq = list(range(20))                         # 5 pages
    res = put(pool, cache, seq)
    assert cache.match_prefix(seq).num_tokens == 0     # pages but no snapshot: no match
    assert cache.cached_prefix_length(seq) == 0
    s8 = cache.add_snapshot(seq[:8])
    assert s8 is not None and s8 >= slots.num_request_slots   # a snapshot slot, not a request slot
    s16 = cache.add_snapshot(seq[:16])
    cache.check_invariants()
    m = cache.match_prefix(seq)
    assert (m.num_tokens, m.snapshot, m.pages) == (16, s16, res.pages[:4])
    assert cache.cached_prefix_length(seq) == 16
    m = cache.match_prefix(seq[:15])               # stops short of the 16 snapshot
    assert (m.num_tokens, m.snapshot) == (8, s8)
    assert cache.cached_prefix_length(seq[:15]) == 8
    # Divergence after page 3: the 16 snapshot is on the other branch.
    m = cache.match_prefix(seq[:12] + [99, 99, 99, 99])
    assert (m.num_tokens, m.snapshot) == (8, s8)
    assert cache.add_snapshot(seq[:8]) is None       # already there: nothing to copy
    assert cache.add_snapshot(seq[:4] + [7, 7, 7, 7]) is None   # not cached: nothing to copy
    with pytest.raises(ValueError):
        cache.add_snapshot(seq[:6])                   # not on a page boundary
    cache.check_invariants()


def test_dropping_a_snapshot_falls_back_to_an_earlier_one() -> None:
    pool, slots, cache = make()
    seq = list(range(20))
    put(pool, cache, seq)
    s4 = cache.add_snapshot(seq[:4])
    s12 = cache.add_snapshot(seq[:12])
    assert cache.match_prefix(seq).snapshot == s12
    assert cache.drop_snapshot(s12)
    assert not cache.drop_snapshot(s12)
    assert slots.num_free_snapshots() == 2
    m = cache.match_prefix(seq)
    assert (m.num_tokens, m.snapshot) == (4, s4)
    assert cache.num_cached_pages == 5           # pages untouched
    cache.check_invariants()


def test_snapshot_lru_and_budget_apart_from_pages() -> None:
    pool, slots, cache = make(num_snapshots=2)
    a, b, c = [1] * 8, [2] * 8, [3] * 8
    for seq in (a, b, c):
        put(pool, cache, seq)
    sa = cache.add_snapshot(a)
    sb = cache.add_snapshot(b)
    assert cache.match_prefix(a).snapshot == sa   # a is now the most recent snapshot
    sc = cache.add_snapshot(c)                    # budget full: b (LRU) gives up its slot
    assert sc == sb
    assert cache.match_prefix(b).num_tokens == 0
    assert cache.match_prefix(a).snapshot == sa and cache.match_prefix(c).snapshot == sc
    assert cache.num_cached_pages == 6           # no page evicted for a snapshot
    assert cache.evict_snapshots(5) == 2
    assert cache.num_snapshots == 0 and slots.num_free_snapshots() == 2
    cache.check_invariants()


def test_page_eviction_drops_snapshots_and_returns_slots() -> None:
    pool, slots, cache = make(num_snapshots=3)
    seq = list(range(16))
    put(pool, cache, seq)
    s8 = cache.add_snapshot(seq[:8])
    s16 = cache.add_snapshot(seq)
    assert cache.evict(1) == 1                   # the tail page goes: the 16 snapshot with it
    assert not cache.has_snapshot(s16) and cache.has_snapshot(s8)
    assert slots.num_free_snapshots() == 2
    assert cache.match_prefix(seq).snapshot == s8
    cache.check_invariants()
    assert cache.evict(10) == 3
    assert cache.num_snapshots == 0 and slots.num_free_snapshots() == 3
    cache.check_invariants()


def test_locked_snapshot_survives_lru_and_pins_its_path() -> None:
    pool, slots, cache = make(num_snapshots=1)
    a, b = [1] * 8, [2] * 8
    put(pool, cache, a)
    put(pool, cache, b)
    sa = cache.add_snapshot(a)
    m = cache.match_prefix(a)
    cache.lock_snapshot(m.snapshot)
    assert cache.num_locked_snapshots == 1 and cache.num_locked_pages == 2
    assert cache.add_snapshot(b) is None          # the only slot is locked
    assert cache.evict_snapshots(1) == 0 and not cache.drop_snapshot(sa)
    assert cache.evict(10) == 2                   # only b's pages are evictable
    assert cache.has_snapshot(sa)
    with pytest.raises(RuntimeError):
        cache.reset()
    cache.check_invariants()
    cache.unlock_snapshot(sa)
    with pytest.raises(ValueError):
        cache.unlock_snapshot(sa)
    with pytest.raises(ValueError):
        cache.lock_snapshot(99)
    cache.reset()
    assert cache.num_snapshots == 0 and slots.num_free_snapshots() == 1 and pool.num_free() == 32
    cache.check_invariants()


def test_zero_snapshot_budget_never_matches_and_dense_cache_is_unchanged() -> None:
    pool, slots, cache = make(num_snapshots=0)
    seq = list(range(12))
    put(pool, cache, seq)
    assert cache.add_snapshot(seq) is None
    assert cache.match_prefix(seq).num_tokens == 0
    dense = RadixCache(PagePool(8), P)
    dense.insert(seq, dense.pool.alloc(3))
    m = dense.match_prefix(seq)
    assert (m.num_tokens, m.snapshot) == (12, None)
    assert dense.add_snapshot(seq) is None and not dense.uses_snapshots
    dense.check_invariants()


def test_check_invariants_catches_snapshot_leaks() -> None:
    pool, slots, cache = make()
    seq = list(range(8))
    put(pool, cache, seq)
    cache.add_snapshot(seq)
    slots.alloc_snapshot()                       # a slot taken behind the tree's back
    with pytest.raises(AssertionError, match="snapshot accounting"):
        cache.check_invariants()


def test_snapshots_of_a_retained_session_are_evicted_last() -> None:
    now = [0.0]
    pool, slots = PagePool(32), StateSlotPool(1, 2)
    cache = RadixCache(pool, P, session_retention_s=10.0, clock=lambda: now[0], snapshot_slots=slots)
    a, b, c = [1] * 8, [2] * 8, [3] * 8
    cache.insert(a, pool.alloc(2), session_id="s")
    cache.insert(b, pool.alloc(2))
    cache.insert(c, pool.alloc(2))
    sa = cache.add_snapshot(a)                   # oldest, but its session is retained
    sb = cache.add_snapshot(b)
    cache.session_finished("s")
    assert cache.add_snapshot(c) == sb           # b goes first although a is older
    assert cache.has_snapshot(sa)
    now[0] = 11.0                                # the window closed: plain LRU again
    assert cache.add_snapshot(b) == sa
    cache.check_invariants()
