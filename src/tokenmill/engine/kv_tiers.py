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

Tensor parallelism: every rank holds its own shard of every page. The decisions above (keys,
the L2 index, prefetches, what to write) stay in the scheduler process; each copy becomes an op
(:class:`RemotePages`) shipped with the next step description and replayed by every rank on its
shard, in the same order, before the step's forward (:func:`run_page_ops`). Each rank has its own
L2 slots (same slot ids everywhere). Each distinct shard of a page is written to L3 by one rank,
under that rank's namespace (:func:`rank_namespace`); ranks holding the same bytes (a replicated
KV head, the MLA latent) share that copy. A page is an L3 hit only when every shard's record of it
is present and valid (:class:`~tokenmill.cache.storage.RankShardedStorage`, read here), and each
rank is sent only its shard of the payload.

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
# Default share of --host-cache-memory a hybrid model's L2 gives to state snapshots (the rest:
# pages); EngineConfig.host_cache_snapshot_share sets it.
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
    """The tier decisions (which page goes where, keys, prefetches) over a page mover: the
    :class:`LocalPages` of this process's pool, or with tensor parallelism a
    :class:`RemotePages` that ships the same copies to every rank (each moves its own shard)."""

    def __init__(self, mover: LocalPages | RemotePages, keyer: PageKeyer, cache: RadixCache, *,
                 states: Any = None, host_snapshots: int = 0,
                 storage: StorageBackend | None = None, write_policy: str = "write_through",
                 write_min_hits: int = 2, prefetch_timeout_s: float = 1.0,
                 prefetch_min_pages: int = 1, storage_retry_s: float = 2.0) -> None:
        self.mover = mover
        self.keyer = keyer
        self.page_size = keyer.page_size
        self.cache = cache
        self.write_policy = write_policy
        self.write_min_hits = write_min_hits
        self.prefetch_timeout_s = prefetch_timeout_s
        self.prefetch_min_pages = max(prefetch_min_pages, 1)
        self.stats = TierStats()
        self._lock = threading.Lock()   # stats written by the worker thread too
        self.payload_bytes = mover.payload_bytes
        self.host: HostIndex | None = None
        if mover.host_pages > 0:
            self.host = HostIndex(mover.host_pages)
            self.stats.pages_l2_capacity = mover.host_pages
        # L3: this worker reads (prefetch) and, in process, writes; with tensor parallelism the
        # ranks write their shards themselves and this worker reads all ranks' records of a page
        self.storage = storage
        self.worker: StorageWorker | None = None
        if storage is not None:
            self.worker = StorageWorker(storage, on_error=self._on_storage_error, on_io=self._on_io,
                                        retry_s=storage_retry_s)
            mover.attach_writer(self.worker)
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
                pin = states.device.type == "cuda"
                self.host_state = [torch.zeros((host_snapshots, *t.shape[1:]), dtype=t.dtype, pin_memory=pin)
                                   for t in self.state_leaves]
                self.stats.snapshots_l2_capacity = host_snapshots
            cache.snapshot_evict_hook = self.on_snapshot_evict

    @property
    def host_dtype(self) -> torch.dtype | None:
        return self.mover.host_dtype

    @property
    def kv_dtype(self) -> torch.dtype:
        return self.mover.kv_dtype

    @property
    def host_page_bytes(self) -> int:
        return self.mover.host_page_bytes

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
        for name, (nbytes, pages, present, dropped) in self.mover.writer_counts().items():
            s.bytes_written[name] += nbytes
            s.pages_written[name] += pages
            s.l3_skipped_present += present
            s.l3_dropped_writes += dropped
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
            self.mover.from_host(l2_slots, l2_pages)
        t1 = time.perf_counter()
        if l3_pages:
            self.mover.load_payloads(l3_payloads, l3_pages)
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
            if self.states is not None and snap is not None and n \
                    and self._hits.get(keys[-1], 0) >= self.write_min_hits:
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
            self.mover.to_host(srcs, slots)
            with self._lock:
                self.stats.bytes_written["l2"] += len(srcs) * self.host_page_bytes
                self.stats.pages_written["l2"] += len(srcs)

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
        idx = torch.tensor(slots, dtype=torch.long, device=self.states.device)
        return _as_bytes([t.index_select(0, idx).cpu() for t in self.state_leaves])

    def _send_snapshots(self, keys: list[bytes], data: torch.Tensor) -> None:
        """Queue snapshots (``data``: [n, snap_bytes] uint8 on the CPU, a fresh copy) for L3."""
        if self.worker is None:
            return
        raw = data.numpy()
        if self.worker.write([(k, raw[i]) for i, k in enumerate(keys)], encoded=False):
            for k in keys:
                self._remember_l3(k)
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
        if self.mover.write_l1(keys, pages):
            for k in keys:
                self._remember_l3(k)

    def _flush_pending_host(self) -> None:
        items = self._pending_host
        self._pending_host = []
        keys = [k for k, _ in items]
        if self.mover.write_host(keys, [s for _, s in items]):   # read before the slots are reused
            for k in keys:
                self._remember_l3(k)

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
        self.end_step()
        self.mover.sync(30.0)      # tensor parallelism: the ranks' queued writes land first
        self.worker.drain()
        n = int(self.worker.call(self.worker.backend.flush_namespace))  # type: ignore[arg-type]
        self.l3_known.clear()
        return n

    def drain(self, timeout: float = 30.0) -> bool:
        self.end_step()
        ok = self.mover.sync(timeout)
        return (self.worker.drain(timeout) if self.worker is not None else True) and ok

    def close(self) -> None:
        if self.worker is not None:
            try:
                self.end_step()
                self.mover.sync(30.0)
            finally:
                self.worker.close()
                self.worker = None


class LocalPages:
    """The tier copies on this process's KV pool (``kv_caches``): L1 pages to and from L2 slots
    (host tensors it owns), L1 snapshots to L3 through a storage worker, L3 payloads into L1.
    A tensor-parallel rank runs one over its own shard (see :func:`run_page_ops`)."""

    def __init__(self, kv_caches: list[Any], num_pages: int, host_pages: int = 0,
                 host_dtype: torch.dtype | None = None) -> None:
        self.leaves = page_leaves(kv_caches, num_pages)
        first = self.leaves[0].tensor
        self.device = first.device
        self.kv_dtype = first.dtype
        self.payload_bytes = sum(leaf.page_bytes for leaf in self.leaves)
        # a narrower host dtype applies to floating-point leaves of a single-tensor layout only
        # (never to fp8 bytes or scales)
        plain = all(leaf.tensor.dtype.is_floating_point for leaf in self.leaves) and \
            len(self.leaves) == sum(1 for c in kv_caches if c is not None)
        self.host_dtype = host_dtype if (host_dtype is not None and plain) else None
        self.host_pages = host_pages
        pin = self.device.type == "cuda"
        self.host_kv = [torch.zeros((host_pages, *leaf.page_shape), dtype=self.host_dtype or leaf.tensor.dtype,
                                    pin_memory=pin) for leaf in self.leaves] if host_pages > 0 else []
        self.host_page_bytes = sum(h[0].numel() * h.element_size() for h in self.host_kv)
        self.writer: StorageWorker | None = None

    def attach_writer(self, worker: StorageWorker) -> None:
        self.writer = worker

    def writer_counts(self) -> dict[str, tuple[int, int, int, int]]:
        return {}   # the writer reports to the TieredKV's own stats

    def sync(self, timeout: float) -> bool:
        return True

    def write_l1(self, keys: list[bytes], pages: list[int]) -> bool:
        """Snapshot L1 ``pages`` and queue them for L3 under ``keys``; False when dropped."""
        if self.writer is None or not keys:
            return False
        return self._send(keys, self._gather_payload(pages))

    def write_host(self, keys: list[bytes], slots: list[int]) -> bool:
        """Queue L2 ``slots`` for L3 (in the L1 dtype, whatever the host dtype)."""
        if self.writer is None or not keys:
            return False
        idx = torch.tensor(slots, dtype=torch.long)
        parts = [h.index_select(0, idx).to(leaf.tensor.dtype) for h, leaf in zip(self.host_kv, self.leaves)]
        return self._send(keys, _as_bytes(parts))

    def _send(self, keys: list[bytes], data: torch.Tensor) -> bool:
        """``data``: [n, payload_bytes] uint8 on the CPU, a fresh snapshot owned by nobody else:
        the worker reads its rows in place and builds the records (copy + checksum) off the
        engine thread."""
        assert self.writer is not None
        raw = data.numpy()
        return self.writer.write([(k, raw[i]) for i, k in enumerate(keys)], encoded=False)

    def _gather_payload(self, pages: list[int]) -> torch.Tensor:
        """[n, payload_bytes] uint8 on the CPU: every leaf's page, in leaf order, as stored."""
        idx = torch.tensor(pages, dtype=torch.long, device=self.device)
        return _as_bytes([leaf.tensor.index_select(leaf.page_dim, idx).movedim(leaf.page_dim, 0).cpu()
                          for leaf in self.leaves])

    def to_host(self, pages: list[int], slots: list[int]) -> None:
        idx = torch.tensor(pages, dtype=torch.long, device=self.device)
        sidx = torch.tensor(slots, dtype=torch.long)
        for leaf, host in zip(self.leaves, self.host_kv):
            src = leaf.tensor.index_select(leaf.page_dim, idx).movedim(leaf.page_dim, 0)
            host.index_copy_(0, sidx, src.to("cpu", host.dtype))

    def from_host(self, slots: list[int], pages: list[int]) -> None:
        idx = torch.tensor(pages, dtype=torch.long, device=self.device)
        sidx = torch.tensor(slots, dtype=torch.long)
        for leaf, host in zip(self.leaves, self.host_kv):
            src = host.index_select(0, sidx).to(self.device, leaf.tensor.dtype, non_blocking=True)
            leaf.tensor.index_copy_(leaf.page_dim, idx, src.movedim(0, leaf.page_dim))

    def load_payloads(self, payloads: list[bytes], pages: list[int]) -> None:
        n = len(pages)
        data = torch.frombuffer(bytearray(b"".join(payloads)), dtype=torch.uint8).reshape(n, self.payload_bytes)
        idx = torch.tensor(pages, dtype=torch.long, device=self.device)
        off = 0
        for leaf in self.leaves:
            part = data[:, off:off + leaf.page_bytes].contiguous().view(leaf.tensor.dtype)
            part = part.reshape(n, *leaf.page_shape).to(self.device)
            leaf.tensor.index_copy_(leaf.page_dim, idx, part.movedim(0, leaf.page_dim))
            off += leaf.page_bytes


class RemotePages:
    """The tier copies of a tensor-parallel replica: each call becomes an op in a list that the
    :class:`~tokenmill.engine.parallel.ParallelRunner` ships with the next step description (or
    at :meth:`sync`); every rank replays the ops in order on its own shard before the step's
    forward (:func:`run_page_ops`), which is the order they happen in one process. L3 writes are
    made by the ranks, each distinct shard by its owner into the owner's namespace (ranks that
    hold the same bytes, as with a replicated KV head or the MLA latent, share one copy); an L3
    payload read here (every shard's record of a page, joined) is split so each rank receives
    only its shard."""

    def __init__(self, runner: Any, shard_payload_bytes: list[int], shard_of_rank: list[int], host_pages: int,
                 host_page_bytes: int, kv_dtype: torch.dtype, host_dtype: torch.dtype | None) -> None:
        """``shard_payload_bytes``: one page's bytes of each distinct KV shard (the L3 payload is
        their concatenation); ``shard_of_rank[r]``: the shard rank ``r`` holds."""
        self.runner = runner
        self.shard_payload_bytes = shard_payload_bytes
        self.shard_of_rank = shard_of_rank
        self.payload_bytes = sum(shard_payload_bytes)
        self.host_pages = host_pages
        self.host_page_bytes = host_page_bytes        # all ranks' slots of one page together
        self.kv_dtype = kv_dtype
        self.host_dtype = host_dtype
        self.ops: list[tuple[Any, ...]] = []
        self.rank_data: list[list[list[bytes]]] = [[] for _ in shard_of_rank]
        self.writes = False
        self._counts: dict[str, tuple[int, int, int, int]] = {}
        runner.page_ops = self   # the runner takes the queued ops with every step

    def attach_writer(self, worker: StorageWorker) -> None:
        self.writes = True   # the ranks opened their own writers (runner.init_tiers)

    def take(self) -> tuple[list[tuple[Any, ...]], list[list[list[bytes]]]]:
        """The queued ops and each rank's L3 payloads (emptied)."""
        ops, data = self.ops, self.rank_data
        self.ops, self.rank_data = [], [[] for _ in self.shard_of_rank]
        return ops, data

    def sync(self, timeout: float) -> bool:
        """Run the queued ops on every rank now and wait for the ranks' L3 writes."""
        from tokenmill.contracts.errors import ReplicaFailedError

        try:
            ok, counts = self.runner.sync_tiers(timeout)
        except ReplicaFailedError:
            return False   # already logged; the replica is down
        if counts:
            self._counts = counts
        return ok

    def writer_counts(self) -> dict[str, tuple[int, int, int, int]]:
        return self._counts

    def write_l1(self, keys: list[bytes], pages: list[int]) -> bool:
        if not self.writes or not keys:
            return False
        self.ops.append(("write_l1", keys, pages))
        return True

    def write_host(self, keys: list[bytes], slots: list[int]) -> bool:
        if not self.writes or not keys:
            return False
        self.ops.append(("write_host", keys, slots))
        return True

    def to_host(self, pages: list[int], slots: list[int]) -> None:
        self.ops.append(("to_host", pages, slots))

    def from_host(self, slots: list[int], pages: list[int]) -> None:
        self.ops.append(("from_host", slots, pages))

    def load_payloads(self, payloads: list[bytes], pages: list[int]) -> None:
        starts = [sum(self.shard_payload_bytes[:i]) for i in range(len(self.shard_payload_bytes))]
        for r, i in enumerate(self.shard_of_rank):
            a, n = starts[i], self.shard_payload_bytes[i]
            self.rank_data[r].append([p[a:a + n] for p in payloads])
        self.ops.append(("load", len(self.rank_data[0]) - 1, pages))


def run_page_ops(pages: LocalPages, ops: list[tuple[Any, ...]], data: list[list[bytes]]) -> None:
    """Replay :class:`RemotePages` ops on one rank's shard (``data``: this rank's L3 payloads)."""
    for op in ops:
        kind = op[0]
        if kind == "to_host":
            pages.to_host(op[1], op[2])
        elif kind == "from_host":
            pages.from_host(op[1], op[2])
        elif kind == "load":
            pages.load_payloads(data[op[1]], op[2])
        elif kind == "write_l1":
            pages.write_l1(op[1], op[2])
        elif kind == "write_host":
            pages.write_host(op[1], op[2])
        else:
            raise ValueError(f"unknown page op {kind!r}")


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
    latents ``[N, P, E]`` (dim 0); fp8 pages are their bytes plus, with per-token scales, the
    scales, with the same rule (static fp8 scales have no page dimension: they are part of the
    pool's identity, see :func:`static_scales_digest`)."""
    from tokenmill.layers.attention.fp8 import FP8Pages

    leaves: list[PageLeaf] = []
    for entry in kv_caches:
        if entry is None:                     # a hybrid model's linear layer (state pool)
            continue
        if isinstance(entry, FP8Pages):
            tensors = entry.page_tensors()
        else:
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


def static_scales_digest(kv_caches: list[Any]) -> str:
    """A digest of the pool's static fp8 scales ("" when there are none): pages quantized under
    other scales must not be shared, so the digest is part of the tier namespace."""
    import hashlib

    from tokenmill.layers.attention.fp8 import static_scale_tensors

    scales = static_scale_tensors(kv_caches)
    if not scales:
        return ""
    h = hashlib.sha256()
    for s in scales:
        h.update(s.detach().float().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def _as_bytes(parts: list[torch.Tensor]) -> torch.Tensor:
    """[n, ...] tensors -> one [n, sum of bytes per row] uint8 tensor (a fresh copy)."""
    n = parts[0].shape[0]
    return torch.cat([p.contiguous().view(torch.uint8).reshape(n, -1) for p in parts], dim=1)


def _chain(keyer: PageKeyer, parent: bytes, tokens: list[int]) -> list[bytes]:
    """Keys of ``tokens``' whole pages continuing the chain after ``parent``."""
    sub = PageKeyer(parent, keyer.page_size)
    return sub.keys(tokens)


def describe_pool(kv_caches: list[Any], num_pages: int) -> dict[str, Any]:
    """The page layout of a KV pool, as plain data (a tensor-parallel rank reports its own)."""
    from tokenmill.layers.attention.fp8 import FP8Pages

    leaves = page_leaves(kv_caches, num_pages)
    return {"entries": sum(1 for c in kv_caches if c is not None),
            "leaves": [(tuple(l.page_shape), l.page_dim, str(l.tensor.dtype), l.tensor.element_size(),
                        l.tensor.dtype.is_floating_point) for l in leaves],
            "fp8_static_scales": static_scales_digest(kv_caches),
            # int8 pages in the tiled order hold the same bytes in another order within a page
            "int8_tiled": any(isinstance(c, FP8Pages) and c.tiled for c in kv_caches)}


def rank_namespace(namespace: bytes, rank: int, tp: int) -> bytes:
    """The L3 namespace of tensor-parallel rank ``rank``'s shard of the pages of ``namespace``."""
    return hashlib.blake2b(namespace + f"|rank {rank} of {tp}".encode(), digest_size=len(namespace)).digest()


def build_tiers(config: Any, runner: Any, kv: Any, model_name: str, kv_spec: Any,
                model: Any = None) -> TieredKV | None:
    """The engine's lower tiers from its :class:`~tokenmill.engine.config.EngineConfig`, or None.

    ``runner``: a ModelRunner (the tiers copy its pool's pages here) or a ParallelRunner (every
    rank copies its own shard; the decisions stay here). ``model``: the full model (whose weights
    name the pages), by default the runner's."""
    from tokenmill.cache.storage import RankShardedStorage, StorageError, open_storage
    from tokenmill.cache.tiers import make_namespace

    storage_spec = config.cache_storage or "none"
    if config.host_cache_memory_gib <= 0 and storage_spec == "none":
        return None
    if kv.cache is None:
        raise ValueError("the host and storage cache tiers need the prefix cache")
    num_pages = kv.pool.num_pages
    tp = getattr(runner, "tp", 1)
    if tp > 1:
        pools = [info["kv_pool"] for info in runner.rank_info]
        layouts = [{k: v for k, v in p.items() if k != "fp8_static_scales"} for p in pools]
        if any(p != layouts[0] for p in layouts):
            raise ValueError("the tensor-parallel ranks' KV pages differ in layout; the cache tiers need one layout")
        pool = pools[0]
    else:
        pool = describe_pool(runner.kv_caches, num_pages)
        pools = [pool]
    leaves = pool["leaves"]
    layout = "|".join(f"{shape}:{dim}:{dtype}" for shape, dim, dtype, _, _ in leaves) + f"|{kv_spec.layers!r}"
    if tp > 1:
        layout += f"|tensor parallel {tp}"   # a shard's pages are not another TP size's
    if pool.get("int8_tiled"):
        layout += "|int8 tiled"   # another byte order within a page than a rows-order pool's
    digests = [p.get("fp8_static_scales", "") for p in pools]
    if any(digests):   # pages quantized under other static fp8 scales are other bytes
        layout += "|fp8-static-scales:" + ",".join(digests)
    identity = f"{model_name}|{model_fingerprint(model if model is not None else runner.model)}"
    namespace = make_namespace(identity, layout, str(kv_spec.dtype), config.page_size)
    keyer = PageKeyer(namespace, config.page_size)
    host_dtype = None if config.host_cache_dtype == "auto" else getattr(torch, config.host_cache_dtype)
    plain = all(is_float for *_, is_float in leaves) and len(leaves) == pool["entries"]
    if not plain:
        host_dtype = None
    host_item = torch.empty((), dtype=host_dtype).element_size() if host_dtype is not None else None
    host_page_bytes = sum(math.prod(shape) * (host_item or item) for shape, _, _, item, _ in leaves)
    host_bytes = config.host_cache_memory_gib * 2**30
    states = getattr(runner, "states", None) if tp == 1 else None
    host_snapshots = 0
    share = getattr(config, "host_cache_snapshot_share", HOST_SNAPSHOT_SHARE)
    if states is not None and host_bytes > 0 and share > 0:
        # a hybrid model's L2 keeps the state snapshots beside the pages (a share of its memory)
        snap_bytes = states.bytes_per_slot
        host_snapshots = max(int(host_bytes * share // snap_bytes), 1)
        host_bytes = max(host_bytes - host_snapshots * snap_bytes, 0)
    host_pages = int(host_bytes // host_page_bytes)   # per rank with TP
    if config.host_cache_memory_gib > 0 and host_pages < 1:
        raise ValueError(f"host_cache_memory_gib={config.host_cache_memory_gib} holds no page of "
                         f"{host_page_bytes} bytes")
    payload_bytes = sum(math.prod(shape) * item for shape, _, _, item, _ in leaves)
    timeout = config.cache_storage_timeout_s
    owners: list[int] = []          # per distinct KV shard, the rank that writes it to L3
    shard_index: list[int] = []     # per rank, its distinct shard (index into owners)
    if tp > 1:
        from tokenmill.models.tensor_parallel import kv_shard_of

        full = model if model is not None else runner.model
        ids = [kv_shard_of(full, r, tp) for r in range(tp)]
        for r, i in enumerate(ids):
            if ids.index(i) == r:
                owners.append(r)
            shard_index.append(owners.index(ids.index(i)))
    try:
        if tp > 1:
            backends = [open_storage(storage_spec, rank_namespace(namespace, r, tp), timeout_s=timeout)
                        for r in owners]
            storage = None
            if backends[0] is not None:
                storage = RankShardedStorage(namespace, backends,   # type: ignore[arg-type]
                                             [payload_bytes] * len(owners))
        else:
            storage = open_storage(storage_spec, namespace, timeout_s=timeout)
    except StorageError as e:
        raise ValueError(f"--cache-storage {storage_spec}: {e}") from None
    mover: LocalPages | RemotePages
    if tp > 1:
        # ranks holding the same bytes (replicated KV heads, the MLA latent) share one L3 copy,
        # written by its owner under the owner's namespace
        runner.init_tiers(host_pages, host_dtype, storage_spec if storage is not None else "none",
                          [rank_namespace(namespace, owners[i], tp) for i in shard_index],
                          [r in owners for r in range(tp)], timeout)
        kv_dtype = getattr(torch, leaves[0][2].removeprefix("torch."))
        mover = RemotePages(runner, [payload_bytes] * len(owners), shard_index, host_pages, host_page_bytes * tp,
                            kv_dtype, host_dtype)
    else:
        mover = LocalPages(runner.kv_caches, num_pages, host_pages, host_dtype)
    tiers = TieredKV(mover, keyer, kv.cache, states=states, host_snapshots=host_snapshots, storage=storage,
                     write_policy=config.cache_write_policy,
                     write_min_hits=config.cache_write_min_hits,
                     prefetch_timeout_s=config.cache_prefetch_timeout_s,
                     prefetch_min_pages=config.cache_prefetch_min_pages)
    log.info("KV tiers: L2 %d host pages%s (%s, %.2f GiB), L3 %s, policy %s, namespace %s",
             host_pages, f" per rank (tp={tp})" if tp > 1 else "",
             str(tiers.host_dtype or tiers.kv_dtype).removeprefix("torch."),
             host_pages * host_page_bytes / 2**30, storage.url if storage else "none",
             config.cache_write_policy, namespace.hex()[:12])
    if states is not None:
        log.info("KV tiers: state snapshots of %d B travel with the pages; L2 holds %d of them",
                 tiers.snap_bytes, host_snapshots)
    return tiers
