"""Where each KV page lives beyond the device pool: chained page keys and the host-tier index.

Pure Python (no torch, no I/O), shared by the engine and the simulator.

Tiers
    * **L1**: the device KV pool; the :class:`~tokenmill.cache.radix.RadixCache` maps token
      prefixes to its page ids.
    * **L2**: a host-memory pool of page slots, indexed here by :class:`HostIndex` (LRU).
    * **L3**: shared storage (files, Redis) behind :mod:`tokenmill.cache.storage`.

Page keys
    A page's key is a chained hash: ``key_i = H(key_{i-1} || token ids of page i)`` with
    ``key_{-1} = namespace``. The namespace hashes the model's identity, the KV dtype and layout
    and the page size, so two replicas of one model agree on every key while a different model
    (or the same model with another KV dtype) can never address the same page. Because a key
    commits to the whole prefix, the L2 and L3 indexes need no tree: a radix path that ends in
    L1 continues, page by page, through the keys of the following pages.

:class:`TierDirectory` answers "where does page *i* of this prefix live" over the radix tree
(L1), the host index (L2) and the storage tier's known keys (L3).
"""
from __future__ import annotations

import hashlib
import sys
from array import array
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from tokenmill.cache.page_pool import PagePool

if TYPE_CHECKING:
    from tokenmill.cache.radix import RadixCache

__all__ = ["KEY_BYTES", "HostIndex", "PageKeyer", "TierDirectory", "TierStats", "WRITE_POLICIES",
           "make_namespace"]

KEY_BYTES = 16
KEY_FORMAT_VERSION = 1
WRITE_POLICIES = ("write_through", "write_through_selective", "write_back")
TIERS = ("l1", "l2", "l3")


def make_namespace(model_identity: str, kv_layout: str, kv_dtype: str, page_size: int) -> bytes:
    """The root of every key chain: what two replicas must share to exchange pages."""
    text = f"tokenmill-kv/{KEY_FORMAT_VERSION}|{model_identity}|{kv_layout}|{kv_dtype}|{page_size}"
    return hashlib.blake2b(text.encode(), digest_size=KEY_BYTES).digest()


class PageKeyer:
    """Chained page keys under one namespace."""

    def __init__(self, namespace: bytes, page_size: int) -> None:
        if len(namespace) != KEY_BYTES:
            raise ValueError(f"a namespace is {KEY_BYTES} bytes, got {len(namespace)}")
        if page_size <= 0:
            raise ValueError(f"page_size must be positive, got {page_size}")
        self.namespace = namespace
        self.page_size = page_size

    def keys(self, tokens: Sequence[int], num_pages: int | None = None) -> list[bytes]:
        """Keys of the first ``num_pages`` whole pages of ``tokens`` (all whole pages by default)."""
        P = self.page_size
        n = len(tokens) // P if num_pages is None else min(num_pages, len(tokens) // P)
        if n <= 0:
            return []
        data = array("I", tokens[:n * P])
        if sys.byteorder != "little":
            data.byteswap()
        raw = data.tobytes()
        step = 4 * P
        out: list[bytes] = []
        parent = self.namespace
        blake = hashlib.blake2b
        for i in range(n):
            parent = blake(parent + raw[i * step:(i + 1) * step], digest_size=KEY_BYTES).digest()
            out.append(parent)
        return out


class HostIndex:
    """LRU index of the host tier: page key -> slot in a bounded pool of host page slots.

    ``put`` returns the slot to fill plus the entry it displaced (so the caller can write the
    displaced page back to L3 before the slot is overwritten).
    """

    def __init__(self, num_slots: int) -> None:
        self.pool = PagePool(num_slots)
        self._lru: OrderedDict[bytes, int] = OrderedDict()

    @property
    def num_slots(self) -> int:
        return self.pool.num_pages

    def __len__(self) -> int:
        return len(self._lru)

    def __contains__(self, key: bytes) -> bool:
        return key in self._lru

    def get(self, key: bytes, *, touch: bool = True) -> int | None:
        slot = self._lru.get(key)
        if slot is not None and touch:
            self._lru.move_to_end(key)
        return slot

    def leading_run(self, keys: Sequence[bytes]) -> int:
        n = 0
        for k in keys:
            if k not in self._lru:
                break
            n += 1
        return n

    def put(self, key: bytes) -> tuple[int, tuple[bytes, int] | None]:
        """Reserve a slot for ``key`` (which must be absent); evict the LRU entry if full."""
        if key in self._lru:
            raise ValueError("page key is already in the host tier")
        evicted = None
        got = self.pool.alloc(1)
        if got is None:
            old_key, old_slot = self._lru.popitem(last=False)
            evicted = (old_key, old_slot)
            slot = old_slot
        else:
            slot = got[0]
        self._lru[key] = slot
        return slot, evicted

    def discard(self, key: bytes) -> None:
        slot = self._lru.pop(key, None)
        if slot is not None:
            self.pool.free([slot])

    def clear(self) -> None:
        if self._lru:
            self.pool.free(self._lru.values())
        self._lru.clear()

    def items(self) -> Iterable[tuple[bytes, int]]:
        return self._lru.items()


@dataclass
class TierStats:
    """Counters of the tiered cache (one engine). Tokens hit are "not recomputed" tokens."""

    hit_tokens: dict[str, int] = field(default_factory=lambda: dict.fromkeys(TIERS, 0))
    hit_pages: dict[str, int] = field(default_factory=lambda: dict.fromkeys(TIERS, 0))
    bytes_read: dict[str, int] = field(default_factory=lambda: {"l2": 0, "l3": 0})
    bytes_written: dict[str, int] = field(default_factory=lambda: {"l2": 0, "l3": 0})
    pages_written: dict[str, int] = field(default_factory=lambda: {"l2": 0, "l3": 0})
    l3_errors: dict[str, int] = field(default_factory=dict)   # kind -> count
    l3_skipped_present: int = 0      # writes skipped because L3 already held the page
    l3_dropped_writes: int = 0       # writes dropped because the write queue was full
    prefetch_seconds_sum: float = 0.0
    prefetch_count: int = 0
    prefetch_timeouts: int = 0
    load_seconds: dict[str, float] = field(default_factory=lambda: {"l2": 0.0, "l3": 0.0})
    pages_l2: int = 0                # gauge: host slots in use
    pages_l2_capacity: int = 0
    pages_l3_known: int = 0          # gauge: keys this replica knows to be in L3
    # hybrid models: state snapshots restored from / written to each lower tier, L3 snapshot
    # records found unreadable (the hit fell back to an earlier snapshot), host snapshot slots
    snapshot_hits: dict[str, int] = field(default_factory=lambda: {"l2": 0, "l3": 0})
    snapshots_written: dict[str, int] = field(default_factory=lambda: {"l2": 0, "l3": 0})
    snapshot_fallbacks: int = 0
    snapshots_l2: int = 0            # gauge: host snapshot slots in use
    snapshots_l2_capacity: int = 0

    def error(self, kind: str) -> None:
        self.l3_errors[kind] = self.l3_errors.get(kind, 0) + 1

    def snapshot(self) -> TierStats:
        return TierStats(dict(self.hit_tokens), dict(self.hit_pages), dict(self.bytes_read),
                         dict(self.bytes_written), dict(self.pages_written), dict(self.l3_errors),
                         self.l3_skipped_present, self.l3_dropped_writes, self.prefetch_seconds_sum,
                         self.prefetch_count, self.prefetch_timeouts, dict(self.load_seconds),
                         self.pages_l2, self.pages_l2_capacity, self.pages_l3_known,
                         dict(self.snapshot_hits), dict(self.snapshots_written), self.snapshot_fallbacks,
                         self.snapshots_l2, self.snapshots_l2_capacity)


class TierDirectory:
    """Where each page of a prefix lives: the radix tree first, then the host and storage keys.

    ``l3_known`` is the set of keys the storage tier is known to hold (written or confirmed by
    this replica); the authoritative answer for L3 is the backend's leading-run query.
    """

    def __init__(self, cache: RadixCache, keyer: PageKeyer, host: HostIndex | None,
                 l3_known: set[bytes] | None = None) -> None:
        self.cache = cache
        self.keyer = keyer
        self.host = host
        self.l3_known = l3_known if l3_known is not None else set()

    def locate(self, tokens: Sequence[int]) -> list[str]:
        """Tier of each leading whole page of ``tokens`` that is cached anywhere, in order.

        L1 pages come first (the radix match); the run continues while the next page's key is in
        L2 or known to L3. A page held by several tiers is reported at the fastest one.
        """
        m = self.cache.match_prefix(tokens, touch=False)
        where = ["l1"] * len(m.pages)
        keys = self.keyer.keys(tokens)
        for key in keys[len(m.pages):]:
            if self.host is not None and key in self.host:
                where.append("l2")
            elif key in self.l3_known:
                where.append("l3")
            else:
                break
        return where
