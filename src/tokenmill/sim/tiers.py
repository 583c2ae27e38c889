"""The cache tiers in the simulator: a host tier per replica and one storage tier for the fleet.

Pure Python. :class:`SimTiers` plugs into the engine's :class:`~tokenmill.engine.kv_manager.KVManager`
through the same duck-typed interface as the engine's :class:`~tokenmill.engine.kv_tiers.TieredKV`
(``plan`` / ``load`` / ``record_hits`` / ``on_computed`` / ``flush_host`` and the radix eviction
hook), so admission, demotion and write-through follow the engine's own code paths; what the
real tiers do with bytes, these do with page keys only, and they charge time instead.

Keys. A simulated request keys each page by one element (its block id; see
:class:`~tokenmill.sim.replica.SimTokenIds`), and equal block ids mean equal prefixes, so a
block id plays the part of the engine's chained page hash.

Time. Loading ``n2`` pages from L2 and ``n3`` from L3 at admission adds
``n2 * page_bytes / host_bw + (storage_latency + n3 * page_bytes / storage_bw)`` seconds to the
step that admits the request (the engine copies them before that step's forward). Writes are
off the critical path and cost no step time; the shared store's bandwidth is not contended.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

from tokenmill.cache.tiers import HostIndex


@dataclass(frozen=True)
class TierProfile:
    """Capacity and bandwidth of the lower tiers (one replica's L2, the fleet's L3)."""

    host_cache_tokens: int = 0          # L2 per replica; 0 = none
    storage_tokens: int = 0             # L3 for the whole fleet; 0 = none
    kv_bytes_per_token: int = 0
    host_bandwidth_gb_s: float = 20.0
    storage_bandwidth_gb_s: float = 2.0
    storage_latency_s: float = 0.002
    write_policy: str = "write_through"

    def __post_init__(self) -> None:
        for name in ("host_cache_tokens", "storage_tokens", "kv_bytes_per_token"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0")
        if self.host_bandwidth_gb_s <= 0 or self.storage_bandwidth_gb_s <= 0 or self.storage_latency_s < 0:
            raise ValueError("tier bandwidths must be > 0 and the storage latency >= 0")
        if self.write_policy not in ("write_through", "write_back"):
            raise ValueError(f"sim tiers model write_through or write_back, got {self.write_policy!r}")

    @property
    def enabled(self) -> bool:
        return self.host_cache_tokens > 0 or self.storage_tokens > 0


class SharedStore:
    """The fleet's L3: an LRU set of page keys with a capacity (what Redis with LRU eviction does)."""

    def __init__(self, capacity_pages: int) -> None:
        self.capacity = capacity_pages
        self._keys: OrderedDict[Hashable, None] = OrderedDict()
        self.pages_written = 0
        self.pages_read = 0

    def __len__(self) -> int:
        return len(self._keys)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._keys

    def put(self, keys: Sequence[Hashable]) -> None:
        for k in keys:
            if k in self._keys:
                continue
            self._keys[k] = None
            self.pages_written += 1
        while len(self._keys) > self.capacity:
            self._keys.popitem(last=False)

    def touch(self, key: Hashable) -> None:
        self._keys.move_to_end(key)


@dataclass
class _Plan:
    first_page: int
    sources: list[tuple[str, Any, Any]] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.sources)


class SimTiers:
    def __init__(self, tp: TierProfile, block_tokens: int, store: SharedStore | None) -> None:
        self.tp = tp
        self.block_tokens = block_tokens
        self.page_bytes = block_tokens * tp.kv_bytes_per_token
        host_pages = tp.host_cache_tokens // block_tokens
        self.host = HostIndex(host_pages) if host_pages > 0 else None
        self.store = store
        self.pending_s = 0.0
        self.hit_tokens = {"l1": 0, "l2": 0, "l3": 0}
        self.load_s = 0.0

    # -- the KVManager interface ------------------------------------------------------------------
    def plan(self, req: Any, l1_pages: int, max_pages: int) -> _Plan:
        plan = _Plan(l1_pages)
        if max_pages <= l1_pages:
            return plan
        keys = req.cache_key(max_pages)
        for i in range(l1_pages, max_pages):
            k = keys[i]
            if self.host is not None and self.host.get(k) is not None:
                plan.sources.append(("l2", k, None))
            elif self.store is not None and k in self.store:
                plan.sources.append(("l3", k, None))
            else:
                break
        return plan

    def load(self, plan: _Plan, pages: list[int]) -> dict[str, int]:
        n = min(len(plan.sources), len(pages))
        n2 = sum(1 for t, _, _ in plan.sources[:n] if t == "l2")
        n3 = n - n2
        t = n2 * self.page_bytes / (self.tp.host_bandwidth_gb_s * 1e9)
        if n3:
            t += self.tp.storage_latency_s + n3 * self.page_bytes / (self.tp.storage_bandwidth_gb_s * 1e9)
            assert self.store is not None
            for _, k, _ in plan.sources[:n]:
                if k in self.store:
                    self.store.touch(k)
            self.store.pages_read += n3
        self.pending_s += t
        self.load_s += t
        return {"l2": n2, "l3": n3}

    def record_hits(self, req: Any, by_tier: dict[str, int]) -> None:
        for tier, pages in by_tier.items():
            self.hit_tokens[tier] += pages * self.block_tokens

    def on_computed(self, req: Any, start: int, end: int) -> None:
        if self.store is not None and self.tp.write_policy == "write_through" and end > start:
            self.store.put(req.cache_key(end)[start:end])

    def on_evict(self, prefix: tuple[Hashable, ...], pages: list[int]) -> None:
        keys = prefix[len(prefix) - len(pages):]
        if self.host is None:
            if self.store is not None and self.tp.write_policy == "write_back":
                self.store.put(keys)
            return
        for k in keys:
            if k in self.host:
                self.host.get(k)
                continue
            _, displaced = self.host.put(k)
            if displaced is not None and self.store is not None and self.tp.write_policy == "write_back":
                self.store.put([displaced[0]])

    def flush_host(self) -> None:
        if self.host is not None:
            self.host.clear()

    # -- the replica's clock ----------------------------------------------------------------------
    def take_load_seconds(self) -> float:
        t, self.pending_s = self.pending_s, 0.0
        return t
