"""Property tests: the radix cache alone against a plain model of prefix -> page.

The model is a dict from page-aligned token-tuple prefixes to page ids, with a lock count, a
recency tick and a session set per prefix. Requests run the engine's life cycle (match and lock
at admission, allocate pages for the rest, insert completed pages as prefill goes, insert
everything at finish and release the rest). After every step the tree's invariants hold, the
tree agrees with the model, and every page is accounted for.

:class:`SnapshotRadixMachine` runs the same life cycle on a hybrid model's cache: the model adds
a dict from prefix to snapshot slot with its own recency and locks; matches end at the deepest
snapshot, snapshots are added, dropped, evicted (LRU, apart from pages), locked, and go with
the pages they sit on; every snapshot slot is accounted for.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (RuleBasedStateMachine, initialize, invariant, precondition,
                                 rule)

from tokenmill.cache.page_pool import PagePool
from tokenmill.cache.radix import InsertResult, RadixCache, RadixNode
from tokenmill.cache.state_slots import StateSlotPool

SESSIONS = st.sampled_from([None, "s1", "s2", "s3"])
# A 3-letter alphabet and short sequences make shared prefixes, splits and divergences common.
TOKENS = st.lists(st.integers(0, 2), min_size=1, max_size=14)
RETENTION = 5.0


@dataclass
class Req:
    tokens: tuple[int, ...]
    pages: list[int]
    node: RadixNode
    locked: list[tuple[int, ...]]   # model prefixes pinned by this request
    held: set[int] = field(default_factory=set)  # pages owned by the request, not the tree
    session: str | None = None
    inserted_pages: int = 0


class RadixMachine(RuleBasedStateMachine):
    @initialize(page_size=st.sampled_from([1, 2, 3]), num_pages=st.integers(3, 24))
    def setup(self, page_size: int, num_pages: int) -> None:
        self._setup(page_size, num_pages, None)

    def _setup(self, page_size: int, num_pages: int, num_snapshots: int | None) -> None:
        self.P = page_size
        self.now = 0.0
        self.pool = PagePool(num_pages)
        self.slots = StateSlotPool(1, num_snapshots) if num_snapshots is not None else None
        self.cache = RadixCache(self.pool, page_size, session_retention_s=RETENTION,
                                clock=lambda: self.now, snapshot_slots=self.slots)
        # snapshots (hybrid only): prefix -> slot, recency, locks, bare lock_snapshot holders
        self.snaps: dict[tuple[int, ...], int] = {}
        self.snap_access: dict[tuple[int, ...], int] = {}
        self.snap_locks: dict[tuple[int, ...], int] = {}
        self.snap_tick = 0
        self.snap_pins: list[tuple[int, tuple[int, ...]]] = []
        self.cached: dict[tuple[int, ...], int] = {}
        self.locks: dict[tuple[int, ...], int] = {}
        self.access: dict[tuple[int, ...], int] = {}
        self.sessions: dict[tuple[int, ...], set[str]] = {}
        self.retained: dict[str, float] = {}
        self.tick = 0
        self.reqs: list[Req] = []
        self.pins: list[tuple[RadixNode, list[tuple[int, ...]]]] = []   # bare lock() holders
        self.known: list[tuple[int, ...]] = []

    # ------------------------------------------------------------------ model helpers
    def prefixes(self, tokens: tuple[int, ...], num_pages: int) -> list[tuple[int, ...]]:
        return [tokens[:(i + 1) * self.P] for i in range(num_pages)]

    def model_match(self, tokens: tuple[int, ...]) -> list[tuple[int, ...]]:
        out = []
        for pre in self.prefixes(tokens, len(tokens) // self.P):
            if pre not in self.cached:
                break
            out.append(pre)
        if self.slots is not None:   # a match ends at the deepest snapshot
            while out and out[-1] not in self.snaps:
                out.pop()
        return out

    def check_match(self, got, want: list[tuple[int, ...]]) -> None:
        assert got.num_tokens == len(want) * self.P
        assert got.pages == [self.cached[p] for p in want]
        assert got.snapshot == (self.snaps[want[-1]] if want and self.slots is not None else None)

    def note_match(self, want: list[tuple[int, ...]]) -> None:
        """Recency after a touching match: pages, and the snapshot it ends on."""
        self.touch(want)
        if want and self.slots is not None:
            self.snap_tick += 1
            self.snap_access[want[-1]] = self.snap_tick

    def touch(self, prefixes: list[tuple[int, ...]]) -> None:
        if prefixes:
            self.tick += 1
            for pre in prefixes:
                self.access[pre] = self.tick

    def protected(self, pre: tuple[int, ...]) -> bool:
        return any(self.retained.get(s, -1.0) > self.now for s in self.sessions.get(pre, ()))

    def alloc(self, n: int) -> list[int] | None:
        pages = self.pool.alloc(n)
        if pages is None:
            self.do_evict(n - self.pool.num_free())
            pages = self.pool.alloc(n)
        return pages

    def do_evict(self, n: int) -> int:
        before = dict(self.cached)
        evictable = [p for p in before if self.locks.get(p, 0) == 0]
        freed = self.cache.evict(n)
        assert freed == min(max(n, 0), len(evictable))
        removed = [pre for pre, page in before.items() if self.pool.is_free(page)]
        assert len(removed) == freed
        kept_unlocked = [p for p in evictable if p not in removed]
        for pre in removed:
            assert self.locks.get(pre, 0) == 0, "a locked prefix was evicted"
            del self.cached[pre]
        # Prefix-closed: nothing cached hangs below an evicted prefix.
        for pre in self.cached:
            assert pre[:-self.P] == () or pre[:-self.P] in self.cached
        # Two-tier LRU: protected pages only after every unprotected one; oldest first per tier.
        for tier in (False, True):
            gone = [self.access[p] for p in removed if self.protected(p) == tier]
            left = [self.access[p] for p in kept_unlocked if self.protected(p) == tier]
            if gone and left:
                assert max(gone) <= min(left), f"LRU order broken in tier protected={tier}"
        if any(self.protected(p) for p in removed):
            assert not any(not self.protected(p) for p in kept_unlocked)
        for pre in removed:
            self.access.pop(pre, None)
            self.sessions.pop(pre, None)
            slot = self.snaps.pop(pre, None)   # a snapshot goes with the page it ends on
            if slot is not None:
                assert not self.snap_locks.get(pre), "a locked snapshot was evicted"
                assert not self.cache.has_snapshot(slot), "a snapshot outlived its page"
                self.snap_access.pop(pre)
        return freed

    def model_insert(self, tokens: tuple[int, ...], pages: list[int], session: str | None,
                     owner: Req | None) -> InsertResult:
        """Insert into the tree and the model; returns the tree's result."""
        n = len(tokens) // self.P
        pres = self.prefixes(tokens, n)
        expected = []
        dups = []
        new = 0
        for pre, page in zip(pres, pages):
            if pre in self.cached:
                expected.append(self.cached[pre])
                if page != self.cached[pre]:
                    dups.append(page)
            else:
                self.cached[pre] = page
                expected.append(page)
                new += 1
        res = self.cache.insert(tokens, pages, session_id=session)
        assert res.pages == expected
        assert res.num_new_tokens == new * self.P
        for page in dups:
            assert self.pool.is_free(page), "a duplicate page was not freed"
        if owner is not None:
            owner.held -= set(pages[:n])
        self.touch(pres)
        if session is not None:
            for pre in pres:
                self.sessions.setdefault(pre, set()).add(session)
        if tokens[:n * self.P] and tokens[:n * self.P] not in self.known:
            self.known.append(tokens[:n * self.P])
        return res

    # ------------------------------------------------------------------ rules
    @rule(tokens=TOKENS, session=SESSIONS, dup_mask=st.integers(0, 2**8 - 1))
    def insert_direct(self, tokens: list[int], session: str | None, dup_mask: int) -> None:
        """Insert a sequence whose cached part comes either as the canonical page or as a fresh
        duplicate page (a request that computed it itself)."""
        t = tuple(tokens)
        n = len(t) // self.P
        pres = self.prefixes(t, n)
        fresh_needed = sum(1 for i, pre in enumerate(pres)
                           if pre not in self.cached or (dup_mask >> i) & 1)
        fresh = self.alloc(fresh_needed)
        if fresh is None:
            return
        # alloc may have evicted: recompute which prefixes are still cached.
        if sum(1 for i, pre in enumerate(pres)
               if pre not in self.cached or (dup_mask >> i) & 1) > len(fresh):
            self.pool.free(fresh)
            return
        pages = []
        for i, pre in enumerate(pres):
            if pre in self.cached and not (dup_mask >> i) & 1:
                pages.append(self.cached[pre])
            else:
                pages.append(fresh.pop())
        self.model_insert(t, pages, session, None)
        if fresh:
            self.pool.free(fresh)

    @rule(tokens=TOKENS, pick=st.integers(0, 100), extend=st.booleans())
    def match(self, tokens: list[int], pick: int, extend: bool) -> None:
        t = tuple(tokens)
        if extend and self.known:
            t = self.known[pick % len(self.known)] + t
        got = self.cache.match_prefix(t)
        want = self.model_match(t)
        self.check_match(got, want)
        self.note_match(want)

    @rule(tokens=TOKENS, pick=st.integers(0, 100), extend=st.booleans(), session=SESSIONS)
    def start_request(self, tokens: list[int], pick: int, extend: bool,
                      session: str | None) -> None:
        t = tuple(tokens)
        if extend and self.known:
            t = self.known[pick % len(self.known)] + t
        if len(t) < 2:
            return
        m = self.cache.match_prefix(t[:-1])   # the last prompt token is always computed
        want = self.model_match(t[:-1])
        self.check_match(m, want)
        self.note_match(want)
        self.cache.lock(m.node)
        for pre in want:
            self.locks[pre] = self.locks.get(pre, 0) + 1
        total = -(-len(t) // self.P)
        own = self.alloc(total - len(m.pages))
        if own is None:
            self.cache.unlock(m.node)
            for pre in want:
                self.locks[pre] -= 1
            return
        self.reqs.append(Req(t, list(m.pages) + own, m.node, want, set(own), session,
                             len(m.pages)))

    @precondition(lambda self: self.reqs)
    @rule(pick=st.integers(0, 100), upto=st.integers(0, 10))
    def chunk_insert(self, pick: int, upto: int) -> None:
        """Chunked prefill: insert completed whole pages, switch to canonical pages, re-lock."""
        r = self.reqs[pick % len(self.reqs)]
        n = min(len(r.tokens) // self.P, r.inserted_pages + upto)
        if n <= r.inserted_pages:
            return
        res = self.model_insert(r.tokens[:n * self.P], r.pages[:n], r.session, r)
        r.pages[:n] = res.pages
        res_node = res.node
        self.cache.lock(res_node)
        self.cache.unlock(r.node)
        new_locked = self.prefixes(r.tokens, n)
        for pre in new_locked:
            self.locks[pre] = self.locks.get(pre, 0) + 1
        for pre in r.locked:
            self.locks[pre] -= 1
        r.node, r.locked, r.inserted_pages = res_node, new_locked, n

    @precondition(lambda self: self.reqs)
    @rule(pick=st.integers(0, 100), announce=st.booleans())
    def finish_request(self, pick: int, announce: bool) -> None:
        r = self.reqs.pop(pick % len(self.reqs))
        self.model_insert(r.tokens, r.pages, r.session, r)
        self.cache.unlock(r.node)
        for pre in r.locked:
            self.locks[pre] -= 1
        n = len(r.tokens) // self.P
        tail = r.pages[n:]
        assert set(tail) == r.held
        self.pool.free(tail)
        if announce and r.session is not None and not any(q.session == r.session
                                                          for q in self.reqs):
            self.cache.session_finished(r.session)
            self.retained[r.session] = self.now + RETENTION

    @precondition(lambda self: self.known)
    @rule(pick=st.integers(0, 100), cut=st.integers(0, 14))
    def lock(self, pick: int, cut: int) -> None:
        """Pin a (prefix of a) cached sequence without a request."""
        t = self.known[pick % len(self.known)][:cut]
        m = self.cache.match_prefix(t)
        want = self.model_match(t)
        self.check_match(m, want)
        self.note_match(want)
        self.cache.lock(m.node)
        for pre in want:
            self.locks[pre] = self.locks.get(pre, 0) + 1
        self.pins.append((m.node, want))

    @precondition(lambda self: self.pins)
    @rule(pick=st.integers(0, 100))
    def unlock(self, pick: int) -> None:
        node, prefixes = self.pins.pop(pick % len(self.pins))
        self.cache.unlock(node)
        for pre in prefixes:
            self.locks[pre] -= 1

    @rule(n=st.integers(0, 30))
    def evict(self, n: int) -> None:
        self.do_evict(n)

    @rule(session=st.sampled_from(["s1", "s2", "s3"]))
    def session_finished(self, session: str) -> None:
        self.cache.session_finished(session)
        self.retained[session] = self.now + RETENTION

    @rule(dt=st.sampled_from([0.5, 2.0, 6.0]))
    def advance_clock(self, dt: float) -> None:
        self.now += dt

    @rule()
    def reset(self) -> None:
        if any(r.locked for r in self.reqs) or any(p for _, p in self.pins) or self.snap_pins:
            try:
                self.cache.reset()
            except RuntimeError:
                return
            raise AssertionError("reset succeeded while requests hold locks")
        self.cache.reset()
        self.cached.clear()
        self.access.clear()
        self.sessions.clear()
        self.locks.clear()
        self.snaps.clear()
        self.snap_access.clear()
        self.snap_locks.clear()

    # ------------------------------------------------------------------ invariants
    @invariant()
    def consistent(self) -> None:
        if not hasattr(self, "cache"):
            return
        self.cache.check_invariants()
        held = sum(len(r.held) for r in self.reqs)
        assert self.pool.num_free() + self.cache.num_cached_pages + held == self.pool.num_pages
        assert self.cache.num_cached_pages == len(self.cached)
        locked = sum(1 for p in self.cached if self.locks.get(p, 0) > 0)
        assert self.cache.num_locked_pages == locked
        assert self.cache.num_evictable_pages == len(self.cached) - locked
        for seq in self.known:   # probes must not disturb recency
            want = self.model_match(seq)
            self.check_match(self.cache.match_prefix(seq, touch=False), want)
            assert self.cache.cached_prefix_length(seq) == len(want) * self.P
            pages = [pre for pre in self.prefixes(seq, len(seq) // self.P) if pre in self.cached]
            assert self.cache.page_prefix_length(seq) == len(pages) * self.P   # snapshots ignored
        assert self.cache.num_snapshots == len(self.snaps)
        assert self.cache.num_locked_snapshots == sum(1 for n in self.snap_locks.values() if n)
        for slot in self.snaps.values():
            assert self.cache.has_snapshot(slot)
        if self.slots is not None:
            assert self.slots.num_free_snapshots() + len(self.snaps) == self.slots.num_snapshot_slots


class SnapshotRadixMachine(RadixMachine):
    """The same life cycle on a hybrid model's cache, with snapshot operations."""

    @initialize(page_size=st.sampled_from([1, 2, 3]), num_pages=st.integers(3, 24),
                num_snapshots=st.integers(0, 4))
    def setup(self, page_size: int, num_pages: int, num_snapshots: int) -> None:  # type: ignore[override]
        self._setup(page_size, num_pages, num_snapshots)

    def snap_lru_unlocked(self) -> list[tuple[int, ...]]:
        """Eviction order: unprotected snapshots, then session-protected ones, oldest first."""
        return sorted((p for p in self.snaps if not self.snap_locks.get(p)),
                      key=lambda p: (self.protected(p), self.snap_access[p]))

    def forget_snapshot(self, pre: tuple[int, ...], reused: bool = False) -> None:
        slot = self.snaps.pop(pre)
        self.snap_access.pop(pre)
        assert reused or not self.cache.has_snapshot(slot)

    @precondition(lambda self: self.known)
    @rule(pick=st.integers(0, 100), cut=st.integers(1, 5))
    def add_snapshot(self, pick: int, cut: int) -> None:
        t = self.known[pick % len(self.known)][:cut * self.P]
        assert self.slots is not None
        free = self.slots.num_free_snapshots()
        lru = self.snap_lru_unlocked()
        slot = self.cache.add_snapshot(t)
        if t not in self.cached:
            assert slot is None
            return
        if t in self.snaps:
            assert slot is None
            self.snap_tick += 1
            self.snap_access[t] = self.snap_tick
            return
        if not free:
            if not lru:
                assert slot is None
                return
            assert slot == self.snaps[lru[0]], "the LRU unlocked snapshot gives up its slot"
            self.forget_snapshot(lru[0], reused=True)
        assert slot is not None and slot not in self.snaps.values()
        self.snaps[t] = slot
        self.snap_tick += 1
        self.snap_access[t] = self.snap_tick

    @precondition(lambda self: self.snaps)
    @rule(pick=st.integers(0, 100))
    def drop_snapshot(self, pick: int) -> None:
        pre = sorted(self.snaps)[pick % len(self.snaps)]
        dropped = self.cache.drop_snapshot(self.snaps[pre])
        assert dropped == (not self.snap_locks.get(pre))
        if dropped:
            self.forget_snapshot(pre)

    @rule(n=st.integers(0, 5))
    def evict_snapshots(self, n: int) -> None:
        lru = self.snap_lru_unlocked()
        assert self.cache.evict_snapshots(n) == min(n, len(lru))
        for pre in lru[:n]:
            self.forget_snapshot(pre)

    @precondition(lambda self: self.snaps)
    @rule(pick=st.integers(0, 100))
    def lock_snapshot(self, pick: int) -> None:
        """Pin a snapshot as the engine does while restoring it: it and its path."""
        pre = sorted(self.snaps)[pick % len(self.snaps)]
        self.cache.lock_snapshot(self.snaps[pre])
        self.snap_locks[pre] = self.snap_locks.get(pre, 0) + 1
        for p in self.prefixes(pre, len(pre) // self.P):
            self.locks[p] = self.locks.get(p, 0) + 1
        self.snap_pins.append((self.snaps[pre], pre))

    @precondition(lambda self: self.snap_pins)
    @rule(pick=st.integers(0, 100))
    def unlock_snapshot(self, pick: int) -> None:
        slot, pre = self.snap_pins.pop(pick % len(self.snap_pins))
        self.cache.unlock_snapshot(slot)
        self.snap_locks[pre] -= 1
        for p in self.prefixes(pre, len(pre) // self.P):
            self.locks[p] -= 1


_SETTINGS = settings(max_examples=250, stateful_step_count=40, deadline=None,
                     suppress_health_check=[HealthCheck.too_slow])
RadixMachine.TestCase.settings = _SETTINGS
TestRadixMachine = RadixMachine.TestCase
SnapshotRadixMachine.TestCase.settings = _SETTINGS
TestSnapshotRadixMachine = SnapshotRadixMachine.TestCase
