"""Prometheus metrics in the text exposition format (version 0.0.4), written by hand.

Gauges and token counters are read from the engine's stats snapshot at scrape time, so they are
exactly the engine's own counts. Latency histograms are observed by the server as outputs reach
the event loop (the time a client would see, minus the network):

* ``time_to_first_token_seconds``: request received -> first output token;
* ``inter_token_latency_seconds``: gap between consecutive output tokens (a step that yields k
  tokens at once counts k gaps of interval / k);
* ``e2e_request_latency_seconds``: request received -> last output.

All methods run on the event loop thread; nothing here is shared with the engine thread.
"""
from __future__ import annotations

import bisect
import math
from collections import Counter as _Counter
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tokenmill.engine.engine import EngineStats

PREFIX = "tokenmill:"
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2,
               0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
               240.0, 480.0, 960.0, 1920.0, 7680.0)


def _fmt(v: float) -> str:
    if math.isinf(v):
        return "+Inf" if v > 0 else "-Inf"
    if float(v).is_integer() and abs(v) < 1e15:
        return str(int(v))
    return repr(float(v))


def _labels(labels: dict[str, str]) -> str:
    if not labels:
        return ""
    inner = ",".join(f'{k}="{_escape(v)}"' for k, v in labels.items())
    return "{" + inner + "}"


def _escape(v: str) -> str:
    return v.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


class Histogram:
    """Cumulative-bucket histogram with a fixed bucket layout."""

    def __init__(self, name: str, help: str, buckets: tuple[float, ...]) -> None:
        if list(buckets) != sorted(set(buckets)):
            raise ValueError("histogram buckets must be strictly increasing")
        self.name = PREFIX + name
        self.help = help
        self.buckets = buckets
        self.counts = [0] * (len(buckets) + 1)   # last slot: above the largest bucket
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float, times: int = 1) -> None:
        if times <= 0:
            return
        value = max(float(value), 0.0)
        self.counts[bisect.bisect_left(self.buckets, value)] += times
        self.sum += value * times
        self.count += times

    def render(self, labels: dict[str, str]) -> list[str]:
        lines = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} histogram"]
        cumulative = 0
        for bound, n in zip(self.buckets, self.counts):
            cumulative += n
            lines.append(f"{self.name}_bucket{_labels({**labels, 'le': _fmt(bound)})} {cumulative}")
        lines.append(f"{self.name}_bucket{_labels({**labels, 'le': '+Inf'})} {self.count}")
        lines.append(f"{self.name}_sum{_labels(labels)} {_fmt(self.sum)}")
        lines.append(f"{self.name}_count{_labels(labels)} {self.count}")
        return lines


class ServerMetrics:
    """Everything ``GET /metrics`` shows for one served model."""

    def __init__(self, model_name: str, *, prefix_cache_enabled: bool = True) -> None:
        self.labels = {"model_name": model_name}
        self.prefix_cache_enabled = prefix_cache_enabled
        self.ttft = Histogram("time_to_first_token_seconds", "Time to first token in seconds.", TTFT_BUCKETS)
        self.itl = Histogram("inter_token_latency_seconds", "Time between consecutive output tokens in seconds.",
                             ITL_BUCKETS)
        self.e2e = Histogram("e2e_request_latency_seconds", "End-to-end request latency in seconds.", E2E_BUCKETS)
        self.finished: _Counter[str] = _Counter()   # finish_reason -> count
        self.http_errors: _Counter[int] = _Counter()  # status code -> count

    def render(self, stats: EngineStats) -> str:
        lab = self.labels
        lines: list[str] = []

        def sample(name: str, kind: str, help: str, value: float) -> None:
            full = PREFIX + name
            lines.extend([f"# HELP {full} {help}", f"# TYPE {full} {kind}", f"{full}{_labels(lab)} {_fmt(value)}"])

        sample("num_requests_running", "gauge", "Requests in the running batch.", stats.num_running)
        sample("num_requests_waiting", "gauge", "Requests waiting to be admitted.", stats.num_waiting)
        sample("kv_cache_usage_perc", "gauge", "Fraction of KV-cache pages in use (1 = full).", stats.kv_cache_usage)
        sample("kv_pages_total", "gauge", "KV-cache pages in the pool.", stats.kv_pages_total)
        sample("kv_pages_free", "gauge", "KV-cache pages on the free list.", stats.kv_pages_free)
        sample("kv_cache_capacity_tokens", "gauge", "Tokens the KV-cache pool holds.", stats.kv_capacity_tokens)
        sample("kv_cache_bytes_per_token", "gauge", "KV bytes per token over all layers (fp8 scales included).",
               stats.kv_bytes_per_token)
        queries = stats.prompt_tokens_total if self.prefix_cache_enabled else 0
        sample("prefix_cache_queries_total", "counter", "Prompt tokens looked up in the prefix cache.", queries)
        sample("prefix_cache_hits_total", "counter", "Prompt tokens found in the prefix cache.",
               stats.cached_tokens_total)
        sample("prompt_tokens_total", "counter", "Prompt tokens received by the engine.", stats.prompt_tokens_total)
        sample("generation_tokens_total", "counter", "Tokens generated.", stats.generation_tokens_total)
        name = PREFIX + "request_success_total"
        lines += [f"# HELP {name} Finished requests by finish reason.", f"# TYPE {name} counter"]
        for reason in ("stop", "length", "abort", *sorted(set(self.finished) - {"stop", "length", "abort"})):
            lines.append(f"{name}{_labels({**lab, 'finished_reason': reason})} {self.finished[reason]}")
        name = PREFIX + "http_errors_total"
        lines += [f"# HELP {name} Error responses sent, by status code.", f"# TYPE {name} counter"]
        for code in sorted(self.http_errors):
            lines.append(f"{name}{_labels({**lab, 'status': str(code)})} {self.http_errors[code]}")
        for hist in (self.ttft, self.itl, self.e2e):
            lines.extend(hist.render(lab))
        if stats.tiers is not None:
            from tokenmill.server.tier_metrics import render_tier_metrics

            lines.extend(render_tier_metrics(stats.tiers, stats.kv_pages_cached, stats.kv_pages_total, lab))
        return "\n".join(lines) + "\n"


class RequestTimer:
    """Latency bookkeeping of one engine request (one choice); feeds :class:`ServerMetrics`."""

    __slots__ = ("metrics", "arrival", "last", "num_tokens")

    def __init__(self, metrics: ServerMetrics, arrival: float) -> None:
        self.metrics = metrics
        self.arrival = arrival
        self.last: float | None = None
        self.num_tokens = 0

    def on_tokens(self, n: int, now: float) -> None:
        if n <= 0:
            return
        if self.last is None:
            self.metrics.ttft.observe(now - self.arrival)
            if n > 1:
                self.metrics.itl.observe(0.0, n - 1)
        else:
            self.metrics.itl.observe((now - self.last) / n, n)
        self.last = now
        self.num_tokens += n

    def on_finish(self, reason: str | None, now: float) -> None:
        self.metrics.e2e.observe(now - self.arrival)
        self.metrics.finished[reason or "abort"] += 1
