"""Prometheus lines of the L2/L3 cache tiers (text exposition format, see server/metrics.py).

Everything comes from the engine's :class:`~tokenmill.cache.tiers.TierStats` snapshot taken at
scrape time; the L1 page gauge is the radix tree's cached pages.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tokenmill.cache.tiers import TierStats

PREFIX = "tokenmill:"


def _fmt(v: float) -> str:
    return str(int(v)) if float(v).is_integer() else repr(float(v))


def _lab(labels: dict[str, str]) -> str:
    inner = ",".join(f'{k}="{v}"' for k, v in labels.items())
    return "{" + inner + "}" if inner else ""


def render_tier_metrics(t: TierStats, l1_pages: int, l1_capacity: int, labels: dict[str, str]) -> list[str]:
    lines: list[str] = []

    def family(name: str, kind: str, help: str, samples: list[tuple[dict[str, str], float]]) -> None:
        full = PREFIX + name
        lines.extend([f"# HELP {full} {help}", f"# TYPE {full} {kind}"])
        suffix = "_total" if kind == "counter" and not full.endswith("_total") else ""
        for extra, value in samples:
            lines.append(f"{full}{suffix}{_lab({**labels, **extra})} {_fmt(value)}")

    family("cache_tier_pages", "gauge", "KV pages held per cache tier (l3: pages this replica knows are stored).",
           [({"tier": "l1"}, l1_pages), ({"tier": "l2"}, t.pages_l2), ({"tier": "l3"}, t.pages_l3_known)])
    family("cache_tier_capacity_pages", "gauge", "KV page capacity of the device and host tiers.",
           [({"tier": "l1"}, l1_capacity), ({"tier": "l2"}, t.pages_l2_capacity)])
    family("cache_tier_hit_tokens_total", "counter", "Prompt tokens not recomputed, by the tier they came from.",
           [({"tier": k}, v) for k, v in t.hit_tokens.items()])
    family("cache_tier_hit_pages_total", "counter", "Cached pages used at admission, by tier.",
           [({"tier": k}, v) for k, v in t.hit_pages.items()])
    family("cache_tier_bytes_read_total", "counter", "Bytes of KV pages read from a lower tier.",
           [({"tier": k}, v) for k, v in t.bytes_read.items()])
    family("cache_tier_bytes_written_total", "counter", "Bytes of KV pages written to a lower tier.",
           [({"tier": k}, v) for k, v in t.bytes_written.items()])
    family("cache_tier_pages_written_total", "counter", "KV pages written to a lower tier.",
           [({"tier": k}, v) for k, v in t.pages_written.items()])
    family("cache_tier_load_seconds_total", "counter", "Seconds spent copying loaded pages into the device pool.",
           [({"tier": k}, v) for k, v in t.load_seconds.items()])
    full = PREFIX + "cache_prefetch_seconds"
    lines += [f"# HELP {full} L3 prefetch time, arrival to the last page read.", f"# TYPE {full} summary",
              f"{full}_sum{_lab(labels)} {_fmt(t.prefetch_seconds_sum)}",
              f"{full}_count{_lab(labels)} {t.prefetch_count}"]
    family("cache_prefetch_timeouts_total", "counter", "Admissions that stopped waiting for L3 pages at the limit.",
           [({}, t.prefetch_timeouts)])
    kinds = sorted(set(t.l3_errors) | {"unavailable", "corrupt", "truncated", "foreign", "full", "io"})
    family("cache_storage_errors_total", "counter", "L3 errors by kind; every one cost a recompute or a lost write.",
           [({"kind": k}, t.l3_errors.get(k, 0)) for k in kinds])
    family("cache_storage_skipped_writes_total", "counter", "L3 writes not made: page already present, or dropped.",
           [({"reason": "present"}, t.l3_skipped_present), ({"reason": "dropped"}, t.l3_dropped_writes)])
    if t.snapshots_l2_capacity or any(t.snapshots_written.values()) or any(t.snapshot_hits.values()):
        # hybrid models: the linear layers' state snapshots that travel with the pages
        family("cache_tier_snapshots", "gauge", "State snapshots held in host memory (hybrid models).",
               [({"tier": "l2"}, t.snapshots_l2)])
        family("cache_tier_snapshot_capacity", "gauge", "State snapshot slots in host memory (hybrid models).",
               [({"tier": "l2"}, t.snapshots_l2_capacity)])
        family("cache_tier_snapshot_hits_total", "counter", "Prefix hits whose state snapshot came from a lower tier.",
               [({"tier": k}, v) for k, v in t.snapshot_hits.items()])
        family("cache_tier_snapshots_written_total", "counter", "State snapshots written to a lower tier.",
               [({"tier": k}, v) for k, v in t.snapshots_written.items()])
        family("cache_snapshot_fallbacks_total", "counter",
               "Unreadable L3 snapshot records skipped for an earlier snapshot.", [({}, t.snapshot_fallbacks)])
    return lines
