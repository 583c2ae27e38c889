"""The tiered KV cache behind the engine's page pool: L2 host memory and L3 shared storage.

The device pool (L1) and its radix tree stay as they are; this module holds the pages that
fall out of them and brings them back. It is the only tier code that touches tensors.

Flow of pages::

    L1 eviction (radix evict_hook)  -> copy to an L2 slot (one batched copy per evicted run);
                                       write_back: a page displaced from L2 goes to L3
    page computed (cache_computed)  -> write_through: queued for L3; write_through_selective:
                                       queued once the page has been hit N times
    end of every engine step        -> queued pages snapshotted in one gather and handed to
                                       the storage worker thread (encode + I/O off the step)
    arrival (add_request)           -> L3 prefetch of the keys after the L1 + L2 run starts at
                                       once on the worker: one exists-leading-run query, then
                                       batched reads, each record checked
    admission (KVManager.match)     -> after the L1 match, the run continues through L2 slots
                                       and prefetched L3 pages (waiting for the prefetch at most
                                       until ``prefetch_timeout_s`` after arrival); the pages are
                                       copied into fresh L1 pages and inserted in the tree, the
                                       rest of the prompt is computed

L2 may store pages in a narrower dtype than L1 (``host_dtype``): bfloat16 halves host memory
for a float32 pool, and a page loaded back is then rounded to bfloat16 precision. The default
(``auto``) keeps L1's dtype, so a reloaded page is bit-identical to the computed one. L3 always
stores the L1 dtype (it is part of the key namespace).

Hybrid models (``states``, the model runner's StatePool): a prefix hit is exact only where a
state snapshot of the linear layers exists, so snapshots travel with the pages. A snapshot after
page ``b`` is keyed by :func:`snapshot_key` of page ``b``'s chained key (same namespace):

* L1 snapshot given up (its pages evicted, or the snapshot LRU)  -> copied to an L2 snapshot
  slot (``snapshot_evict_hook``); write_back: a snapshot displaced from L2 goes to L3;
* snapshot taken (``on_snapshot``)  -> write_through: written to L3 at once;
* arrival: the L3 prefetch also looks for the deepest readable snapshot within the pages it
  can reach (an unreadable record is counted, logged and the next earlier one is tried);
* admission (:meth:`TieredKV.plan_hybrid`): the continuation of the L1 pages ends at the
  deepest page boundary whose snapshot L2 or L3 holds; the pages are loaded as usual and the
  snapshot is written into a snapshot slot of the radix tree at that boundary, from which the
  model runner restores it into the request's slot exactly as for an L1 hit.
"""
from __future__ import annotations

import hashlib
import logging
import math
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from tokenmill.cache.storage import StorageBackend, StorageWorker
from tokenmill.cache.tiers import HostIndex, PageKeyer, TierStats

if TYPE_CHECKING:
    from tokenmill.cache.radix import RadixCache
    from tokenmill.engine.request import Request

log = logging.getLogger(__name__)

_MAX_HIT_COUNTS = 1 << 20
_MAX_KNOWN_KEYS = 1 << 21
# Share of --host-cache-memory a hybrid model's L2 gives to state snapshots (the rest: pages).
HOST_SNAPSHOT_SHARE = 0.25


def model_fingerprint(model: torch.nn.Module) -> str:
    """A short digest of the weights (a strided sample of every parameter), so that two
    checkpoints of the same architecture never share KV pages."""
    h = hashlib.blake2b(digest_size=16)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
            flat = p.detach().reshape(-1)
            step = max(flat.numel() // 256, 1)
            sample = flat[::step][:256].to("cpu", torch.float32).contiguous()
            h.update(name.encode())
            h.update(str(tuple(p.shape)).encode())
            h.update(sample.numpy().tobytes())
    return h.hexdigest()


@dataclass
class TierState:
    """Per-request tier bookkeeping (on ``Request.tier_state``)."""

    keys: list[bytes] = field(default_factory=list)   # chained keys of leading whole pages
    prefetch: Any = None              # storage.Prefetch
    prefetch_start: int = 0           # page index of prefetch.keys[0]
    deadline: float = 0.0


@dataclass
class LoadPlan:
    """Pages after the L1 match that another tier can supply, in order."""

    first_page: int
    sources: list[tuple[str, bytes, Any]]   # (tier, key, host slot | payload bytes)

    def __len__(self) -> int:
        return len(self.sources)


def snapshot_key(page_key: bytes) -> bytes:
    """The key of the state snapshot after the page keyed ``page_key`` (same chain, a marker)."""
    return hashlib.blake2b(page_key + b"|tokenmill-state-snapshot", digest_size=len(page_key)).digest()


@dataclass
class HybridPlan:
    """A hybrid model's lower-tier hit: ``pages`` up to ``boundary`` pages and the snapshot there."""

    pages: LoadPlan
    boundary: int = 0                  # pages covered by the snapshot (0: no hit)
    tier: str = ""                     # where the snapshot comes from: l2 or l3
    payload: Any = None                # the snapshot's bytes (copied at planning time)


class TieredKV:
    def __init__(self, kv_caches: list[Any], keyer: PageKeyer, cache: RadixCache, num_pages: int, *,
                 states: Any = None, host_snapshots: int = 0,
                 host_pages: int = 0, host_dtype: torch.dtype | None = None,
                 storage: StorageBackend | None = None, write_policy: str = "write_through",
                 write_min_hits: int = 2, prefetch_timeout_s: float = 1.0,
                 prefetch_min_pages: int = 1, storage_retry_s: float = 2.0) -> None:
        self.kv_caches = kv_caches
        self.keyer = keyer
        self.page_size = keyer.page_size
        self.cache = cache
        self.write_policy = write_policy
        self.write_min_hits = write_min_hits
        self.prefetch_timeout_s = prefetch_timeout_s
        self.prefetch_min_pages = max(prefetch_min_pages, 1)
        self.stats = TierStats()
        self._lock = threading.Lock()   # stats written by the worker thread too
        self.leaves = page_leaves(kv_caches, num_pages)
        first = self.leaves[0].tensor
        self.device = first.device
        self.kv_dtype = first.dtype
        self.num_layers = sum(1 for c in kv_caches if c is not None)
        self.payload_bytes = sum(leaf.page_bytes for leaf in self.leaves)
        # L2: one host tensor per leaf, [slots, *page_shape]; a narrower host dtype applies to
        # floating-point leaves of a single-tensor layout only (never to fp8 bytes or scales)
        self.host: HostIndex | None = None
        self.host_kv: list[torch.Tensor] = []
        plain = all(leaf.tensor.dtype.is_floating_point for leaf in self.leaves) and \
            len(self.leaves) == self.num_layers
        self.host_dtype = host_dtype if (host_dtype is not None and plain) else None
        if host_pages > 0:
            self.host = HostIndex(host_pages)
            pin = self.device.type == "cuda"
            self.host_kv = [torch.zeros((host_pages, *leaf.page_shape), dtype=self.host_dtype or leaf.tensor.dtype,
                                        pin_memory=pin) for leaf in self.leaves]
            self.stats.pages_l2_capacity = host_pages
        # L3
        self.storage = storage
        self.worker: StorageWorker | None = None
        if storage is not None:
            self.worker = StorageWorker(storage, on_error=self._on_storage_error, on_io=self._on_io,
                                        retry_s=storage_retry_s)
        self.l3_known: OrderedDict[bytes, None] = OrderedDict()
        self._hits: OrderedDict[bytes, int] = OrderedDict()
        self._pending: dict[bytes, int] = {}          # key -> L1 page to snapshot for L3
        self._pending_host: list[tuple[bytes, int]] = []  # key -> L2 slot to write back to L3
        cache.evict_hook = self.on_evict
        # Hybrid models: the linear layers' state tensors ([slots, ...] each) and their L2 copies
        self.states = states
        self.state_leaves: list[torch.Tensor] = []
        self.snap_bytes = 0
        self.host_snap: HostIndex | None = None
        self.host_state: list[torch.Tensor] = []
        if states is not None:
            self.state_leaves = [t for pair in zip(states.rec, states.conv) for t in pair if t is not None]
            self.snap_bytes = sum(t[0].numel() * t.element_size() for t in self.state_leaves)
            if host_snapshots > 0:
                self.host_snap = HostIndex(host_snapshots)
                pin = self.device.type == "cuda"
                self.host_state = [torch.zeros((host_snapshots, *t.shape[1:]), dtype=t.dtype, pin_memory=pin)
                                   for t in self.state_leaves]
                self.stats.snapshots_l2_capacity = host_snapshots
            cache.snapshot_evict_hook = self.on_snapshot_evict

    @property
    def host_page_bytes(self) -> int:
        return sum(h[0].numel() * h.element_size() for h in self.host_kv)

    # ---------------------------------------------------------------- stats (thread-safe)
    def _on_storage_error(self, kind: str, message: str) -> None:
        with self._lock:
            self.stats.error(kind)

    def _on_io(self, op: str, nbytes: int, pages: int) -> None:
        with self._lock:
            if op == "read":
                self.stats.bytes_read["l3"] += nbytes
            elif op == "write":
                self.stats.bytes_written["l3"] += nbytes
                self.stats.pages_written["l3"] += pages
            elif op == "present":
                self.stats.l3_skipped_present += pages

    def snapshot_stats(self) -> TierStats:
        with self._lock:
            s = self.stats.snapshot()
        s.pages_l2 = len(self.host) if self.host is not None else 0
        s.pages_l3_known = len(self.l3_known)
        s.snapshots_l2 = len(self.host_snap) if self.host_snap is not None else 0
        if self.worker is not None:
            s.l3_dropped_writes = self.worker.dropped_writes
        return s

    # ---------------------------------------------------------------- keys
    def keys_for(self, req: Request, num_pages: int) -> list[bytes]:
        """The chained keys of ``req``'s first ``num_pages`` pages (computed once, extended)."""
        st = self._state(req)
        if len(st.keys) < num_pages:
            start = len(st.keys)
            P = self.page_size
            toks = req.all_token_ids[:num_pages * P]
            if start == 0:
                st.keys = self.keyer.keys(toks)
            else:
                st.keys.extend(_chain(self.keyer, st.keys[-1], toks[start * P:]))
        return st.keys[:num_pages]

    def _state(self, req: Request) -> TierState:
        if req.tier_state is None:
            req.tier_state = TierState()
        return req.tier_state

    def _remember_l3(self, key: bytes) -> None:
        self.l3_known[key] = None
        if len(self.l3_known) > _MAX_KNOWN_KEYS:
            self.l3_known.popitem(last=False)

    # ---------------------------------------------------------------- arrival and admission
    def on_arrival(self, req: Request) -> None:
        """Start the L3 prefetch of ``req``'s pages beyond what L1 and L2 hold."""
        if self.worker is None or not self.worker.available:
            return
        P = self.page_size
        usable = (len(req.all_token_ids) - 1) // P
        if usable <= 0:
            return
        keys = self.keys_for(req, usable)
        toks = req.all_token_ids
        if self.states is not None:   # hybrid: L1 pages wherever the snapshots are, then L2
            snap = self.cache.cached_prefix_length(toks, usable * P) // P
            l1 = self.cache.page_prefix_length(toks, usable * P) // P
        else:
            l1 = self.cache.cached_prefix_length(toks, usable * P) // P   # a pure probe
        start = l1 + (self.host.leading_run(keys[l1:]) if self.host is not None else 0)
        st = self._state(req)
        if self.states is not None:
            if snap >= usable:
                return
            # the snapshots of boundaries snap+1 .. usable (the worker reads the deepest reachable)
            st.prefetch = self.worker.prefetch(keys[start:], self.payload_bytes, page_start=start,
                                               snap_keys=[snapshot_key(k) for k in keys[snap:]],
                                               snap_first=snap + 1, snap_bytes=self.snap_bytes)
        elif usable - start < self.prefetch_min_pages:
            return
        else:
            st.prefetch = self.worker.prefetch(keys[start:], self.payload_bytes)
        st.prefetch_start = start
        st.deadline = st.prefetch.started + self.prefetch_timeout_s

    def plan(self, req: Request, l1_pages: int, max_pages: int, *, finish: bool = True) -> LoadPlan:
        """Pages ``l1_pages .. max_pages-1`` of ``req`` that L2 or L3 can supply (a leading run)."""
        plan = LoadPlan(l1_pages, [])
        if max_pages <= l1_pages:
            if finish:
                self._finish_prefetch(req)
            return plan
        keys = self.keys_for(req, max_pages)
        st = self._state(req)
        pf = st.prefetch
        i = l1_pages
        while i < max_pages:
            key = keys[i]
            slot = self.host.get(key) if self.host is not None else None
            if slot is not None:
                plan.sources.append(("l2", key, slot))
                i += 1
                continue
            payload = self._prefetched(st, i) if pf is not None else None
            if payload is None:
                break
            plan.sources.append(("l3", key, payload))
            i += 1
        if finish:
            self._finish_prefetch(req)
        return plan

    def plan_hybrid(self, req: Request, l1_pages: int, snap_pages: int, max_pages: int) -> HybridPlan:
        """A hybrid model's lower-tier hit for ``req``: L1 holds ``l1_pages`` pages and its deepest
        snapshot covers ``snap_pages``; the hit ends at the deepest boundary past ``snap_pages``
        within the L1 + L2 + L3 pages whose snapshot L2 or L3 holds (``boundary`` 0: none)."""
        pages = self.plan(req, l1_pages, max_pages, finish=False)
        reach = l1_pages + len(pages)
        out = HybridPlan(pages)
        st = self._state(req)
        l3: tuple[int, bytes] | None = None
        if st.prefetch is not None:
            pf = st.prefetch
            self._wait_done(st)
            if pf.done.is_set():
                l3 = pf.snapshot
                if pf.snapshot_fallbacks:
                    with self._lock:
                        self.stats.snapshot_fallbacks += pf.snapshot_fallbacks
                    pf.snapshot_fallbacks = 0
        if reach > snap_pages:
            keys = self.keys_for(req, reach)
            for b in range(reach, snap_pages, -1):
                key = snapshot_key(keys[b - 1])
                slot = self.host_snap.get(key) if self.host_snap is not None else None
                if slot is not None:
                    out.boundary, out.tier = b, "l2"
                    out.payload = _as_bytes([h[slot:slot + 1] for h in self.host_state])[0]
                    break
                if l3 is not None and l3[0] == b:
                    out.boundary, out.tier, out.payload = b, "l3", l3[1]
                    self._remember_l3(key)
                    break
        if out.boundary > l1_pages:
            del pages.sources[out.boundary - l1_pages:]
        else:
            pages.sources.clear()
        self._finish_prefetch(req)
        return out

    def _wait_done(self, st: TierState) -> None:
        """Wait for ``st``'s prefetch to finish, at most until its deadline (counted once)."""
        pf = st.prefetch
        while not pf.done.is_set():
            left = st.deadline - time.monotonic()
            if left <= 0:
                if st.deadline:
                    with self._lock:
                        self.stats.prefetch_timeouts += 1
                    st.deadline = 0.0
                return
            pf.done.wait(min(left, 0.005))

    def restore_snapshot(self, plan: HybridPlan, slot: int) -> None:
        """Write ``plan``'s snapshot into state-pool ``slot`` (a snapshot slot of the tree)."""
        payload = plan.payload
        if isinstance(payload, torch.Tensor):
            data = payload
        else:
            data = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        off = 0
        for t in self.state_leaves:
            n = t[0].numel() * t.element_size()
            part = data[off:off + n].contiguous().view(t.dtype).reshape(t.shape[1:])
            t[slot].copy_(part.to(t.device))
            off += n
        with self._lock:
            self.stats.snapshot_hits[plan.tier] += 1

    def _prefetched(self, st: TierState, page: int) -> bytes | None:
        pf = st.prefetch
        j = page - st.prefetch_start
        if j < 0 or j >= len(pf.keys):
            return None
        while len(pf.payloads) <= j:
            if pf.done.is_set():
                return None
            if pf.run is not None and j >= pf.run:
                return None
            left = st.deadline - time.monotonic()
            if left <= 0:
                with self._lock:
                    self.stats.prefetch_timeouts += 1
                st.deadline = 0.0  # count the timeout once
                return None
            pf.done.wait(min(left, 0.005))
        return pf.payloads[j]

    def _finish_prefetch(self, req: Request) -> None:
        st = req.tier_state
        if st is None or st.prefetch is None:
            return
        pf = st.prefetch
        pf.cancelled = True
        end = pf.finished_at if pf.finished_at is not None else time.monotonic()
        with self._lock:
            self.stats.prefetch_seconds_sum += end - pf.started
            self.stats.prefetch_count += 1
        for key in pf.keys[:len(pf.payloads)]:
            self._remember_l3(key)
        if pf.snapshot is not None:
            self._remember_l3(pf.snap_keys[pf.snapshot[0] - pf.snap_first])
        st.prefetch = None

    def load(self, plan: LoadPlan, pages: list[int]) -> dict[str, int]:
        """Copy ``plan``'s pages into the L1 ``pages`` (same order); returns pages per tier.

        Stops at the first planned L2 slot that was reused since planning (the run is leading,
        so what follows it is computed). ``pages`` beyond the returned count stay unused.
        """
        n2 = 0
        l2_pages: list[int] = []
        l2_slots: list[int] = []
        l3_pages: list[int] = []
        l3_payloads: list[bytes] = []
        count = 0
        for (tier, key, src), page in zip(plan.sources, pages):
            if tier == "l2":
                assert self.host is not None
                if self.host.get(key, touch=False) != src:
                    break
                l2_pages.append(page)
                l2_slots.append(src)
                n2 += 1
            else:
                l3_pages.append(page)
                l3_payloads.append(src)
            count += 1
        t0 = time.perf_counter()
        if l2_pages:
            self._copy_from_host(l2_slots, l2_pages)
        t1 = time.perf_counter()
        if l3_pages:
            self._write_payloads(l3_payloads, l3_pages)
        t2 = time.perf_counter()
        with self._lock:
            s = self.stats
            s.load_seconds["l2"] += t1 - t0
            s.load_seconds["l3"] += t2 - t1
            s.bytes_read["l2"] += len(l2_pages) * self.host_page_bytes
        return {"l2": len(l2_pages), "l3": len(l3_pages)}

    def record_hits(self, req: Request, by_tier: dict[str, int]) -> None:
        """First admission of ``req``: count hits per tier; selective write-through counting."""
        with self._lock:
            for tier, pages in by_tier.items():
                self.stats.hit_pages[tier] += pages
                self.stats.hit_tokens[tier] += pages * self.page_size
        if self.worker is not None and self.write_policy == "write_through_selective":
            n = sum(by_tier.values())
            keys = self.keys_for(req, n)
            for i, key in enumerate(keys):
                c = self._hits.get(key, 0) + 1
                self._hits[key] = c
                self._hits.move_to_end(key)
                if c >= self.write_min_hits and key not in self.l3_known:
                    self._pending[key] = req.page_table[i]
            snap = req.snapshot_restore
            if self.states is not None and snap is not None and n and self._hits.get(keys[-1], 0) >= self.write_min_hits:
                skey = snapshot_key(keys[-1])   # the snapshot the hit restores goes with its pages
                if skey not in self.l3_known:
                    self._send_snapshots([skey], self._gather_state([snap]))
            while len(self._hits) > _MAX_HIT_COUNTS:
                self._hits.popitem(last=False)

    # ---------------------------------------------------------------- writes
    def on_computed(self, req: Request, start: int, end: int) -> None:
        """``req``'s pages ``start .. end-1`` were just computed and cached in L1."""
        if self.worker is None or self.write_policy != "write_through" or end <= start:
            return
        keys = self.keys_for(req, end)
        for i in range(start, end):
            key = keys[i]
            if key not in self.l3_known:
                self._pending[key] = req.page_table[i]

    def on_evict(self, prefix_tokens: tuple[int, ...], pages: list[int]) -> None:
        """Radix eviction hook: demote ``pages`` (the tail of ``prefix_tokens``) before reuse."""
        if not pages:
            return
        if self._pending:
            self.end_step()  # queued write-through snapshots must read the pages first
        n_prefix = len(prefix_tokens) // self.page_size
        keys = self.keyer.keys(prefix_tokens, n_prefix)[n_prefix - len(pages):]
        if self.host is None:
            if self.worker is not None and self.write_policy == "write_back":
                todo = [(k, p) for k, p in zip(keys, pages) if k not in self.l3_known]
                if todo:
                    self._send_l1([k for k, _ in todo], [p for _, p in todo])
            return
        slots: list[int] = []
        srcs: list[int] = []
        for key, page in zip(keys, pages):
            if key in self.host:
                self.host.get(key)   # already demoted once (L2 is inclusive): refresh recency
                continue
            slot, displaced = self.host.put(key)
            if displaced is not None and self.worker is not None and self.write_policy == "write_back" \
                    and displaced[0] not in self.l3_known:
                self._pending_host.append(displaced)
            slots.append(slot)
            srcs.append(page)
        if self._pending_host:
            self._flush_pending_host()   # read the displaced slots before they are overwritten
        if slots:
            self._copy_to_host(srcs, slots)

    def on_snapshot(self, req: Request, num_pages: int, slot: int) -> None:
        """A snapshot of ``req``'s state after ``num_pages`` pages was just taken into ``slot``."""
        if self.worker is None or self.write_policy != "write_through":
            return
        key = snapshot_key(self.keys_for(req, num_pages)[-1])
        if key not in self.l3_known:
            self._send_snapshots([key], self._gather_state([slot]))

    def on_snapshot_evict(self, prefix_tokens: tuple[int, ...], slot: int) -> None:
        """Radix hook: the L1 snapshot in ``slot`` after ``prefix_tokens`` is given up; keep it in
        L2 (write_back without L2: in L3)."""
        n = len(prefix_tokens) // self.page_size
        key = snapshot_key(self.keyer.keys(prefix_tokens, n)[-1])
        if self.host_snap is None:
            if self.worker is not None and self.write_policy == "write_back" and key not in self.l3_known:
                self._send_snapshots([key], self._gather_state([slot]))
            return
        if key in self.host_snap:
            self.host_snap.get(key)
            return
        hslot, displaced = self.host_snap.put(key)
        if displaced is not None and self.worker is not None and self.write_policy == "write_back" \
                and displaced[0] not in self.l3_known:
            d = displaced[1]
            self._send_snapshots([displaced[0]], _as_bytes([h[d:d + 1] for h in self.host_state]))
        for t, h in zip(self.state_leaves, self.host_state):
            h[hslot].copy_(t[slot].to("cpu"))
        with self._lock:
            self.stats.snapshots_written["l2"] += 1
            self.stats.bytes_written["l2"] += self.snap_bytes

    def _gather_state(self, slots: list[int]) -> torch.Tensor:
        idx = torch.tensor(slots, dtype=torch.long, device=self.device)
        return _as_bytes([t.index_select(0, idx).cpu() for t in self.state_leaves])

    def _send_snapshots(self, keys: list[bytes], data: torch.Tensor) -> None:
        self._send(keys, data)
        with self._lock:
            self.stats.snapshots_written["l3"] += len(keys)

    def end_step(self) -> None:
        """Snapshot queued pages and hand them to the storage worker (once per engine step)."""
        if not self._pending:
            return
        keys = list(self._pending)
        pages = list(self._pending.values())
        self._pending.clear()
        self._send_l1(keys, pages)

    def _send_l1(self, keys: list[bytes], pages: list[int]) -> None:
        assert self.worker is not None
        data = self._gather_payload(pages)
        self._send(keys, data)

    def _flush_pending_host(self) -> None:
        items = self._pending_host
        self._pending_host = []
        keys = [k for k, _ in items]
        idx = torch.tensor([s for _, s in items], dtype=torch.long)
        # the L3 record holds the L1 dtype, whatever the host dtype
        parts = [h.index_select(0, idx).to(leaf.tensor.dtype) for h, leaf in zip(self.host_kv, self.leaves)]
        self._send(keys, _as_bytes(parts))

    def _send(self, keys: list[bytes], data: torch.Tensor) -> None:
        """``data``: [n, payload_bytes] uint8 on the CPU, a fresh snapshot."""
        # ``data`` is a fresh snapshot owned by nobody else: the worker reads its rows in place
        # and builds the records (copy + checksum) off the engine thread.
        raw = data.numpy()
        if self.worker is not None and self.worker.write([(k, raw[i]) for i, k in enumerate(keys)],
                                                         encoded=False):
            for k in keys:
                self._remember_l3(k)

    # ---------------------------------------------------------------- copies
    def _gather_payload(self, pages: list[int]) -> torch.Tensor:
        """[n, payload_bytes] uint8 on the CPU: every leaf's page, in leaf order, as stored."""
        idx = torch.tensor(pages, dtype=torch.long, device=self.device)
        return _as_bytes([leaf.tensor.index_select(leaf.page_dim, idx).movedim(leaf.page_dim, 0).cpu()
                          for leaf in self.leaves])

    def _copy_to_host(self, pages: list[int], slots: list[int]) -> None:
        idx = torch.tensor(pages, dtype=torch.long, device=self.device)
        sidx = torch.tensor(slots, dtype=torch.long)
        for leaf, host in zip(self.leaves, self.host_kv):
            src = leaf.tensor.index_select(leaf.page_dim, idx).movedim(leaf.page_dim, 0)
            host.index_copy_(0, sidx, src.to("cpu", host.dtype))
        with self._lock:
            self.stats.bytes_written["l2"] += len(pages) * self.host_page_bytes
            self.stats.pages_written["l2"] += len(pages)

    def _copy_from_host(self, slots: list[int], pages: list[int]) -> None:
        idx = torch.tensor(pages, dtype=torch.long, device=self.device)
        sidx = torch.tensor(slots, dtype=torch.long)
        for leaf, host in zip(self.leaves, self.host_kv):
            src = host.index_select(0, sidx).to(self.device, leaf.tensor.dtype, non_blocking=True)
            leaf.tensor.index_copy_(leaf.page_dim, idx, src.movedim(0, leaf.page_dim))

    def _write_payloads(self, payloads: list[bytes], pages: list[int]) -> None:
        n = len(pages)
        data = torch.frombuffer(bytearray(b"".join(payloads)), dtype=torch.uint8).reshape(n, self.payload_bytes)
        idx = torch.tensor(pages, dtype=torch.long, device=self.device)
        off = 0
        for leaf in self.leaves:
            part = data[:, off:off + leaf.page_bytes].contiguous().view(leaf.tensor.dtype)
            part = part.reshape(n, *leaf.page_shape).to(self.device)
            leaf.tensor.index_copy_(leaf.page_dim, idx, part.movedim(0, leaf.page_dim))
            off += leaf.page_bytes

    # ---------------------------------------------------------------- admin
    def flush_host(self) -> None:
        """Empty L2 (with L1, on /flush_cache); queued L3 writes of L1 pages are dropped."""
        self._pending.clear()
        self._pending_host.clear()
        if self.host is not None:
            self.host.clear()
        if self.host_snap is not None:
            self.host_snap.clear()
        self._hits.clear()

    def flush_storage(self) -> int:
        """Delete this model's pages from L3; returns how many were deleted."""
        if self.worker is None:
            return 0
        self.worker.drain()
        n = int(self.worker.call(self.worker.backend.flush_namespace))  # type: ignore[arg-type]
        self.l3_known.clear()
        return n

    def drain(self, timeout: float = 30.0) -> bool:
        self.end_step()
        return self.worker.drain(timeout) if self.worker is not None else True

    def close(self) -> None:
        if self.worker is not None:
            try:
                self.end_step()
            finally:
                self.worker.close()
                self.worker = None


@dataclass
class PageLeaf:
    """One tensor of the KV pool with a page dimension (a layer's K/V, MLA latent, fp8 scales)."""

    tensor: torch.Tensor
    page_dim: int

    @property
    def page_shape(self) -> tuple[int, ...]:
        shape = list(self.tensor.shape)
        del shape[self.page_dim]
        return tuple(shape)

    @property
    def page_bytes(self) -> int:
        return math.prod(self.page_shape) * self.tensor.element_size()


def page_leaves(kv_caches: list[Any], num_pages: int) -> list[PageLeaf]:
    """The pool's tensors and their page dimension: dense K/V ``[2, N, P, H, D]`` (dim 1), MLA
    latents ``[N, P, E]`` (dim 0); fp8 pages are (bytes, scales) pairs with the same rule."""
    leaves: list[PageLeaf] = []
    for entry in kv_caches:
        if entry is None:                     # a hybrid model's linear layer (state pool)
            continue
        tensors = [entry] if isinstance(entry, torch.Tensor) else list(entry)
        for t in tensors:
            if not isinstance(t, torch.Tensor):
                raise ValueError(f"the tiered KV cache cannot copy pages of a {type(t).__name__}")
            if t.dim() >= 4 and t.shape[0] == 2 and t.shape[1] == num_pages:
                dim = 1                       # [2 (K, V), N, ...]
            elif t.dim() >= 2 and t.shape[0] == num_pages:
                dim = 0
            else:
                raise ValueError(f"cannot find the page dimension of a KV tensor of shape {tuple(t.shape)}")
            leaves.append(PageLeaf(t, dim))
    if not leaves:
        raise ValueError("the KV pool has no tensors")
    return leaves


def _as_bytes(parts: list[torch.Tensor]) -> torch.Tensor:
    """[n, ...] tensors -> one [n, sum of bytes per row] uint8 tensor (a fresh copy)."""
    n = parts[0].shape[0]
    return torch.cat([p.contiguous().view(torch.uint8).reshape(n, -1) for p in parts], dim=1)


def _chain(keyer: PageKeyer, parent: bytes, tokens: list[int]) -> list[bytes]:
    """Keys of ``tokens``' whole pages continuing the chain after ``parent``."""
    sub = PageKeyer(parent, keyer.page_size)
    return sub.keys(tokens)


def build_tiers(config: Any, runner: Any, kv: Any, model_name: str, kv_spec: Any) -> TieredKV | None:
    """The engine's lower tiers from its :class:`~tokenmill.engine.config.EngineConfig`, or None."""
    from tokenmill.cache.storage import open_storage
    from tokenmill.cache.tiers import make_namespace

    storage_spec = config.cache_storage or "none"
    if config.host_cache_memory_gib <= 0 and storage_spec == "none":
        return None
    if kv.cache is None:
        raise ValueError("the host and storage cache tiers need the prefix cache")
    kv_caches = runner.kv_caches
    num_pages = kv.pool.num_pages
    leaves = page_leaves(kv_caches, num_pages)
    layout = "|".join(f"{tuple(l.page_shape)}:{l.page_dim}:{l.tensor.dtype}" for l in leaves) + \
        f"|{kv_spec.layers!r}"
    identity = f"{model_name}|{model_fingerprint(runner.model)}"
    namespace = make_namespace(identity, layout, str(kv_spec.dtype), config.page_size)
    keyer = PageKeyer(namespace, config.page_size)
    host_dtype = None if config.host_cache_dtype == "auto" else getattr(torch, config.host_cache_dtype)
    plain = all(l.tensor.dtype.is_floating_point for l in leaves) and \
        len(leaves) == sum(1 for c in kv_caches if c is not None)
    host_page_bytes = sum(math.prod(l.page_shape) * (torch.empty((), dtype=host_dtype).element_size()
                                                     if (host_dtype is not None and plain) else l.tensor.element_size())
                          for l in leaves)
    host_bytes = config.host_cache_memory_gib * 2**30
    states = getattr(runner, "states", None)
    host_snapshots = 0
    if states is not None and host_bytes > 0:
        # a hybrid model's L2 keeps the state snapshots beside the pages (a fixed share)
        snap_bytes = states.bytes_per_slot
        host_snapshots = max(int(host_bytes * HOST_SNAPSHOT_SHARE // snap_bytes), 1)
        host_bytes = max(host_bytes - host_snapshots * snap_bytes, 0)
    host_pages = int(host_bytes // host_page_bytes)
    if config.host_cache_memory_gib > 0 and host_pages < 1:
        raise ValueError(f"host_cache_memory_gib={config.host_cache_memory_gib} holds no page of "
                         f"{host_page_bytes} bytes")
    from tokenmill.cache.storage import StorageError

    try:
        storage = open_storage(storage_spec, namespace, timeout_s=config.cache_storage_timeout_s)
    except StorageError as e:
        raise ValueError(f"--cache-storage {storage_spec}: {e}") from None
    tiers = TieredKV(kv_caches, keyer, kv.cache, num_pages, states=states, host_snapshots=host_snapshots,
                     host_pages=host_pages, host_dtype=host_dtype,
                     storage=storage, write_policy=config.cache_write_policy,
                     write_min_hits=config.cache_write_min_hits,
                     prefetch_timeout_s=config.cache_prefetch_timeout_s,
                     prefetch_min_pages=config.cache_prefetch_min_pages)
    log.info("KV tiers: L2 %d host pages (%s, %.2f GiB), L3 %s, policy %s, namespace %s",
             host_pages, str(tiers.host_dtype or tiers.kv_dtype).removeprefix("torch."),
             host_pages * host_page_bytes / 2**30, storage.url if storage else "none",
             config.cache_write_policy, namespace.hex()[:12])
    if states is not None:
        log.info("KV tiers: state snapshots of %d B travel with the pages; L2 holds %d of them",
                 tiers.snap_bytes, host_snapshots)
    return tiers
