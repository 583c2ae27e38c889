"""Radix prefix cache over token ids, aligned to KV pages (no torch, no I/O).

The tree maps page-aligned token prefixes to the KV pages that hold them. The engine and the
fleet simulator share this class; in the simulator the pages hold nothing.

Structure
    * Every non-root node owns an edge: ``key`` (a tuple of token ids whose length is a whole
      number of pages) and ``pages`` (one page id per ``page_size`` tokens of ``key``).
    * Children are keyed by the token tuple of their first page, so siblings never share a
      first page and every split happens on a page boundary.
    * A node's ``lock_ref`` counts the requests that pin it. Locking a node pins its ancestors
      too, so ``parent.lock_ref >= child.lock_ref`` always holds and an unlocked node has an
      unlocked subtree: every unlocked page can be evicted by evicting leaves repeatedly.

Eviction
    LRU over unlocked leaves, from the tail of a leaf inwards, so ``evict(n)`` frees exactly
    ``n`` pages when that many are unlocked. Recency is a logical tick stamped on every node of a
    matched or inserted path; a parent's tick is never older than its children's, so evicting
    leaves oldest first evicts pages oldest first. Candidate leaves sit in a heap with lazy
    invalidation (an entry is stale once the node is touched, locked, gains a child or leaves
    the tree).

Session retention (two-tier LRU)
    ``insert(..., session_id=s)`` tags every node of the inserted path with ``s``.
    ``session_finished(s)`` opens a retention window of ``session_retention_s`` seconds on the
    injected clock. A node is *protected* while any of its sessions is inside its window.
    ``evict`` first takes unprotected leaves (oldest first) and only then protected ones (oldest
    first). While a session has a request running, its path is locked anyway.

Page ownership
    ::

        request tokens:  |  page 0  |  page 1  |  page 2  |  page 3  | pa|
                         '---- matched at admission ----'  (locked: owned by the tree)
                                              '--- computed by the request ---'
        finish:  insert(tokens, pages)  -> pages 0..3 owned by the tree (duplicates of pages
                 already in the tree are freed to the pool and replaced by the canonical ones)
                 the partial last page "pa" stays with the request, which frees it itself.

    Invariant: ``pool.num_free() + num_cached_pages + pages held only by requests
    == pool.num_pages``.

State snapshots (hybrid models)
    A hybrid model's linear-attention layers carry a fixed-size recurrent state instead of KV per
    token, so reusing cached pages is only exact from a point where that state is known. With
    ``snapshot_slots`` (an allocator of state-pool slot ids, see
    :class:`~tokenmill.cache.state_slots.StateSlotPool`) the tree keeps *snapshots*: slot ids
    holding the state after a page-aligned prefix. A snapshot always sits at the end of a node
    (``add_snapshot`` splits the edge there), at most one per node. ``match_prefix`` then ends
    at the deepest matched node that has one and returns its slot; pages past it are not
    reused. Snapshots have their own budget (the allocator's slots) and their own LRU, apart
    from the pages': ``add_snapshot`` takes a free slot or the least recently used unlocked
    snapshot's (those of retained sessions last, as for pages). Evicting a node's pages (all
    of them, or its tail) drops its snapshot and returns the slot; dropping a snapshot leaves
    the pages, so a match falls back to the nearest earlier snapshot. ``lock_snapshot`` pins a snapshot (and its node's path) while
    the engine restores it. Without ``snapshot_slots`` (dense models) none of this applies.

Lower tiers
    ``evict_hook(prefix_tokens, pages)``, when set, is called just before evicted pages return
    to the pool: ``prefix_tokens`` runs from the root to the end of the evicted pages, which hold
    its last ``len(pages) * page_size`` tokens. The tiered cache uses it to demote the pages to
    host memory (their content is still intact when the hook runs). ``snapshot_evict_hook(
    prefix_tokens, slot)`` does the same for a snapshot given up by page eviction or by the
    snapshot LRU (not by ``drop_snapshot``): its slot still holds the state after ``prefix_tokens``. The tree itself holds only
    L1 pages; :class:`~tokenmill.cache.tiers.TierDirectory` continues a path into L2 and L3.
"""
from __future__ import annotations

import heapq
import itertools
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import NamedTuple, Protocol

from tokenmill.cache.page_pool import PagePool

__all__ = ["InsertResult", "MatchResult", "RadixCache", "RadixNode", "Snapshot", "SnapshotSlots"]


class SnapshotSlots(Protocol):
    """What the tree needs from a snapshot-slot allocator (``StateSlotPool`` provides it)."""

    num_snapshot_slots: int

    def alloc_snapshot(self) -> int | None: ...

    def free_snapshot(self, slot: int) -> None: ...

    def num_free_snapshots(self) -> int: ...


class RadixNode:
    """One edge of the tree. Callers only pass nodes back to ``lock``/``unlock``."""

    __slots__ = ("key", "pages", "children", "parent", "lock_ref", "last_access", "sessions",
                 "attached", "snapshot")

    def __init__(self, key: tuple[int, ...], pages: list[int], parent: RadixNode | None,
                 last_access: int) -> None:
        self.key = key
        self.pages = pages
        self.children: dict[tuple[int, ...], RadixNode] = {}
        self.parent = parent
        self.lock_ref = 0
        self.last_access = last_access
        self.sessions: set[str] | None = None
        self.attached = True
        self.snapshot: Snapshot | None = None   # state after the last token of ``key``

    def __repr__(self) -> str:
        return (f"RadixNode(pages={self.pages}, lock_ref={self.lock_ref}, "
                f"children={len(self.children)})")


class Snapshot:
    """A state-pool slot holding the linear layers' state after the end of ``node``."""

    __slots__ = ("slot", "node", "lock_ref")

    def __init__(self, slot: int, node: RadixNode) -> None:
        self.slot = slot
        self.node = node
        self.lock_ref = 0

    def __repr__(self) -> str:
        return f"Snapshot(slot={self.slot}, lock_ref={self.lock_ref})"


class MatchResult(NamedTuple):
    node: RadixNode   # deepest matched node; pass to lock()/unlock()
    num_tokens: int   # always a multiple of page_size
    pages: list[int]  # num_tokens // page_size page ids, in order
    snapshot: int | None = None   # with snapshots: slot of the state after num_tokens (None: no match)


class InsertResult(NamedTuple):
    num_new_tokens: int  # tokens that were not in the tree before
    pages: list[int]     # the canonical page ids for the inserted prefix, in order
    node: RadixNode      # node that ends the inserted prefix


class RadixCache:
    """Page-aligned radix tree of cached KV prefixes with reference counts and LRU eviction.

    Contract (single-threaded; the caller serialises access):
      * ``match_prefix(tokens)`` returns the longest cached prefix of whole pages of ``tokens``.
        It mutates only recency (and may split a node at the match end, which never changes
        what is cached). The returned node must be locked before the next ``insert``/``evict``
        if the caller is going to use its pages.
      * ``lock(node)`` / ``unlock(node)`` pin / unpin the node and all its ancestors.
      * ``insert`` takes ownership of new pages and frees the caller's duplicate pages.
      * ``evict(n)`` frees up to ``n`` unlocked pages to the pool and returns how many it freed;
        it never raises for lack of evictable pages.
      * With ``snapshot_slots``: a match ends only at a snapshot; ``add_snapshot`` /
        ``drop_snapshot`` / ``evict_snapshots`` / ``lock_snapshot`` / ``unlock_snapshot``
        manage them (the tree owns every snapshot slot of the allocator).
    """

    def __init__(self, pool: PagePool, page_size: int, *, session_retention_s: float = 60.0,
                 clock: Callable[[], float] = time.monotonic,
                 snapshot_slots: SnapshotSlots | None = None) -> None:
        if page_size <= 0:
            raise ValueError(f"page_size must be positive, got {page_size}")
        if session_retention_s < 0:
            raise ValueError(f"session_retention_s must be >= 0, got {session_retention_s}")
        self.pool = pool
        self.page_size = page_size
        self.session_retention_s = float(session_retention_s)
        self._clock = clock
        self.evict_hook: Callable[[tuple[int, ...], list[int]], None] | None = None
        # Called with (prefix_tokens, slot) just before a snapshot is given up by page eviction
        # or by the snapshot LRU (not by drop_snapshot or reset); the slot still holds the state.
        self.snapshot_evict_hook: Callable[[tuple[int, ...], int], None] | None = None
        self._tick = 0
        self._seq = itertools.count()
        # Retention windows are session state, not cache content: they survive reset().
        self._retained_until: dict[str, float] = {}
        # The root object lives as long as the cache: requests holding it stay valid on reset.
        self.root = RadixNode((), [], None, 0)
        self.snapshot_slots = snapshot_slots
        self._init_tree()

    def _init_tree(self) -> None:
        self.root.children = {}
        self._heap: list[tuple[int, int, RadixNode]] = []
        # Protected leaves put aside by evict, keyed by the time their protection ends (it can
        # only be extended later), so that tier 1 does not walk over them again on every call.
        self._deferred: list[tuple[float, tuple[int, int, RadixNode]]] = []
        self._evicting = False
        self._num_nodes = 0  # non-root
        self._num_locks = 0  # outstanding lock() calls on non-root nodes
        self.num_cached_pages = 0
        self.num_locked_pages = 0
        # Snapshots by slot, least recently used first.
        self._snapshots: OrderedDict[int, Snapshot] = OrderedDict()
        self.num_locked_snapshots = 0

    # ------------------------------------------------------------------ accounting
    @property
    def num_evictable_pages(self) -> int:
        """Unlocked pages; all of them can be freed by ``evict`` (unlocked subtrees)."""
        return self.num_cached_pages - self.num_locked_pages

    @property
    def num_nodes(self) -> int:
        return self._num_nodes

    @property
    def uses_snapshots(self) -> bool:
        """True for a hybrid model's cache: matches end only at state snapshots."""
        return self.snapshot_slots is not None

    @property
    def num_snapshots(self) -> int:
        return len(self._snapshots)

    @property
    def num_snapshot_slots(self) -> int:
        return self.snapshot_slots.num_snapshot_slots if self.snapshot_slots is not None else 0

    # ------------------------------------------------------------------ lookup
    def match_prefix(self, tokens: Sequence[int], *, touch: bool = True,
                     ignore_snapshots: bool = False) -> MatchResult:
        """Longest cached prefix of ``tokens`` made of whole pages.

        The engine passes the prompt without its last token, since that token must be computed
        to produce logits. ``touch=False`` leaves recency alone (for routing/scoring probes).
        With snapshots the match is cut back to the deepest matched node holding one (pages and
        snapshot recency are touched up to there); no snapshot on the path means no match.
        ``ignore_snapshots=True`` returns every cached whole page (the match a dense model gets,
        ``snapshot`` None): the lower tiers continue such a path to a snapshot they hold.
        """
        P = self.page_size
        n = len(tokens) - len(tokens) % P
        path, pos = self._descend(tuple(tokens[:n]))
        snap: Snapshot | None = None
        if self.snapshot_slots is not None and not ignore_snapshots:
            k = len(path)
            while k and path[k - 1].snapshot is None:
                k -= 1
            if k < len(path):
                pos -= sum(len(node.key) for node in path[k:])
                del path[k:]
            if path:
                snap = path[-1].snapshot
        pages: list[int] = []
        for node in path:
            pages.extend(node.pages)
        end = path[-1] if path else self.root
        if touch and path:
            self._touch(path)
            if snap is not None:
                self._snapshots.move_to_end(snap.slot)
        return MatchResult(end, pos, pages, snap.slot if snap is not None else None)

    def cached_prefix_length(self, tokens: Sequence[int], limit: int | None = None) -> int:
        """Tokens of ``tokens[:limit]`` that :meth:`match_prefix` would match, as a pure probe.

        Unlike ``match_prefix(..., touch=False)`` it changes nothing (no edge is split, no
        recency touched) and reads the tokens in place, one edge at a time, instead of copying
        the whole sequence first. For cache-aware admission and routing scores.
        """
        return self._probe(tokens, limit, self.snapshot_slots is not None)

    def page_prefix_length(self, tokens: Sequence[int], limit: int | None = None) -> int:
        """Tokens of ``tokens[:limit]`` whose pages are cached, wherever the snapshots are (the
        match a dense model would get); a pure probe like :meth:`cached_prefix_length`."""
        return self._probe(tokens, limit, False)

    def _probe(self, tokens: Sequence[int], limit: int | None, hybrid: bool) -> int:
        P = self.page_size
        n = len(tokens) if limit is None else min(limit, len(tokens))
        n -= n % P
        node, pos = self.root, 0
        best = 0   # with snapshots: the end of the deepest whole node matched that has one
        while pos < n:
            child = node.children.get(tuple(tokens[pos:pos + P]))
            if child is None:
                break
            ck, klen = child.key, len(child.key)
            limit_here = min(klen, n - pos)
            if tuple(tokens[pos:pos + limit_here]) == ck[:limit_here]:   # the usual case: one compare
                m = limit_here
            else:
                m = P
                while m < limit_here and tuple(tokens[pos + m:pos + m + P]) == ck[m:m + P]:
                    m += P
            pos += m
            if m < klen:
                break
            node = child
            if hybrid and child.snapshot is not None:
                best = pos
        return best if hybrid else pos

    # ------------------------------------------------------------------ pinning
    def lock(self, node: RadixNode) -> None:
        """Pin ``node`` and its ancestors: none of their pages can be evicted until unlock."""
        if node is self.root:
            return
        if not node.attached:
            raise ValueError("cannot lock a node that was evicted; lock a match result at once")
        self._num_locks += 1
        while node is not self.root:
            if node.lock_ref == 0:
                self.num_locked_pages += len(node.pages)
            node.lock_ref += 1
            node = node.parent  # type: ignore[assignment]

    def unlock(self, node: RadixNode) -> None:
        """Undo one ``lock(node)``; a leaf that becomes unlocked is an eviction candidate."""
        if node is self.root:
            return
        if node.lock_ref <= 0 or not node.attached:
            raise ValueError("unlock of a node that is not locked")
        self._num_locks -= 1
        if node.lock_ref == 1 and not node.children:
            self._push(node)
        while node is not self.root:
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self.num_locked_pages -= len(node.pages)
            node = node.parent  # type: ignore[assignment]

    # ------------------------------------------------------------------ insert
    def insert(self, tokens: Sequence[int], pages: Sequence[int], *,
               session_id: str | None = None) -> InsertResult:
        """Cache ``tokens`` (truncated to whole pages) whose KV lives in ``pages``.

        ``pages[i]`` holds ``tokens[i*P:(i+1)*P]``; only the first ``len(tokens) // P`` pages are
        used and any further page (e.g. a partial last page) stays with the caller. For the part
        already cached, each caller page that differs from the tree's is freed to the pool (the
        caller must switch to ``InsertResult.pages``); the new pages become owned by the tree.
        Safe under a locked path: new nodes start unlocked and splits keep lock counts.
        """
        P = self.page_size
        num_pages = len(tokens) // P
        if len(pages) < num_pages:
            raise ValueError(f"insert of {num_pages} whole pages of tokens needs that many page "
                             f"ids, got {len(pages)}")
        key = tuple(tokens[:num_pages * P])
        path, pos = self._descend(key)
        canonical: list[int] = []
        dup: list[int] = []
        i = 0
        for node in path:
            for p in node.pages:
                if pages[i] != p:
                    dup.append(pages[i])
                i += 1
            canonical.extend(node.pages)
        if dup:
            self.pool.free(dup)
        new_tokens = len(key) - pos
        if new_tokens:
            parent = path[-1] if path else self.root
            leaf = RadixNode(key[pos:], list(pages[i:num_pages]), parent, self._tick)
            parent.children[key[pos:pos + P]] = leaf
            self._num_nodes += 1
            self.num_cached_pages += len(leaf.pages)
            canonical.extend(leaf.pages)
            path.append(leaf)
        if path:
            self._touch(path)
            if session_id is not None:
                self._tag(path, session_id)
        end = path[-1] if path else self.root
        return InsertResult(new_tokens, canonical, end)

    # ------------------------------------------------------------------ snapshots
    def add_snapshot(self, tokens: Sequence[int]) -> int | None:
        """Record a state snapshot after ``tokens`` (whole pages, all of them cached).

        Returns the slot the caller must fill *now* with the state after ``tokens[-1]``, or
        ``None`` when nothing is to be copied: the tree has no snapshots, the prefix is not
        cached, a snapshot is already there (its recency is refreshed), or every slot is taken
        by a locked snapshot. A full budget gives up the least recently used unlocked snapshot.
        Changes no page and no page recency (it may split the edge at ``len(tokens)``).
        """
        if self.snapshot_slots is None:
            return None
        P = self.page_size
        if not tokens or len(tokens) % P:
            raise ValueError(f"a snapshot sits on a page boundary: {len(tokens)} tokens is not a "
                             f"positive multiple of page_size {P}")
        path, pos = self._descend(tuple(tokens))
        if pos < len(tokens):
            return None
        node = path[-1]
        if node.snapshot is not None:
            self._snapshots.move_to_end(node.snapshot.slot)
            return None
        slot = self.snapshot_slots.alloc_snapshot()
        if slot is None and self.evict_snapshots(1):
            slot = self.snapshot_slots.alloc_snapshot()
        if slot is None:
            return None
        snap = Snapshot(slot, node)
        node.snapshot = snap
        self._snapshots[slot] = snap
        return slot

    def has_snapshot(self, slot: int) -> bool:
        return slot in self._snapshots

    def snapshot(self, slot: int) -> Snapshot | None:
        """The live snapshot in ``slot`` (compare by identity: a dropped snapshot's slot is reused)."""
        return self._snapshots.get(slot)

    def drop_snapshot(self, slot: int) -> bool:
        """Drop the snapshot in ``slot`` (its pages stay); False if it is gone or locked."""
        snap = self._snapshots.get(slot)
        if snap is None or snap.lock_ref:
            return False
        self._drop_snapshot(snap)
        return True

    def evict_snapshots(self, n: int) -> int:
        """Drop up to ``n`` unlocked snapshots, least recently used first; returns how many.

        Two tiers like page eviction: snapshots of no retained session first, then those whose
        node is protected by a session retention window (oldest first in each)."""
        if n <= 0:
            return 0
        now = self._clock()
        victims: list[Snapshot] = []
        protected: list[Snapshot] = []
        for snap in self._snapshots.values():
            if len(victims) == n:
                break
            if snap.lock_ref:
                continue
            if snap.node.sessions and self._protected_until(snap.node, now) > now:
                protected.append(snap)
            else:
                victims.append(snap)
        victims.extend(protected[:n - len(victims)])
        for snap in victims:
            if self.snapshot_evict_hook is not None:
                self.snapshot_evict_hook(self._path_tokens(snap.node), snap.slot)
            self._drop_snapshot(snap)
        return len(victims)

    def lock_snapshot(self, slot: int) -> None:
        """Pin the snapshot in ``slot`` and its node's path (while its state is being restored)."""
        snap = self._snapshots.get(slot)
        if snap is None:
            raise ValueError(f"no snapshot in slot {slot}: lock a match result at once")
        self.lock(snap.node)
        if snap.lock_ref == 0:
            self.num_locked_snapshots += 1
        snap.lock_ref += 1

    def unlock_snapshot(self, slot: int) -> None:
        """Undo one ``lock_snapshot(slot)``."""
        snap = self._snapshots.get(slot)
        if snap is None or snap.lock_ref <= 0:
            raise ValueError(f"unlock of snapshot slot {slot}, which is not locked")
        snap.lock_ref -= 1
        if snap.lock_ref == 0:
            self.num_locked_snapshots -= 1
        self.unlock(snap.node)

    def _drop_snapshot(self, snap: Snapshot) -> None:
        assert snap.lock_ref == 0, "dropping a locked snapshot"
        assert self.snapshot_slots is not None
        snap.node.snapshot = None
        del self._snapshots[snap.slot]
        self.snapshot_slots.free_snapshot(snap.slot)

    # ------------------------------------------------------------------ eviction
    def evict(self, num_pages: int) -> int:
        """Free up to ``num_pages`` unlocked pages, LRU first; returns the number freed.

        Tier 1: leaves of no retained session, oldest first. Tier 2 (only if tier 1 ran out):
        leaves protected by a session retention window, oldest first.
        """
        if num_pages <= 0:
            return 0
        self._evicting = True      # no heap rebuild under the loops below (they hold the heaps)
        try:
            freed = self._evict(num_pages)
        finally:
            self._evicting = False
        if len(self._heap) + len(self._deferred) > 4 * self._num_nodes + 64:
            self._rebuild_heap()
        return freed

    def _evict(self, num_pages: int) -> int:
        now = self._clock()
        freed = 0
        heap = self._heap
        deferred = self._deferred
        while deferred and deferred[0][0] <= now:    # protection over: a candidate again
            heapq.heappush(heap, heapq.heappop(deferred)[1])
        while freed < num_pages and heap:
            entry = heapq.heappop(heap)
            node = entry[2]
            if not self._is_candidate(node, entry[0]):
                continue
            if node.sessions:
                until = self._protected_until(node, now)
                if until > now:
                    heapq.heappush(deferred, (until, entry))
                    continue
            freed += self._evict_from_leaf(node, num_pages - freed)
        if freed < num_pages:
            # Tier 2: every leaf, protected or not, oldest first (the put-aside ones and any
            # that eviction just exposed), merged by (tick, seq); the rest stay put aside.
            aside = [(entry, until) for until, entry in deferred]
            heapq.heapify(aside)
            while freed < num_pages and (heap or aside):
                if aside and (not heap or aside[0][0] < heap[0]):
                    entry = heapq.heappop(aside)[0]
                else:
                    entry = heapq.heappop(heap)
                if self._is_candidate(entry[2], entry[0]):
                    freed += self._evict_from_leaf(entry[2], num_pages - freed)
            self._deferred = [(until, entry) for entry, until in aside]
            heapq.heapify(self._deferred)
        return freed

    def _is_candidate(self, node: RadixNode, tick: int) -> bool:
        return (node.attached and node.lock_ref == 0 and not node.children
                and node.last_access == tick)

    def _evict_from_leaf(self, node: RadixNode, want: int) -> int:
        """Free the last ``want`` pages of an unlocked leaf (all of it if it has fewer)."""
        n = len(node.pages)
        path = self._path_tokens(node) if (self.evict_hook or self.snapshot_evict_hook) else ()
        if self.evict_hook is not None:
            self.evict_hook(path, node.pages[max(n - want, 0):])
        if node.snapshot is not None:   # it sits at the node's end, which goes either way
            if self.snapshot_evict_hook is not None:
                self.snapshot_evict_hook(path, node.snapshot.slot)
            self._drop_snapshot(node.snapshot)
        if want < n:
            freed_pages = node.pages[n - want:]
            del node.pages[n - want:]
            node.key = node.key[:(n - want) * self.page_size]
            self.pool.free(freed_pages)
            self.num_cached_pages -= want
            self._push(node)  # the rest of the leaf stays a candidate, same recency
            return want
        parent = node.parent
        assert parent is not None
        del parent.children[node.key[:self.page_size]]
        node.attached = False
        node.parent = None
        self.pool.free(node.pages)
        self.num_cached_pages -= n
        self._num_nodes -= 1
        if parent is not self.root and not parent.children and parent.lock_ref == 0:
            self._push(parent)
        return n

    # ------------------------------------------------------------------ sessions
    def session_finished(self, session_id: str) -> None:
        """The session's last running request finished: retain its path for a while."""
        if self.session_retention_s > 0:
            self._retained_until[session_id] = self._clock() + self.session_retention_s

    def is_session_retained(self, session_id: str) -> bool:
        until = self._retained_until.get(session_id)
        return until is not None and until > self._clock()

    def _protected_until(self, node: RadixNode, now: float) -> float:
        """When the last open retention window among ``node``'s sessions closes (``now`` if none)."""
        retained = self._retained_until
        end = now
        for s in node.sessions or ():
            until = retained.get(s)
            if until is not None and until > end:
                end = until
        return end

    def _tag(self, path: list[RadixNode], session_id: str) -> None:
        now = -1.0
        for node in path:
            sessions = node.sessions
            if sessions is None:
                node.sessions = {session_id}
                continue
            sessions.add(session_id)
            if len(sessions) >= 16 and len(sessions) & (len(sessions) - 1) == 0:
                # Amortised clean-up of tags whose retention window has closed; a tag matters
                # only while its window is open, and a returning session re-tags its path.
                if now < 0:
                    now = self._clock()
                retained = self._retained_until
                expired = {s for s in sessions if s != session_id and s in retained
                           and retained[s] <= now}
                sessions -= expired

    # ------------------------------------------------------------------ flush
    def reset(self) -> None:
        """Flush: free every cached page to the pool. Only when nothing is locked."""
        if self._num_locks:
            raise RuntimeError(f"cannot reset the radix cache while {self._num_locks} locks "
                               f"are held")
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            self.pool.free(node.pages)
            node.attached = False
            if node.snapshot is not None:
                self._drop_snapshot(node.snapshot)
            stack.extend(node.children.values())
        self._init_tree()

    # ------------------------------------------------------------------ internals
    def _path_tokens(self, node: RadixNode) -> tuple[int, ...]:
        """Tokens from the root to the end of ``node``."""
        parts = []
        while node is not self.root:
            parts.append(node.key)
            node = node.parent  # type: ignore[assignment]
        return tuple(t for part in reversed(parts) for t in part)

    def _descend(self, key: tuple[int, ...]) -> tuple[list[RadixNode], int]:
        """Walk ``key`` (whole pages) from the root; split the last edge at the match end.

        Returns the matched path (root excluded) and the number of matched tokens.
        """
        P = self.page_size
        node = self.root
        path: list[RadixNode] = []
        pos = 0
        n = len(key)
        while pos < n:
            child = node.children.get(key[pos:pos + P])
            if child is None:
                break
            klen = len(child.key)
            if key[pos:pos + klen] == child.key:
                path.append(child)
                pos += klen
                node = child
                continue
            # Partial match: at least the first page matches; find the first differing page.
            limit = min(klen, n - pos)
            m = P
            ck = child.key
            while m < limit and ck[m:m + P] == key[pos + m:pos + m + P]:
                m += P
            path.append(self._split(child, m // P))
            pos += m
            break
        return path, pos

    def _split(self, node: RadixNode, num_pages: int) -> RadixNode:
        """Split ``node`` after ``num_pages`` pages; ``node`` keeps the lower part (its identity
        stays valid for lock holders) and the new upper node is returned."""
        P = self.page_size
        cut = num_pages * P
        parent = node.parent
        assert parent is not None
        top = RadixNode(node.key[:cut], node.pages[:num_pages], parent, node.last_access)
        top.lock_ref = node.lock_ref
        top.sessions = set(node.sessions) if node.sessions else None
        parent.children[top.key[:P]] = top
        node.key = node.key[cut:]
        node.pages = node.pages[num_pages:]
        node.parent = top
        top.children[node.key[:P]] = node
        self._num_nodes += 1
        return top

    def _touch(self, path: list[RadixNode]) -> None:
        self._tick += 1
        tick = self._tick
        for node in path:
            node.last_access = tick
        end = path[-1]
        if not end.children and end.lock_ref == 0:
            self._push(end)

    def _push(self, node: RadixNode) -> None:
        heapq.heappush(self._heap, (node.last_access, next(self._seq), node))
        if not self._evicting and len(self._heap) + len(self._deferred) > 4 * self._num_nodes + 64:
            self._rebuild_heap()

    def _rebuild_heap(self) -> None:
        heap = []
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            if node.children:
                stack.extend(node.children.values())
            elif node.lock_ref == 0:
                heap.append((node.last_access, next(self._seq), node))
        heapq.heapify(heap)
        self._heap = heap
        self._deferred = []

    # ------------------------------------------------------------------ checks
    def check_invariants(self) -> None:
        """Raise ``AssertionError`` if the tree or its accounting is inconsistent."""
        P = self.page_size
        seen: set[int] = set()
        cached = locked = nodes = locks_at_leaves = 0
        snaps: set[int] = set()
        snaps_locked = 0
        assert self.root.snapshot is None, "a snapshot of the empty prefix"
        stack = [self.root]
        while stack:
            node = stack.pop()
            for first, child in node.children.items():
                nodes += 1
                assert child.attached, "a detached node is still in the tree"
                assert child.parent is node, "child.parent does not point to its parent"
                assert child.pages, "a non-root node has no pages"
                assert len(child.key) == len(child.pages) * P, "key length != pages * page_size"
                assert first == child.key[:P], "child is filed under the wrong first page"
                assert child.lock_ref >= 0, "negative lock count"
                if node is not self.root:
                    assert node.lock_ref >= child.lock_ref, "child locked more than its parent"
                    assert node.last_access >= child.last_access, "parent older than child"
                for p in child.pages:
                    assert p not in seen, f"page {p} appears twice in the tree"
                    assert not self.pool.is_free(p), f"cached page {p} is free in the pool"
                    seen.add(p)
                cached += len(child.pages)
                if child.lock_ref > 0:
                    locked += len(child.pages)
                own = child.lock_ref - sum(c.lock_ref for c in child.children.values())
                assert own >= 0, "child lock counts exceed the parent's"
                locks_at_leaves += own
                snap = child.snapshot
                if snap is not None:
                    assert self.snapshot_slots is not None, "a snapshot in a cache without snapshots"
                    assert snap.node is child, "snapshot.node does not point to its node"
                    assert self._snapshots.get(snap.slot) is snap, f"snapshot {snap.slot} not in the LRU"
                    assert snap.slot not in snaps, f"snapshot slot {snap.slot} used twice"
                    assert snap.lock_ref >= 0, "negative snapshot lock count"
                    assert child.lock_ref >= snap.lock_ref, "locked snapshot on a less locked node"
                    snaps.add(snap.slot)
                    snaps_locked += snap.lock_ref > 0
                stack.append(child)
        assert cached == self.num_cached_pages, (
            f"num_cached_pages {self.num_cached_pages} != {cached} pages in the tree")
        assert locked == self.num_locked_pages, (
            f"num_locked_pages {self.num_locked_pages} != {locked} locked pages in the tree")
        assert nodes == self._num_nodes, f"node count {self._num_nodes} != {nodes}"
        assert locks_at_leaves == self._num_locks, (
            f"{self._num_locks} outstanding locks but the tree holds {locks_at_leaves}")
        assert self.pool.num_free() + cached <= self.pool.num_pages, "pages over-committed"
        assert len(snaps) == len(self._snapshots), (
            f"{len(self._snapshots)} snapshots in the LRU but {len(snaps)} in the tree")
        assert snaps_locked == self.num_locked_snapshots, (
            f"num_locked_snapshots {self.num_locked_snapshots} != {snaps_locked} in the tree")
        if self.snapshot_slots is not None:
            free = self.snapshot_slots.num_free_snapshots()
            assert free + len(snaps) == self.snapshot_slots.num_snapshot_slots, (
                f"snapshot accounting broken: free {free} + in tree {len(snaps)} != "
                f"{self.snapshot_slots.num_snapshot_slots} slots")
