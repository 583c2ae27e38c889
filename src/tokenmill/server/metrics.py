"""Prometheus metrics of ``GET /metrics``, kept in a ``prometheus_client`` registry per app.

Gauges and token counters are read from the engine's stats snapshot at scrape time (a custom
collector), so they are exactly the engine's own counts. Latency histograms are observed by the
server as outputs reach the event loop (the time a client would see, minus the network):

* ``time_to_first_token_seconds``: request received -> first output token;
* ``inter_token_latency_seconds``: gap between consecutive output tokens (a step that yields k
  tokens at once counts k gaps of interval / k);
* ``e2e_request_latency_seconds``: request received -> last output.

Admission and limits: ``requests_rejected_total{reason}`` counts refused requests (queue_full, predicted_wait,
queue_timeout, request_too_large, json_too_deep), ``request_deadline_expired_total`` requests cut
by their deadline, ``max_waiting_requests`` is the queue bound (``num_requests_waiting`` is the
queue length). ``event_loop_tasks`` and ``process_threads`` show what a leak would grow.

All methods run on the event loop thread; nothing here is shared with the engine thread.
"""
from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

if TYPE_CHECKING:
    from tokenmill.engine.engine import EngineStats

prometheus_client.disable_created_metrics()   # no *_created series: the exposition stays as before

PREFIX = "tokenmill:"
CONTENT_TYPE = prometheus_client.CONTENT_TYPE_LATEST
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2,
               0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
               240.0, 480.0, 960.0, 1920.0, 7680.0)
FINISH_REASONS = ("stop", "length", "abort", "deadline", "queue_timeout")
REJECT_REASONS = ("queue_full", "predicted_wait", "queue_timeout", "request_too_large", "json_too_deep")


class CounterView:
    """A labelled prometheus counter read and bumped like a ``collections.Counter``:
    ``view[label] += n`` increments the child, ``view[label]`` reads it."""

    def __init__(self, counter: Counter, fixed: tuple[str, ...]) -> None:
        self._counter = counter
        self._fixed = fixed
        self._seen: set[str] = set()

    def _child(self, label: Any) -> Any:
        self._seen.add(str(label))
        return self._counter.labels(*self._fixed, str(label))

    def __getitem__(self, label: Any) -> float:
        return float(self._child(label)._value.get())

    def __setitem__(self, label: Any, value: float) -> None:
        child = self._child(label)
        delta = value - float(child._value.get())
        if delta < 0:
            raise ValueError("a counter cannot go down")
        child.inc(delta)

    def __iter__(self) -> Iterator[str]:
        return iter(sorted(self._seen))


class ServerMetrics:
    """Everything ``GET /metrics`` shows for one served model."""

    def __init__(self, model_name: str, *, prefix_cache_enabled: bool = True,
                 max_waiting_requests: int | None = None) -> None:
        self.labels = {"model_name": model_name}
        self.prefix_cache_enabled = prefix_cache_enabled
        self.max_waiting_requests = max_waiting_requests
        self.registry = CollectorRegistry(auto_describe=False)
        self._stats: EngineStats | None = None
        lab = ("model_name",)
        self.ttft = Histogram(PREFIX + "time_to_first_token_seconds", "Time to first token in seconds.", lab,
                              buckets=TTFT_BUCKETS, registry=self.registry).labels(model_name)
        self.itl = Histogram(PREFIX + "inter_token_latency_seconds",
                             "Time between consecutive output tokens in seconds.", lab,
                             buckets=ITL_BUCKETS, registry=self.registry).labels(model_name)
        self.e2e = Histogram(PREFIX + "e2e_request_latency_seconds", "End-to-end request latency in seconds.", lab,
                             buckets=E2E_BUCKETS, registry=self.registry).labels(model_name)
        success = Counter(PREFIX + "request_success_total", "Finished requests by finish reason.",
                          ("model_name", "finished_reason"), registry=self.registry)
        errors = Counter(PREFIX + "http_errors_total", "Error responses sent, by status code.",
                         ("model_name", "status"), registry=self.registry)
        rejected = Counter(PREFIX + "requests_rejected_total",
                           "Requests refused by an admission limit, by reason.", ("model_name", "reason"),
                           registry=self.registry)
        self.deadline_expired = Counter(PREFIX + "request_deadline_expired_total",
                                        "Engine requests finished by their deadline.", lab,
                                        registry=self.registry).labels(model_name)
        self.finished = CounterView(success, (model_name,))     # finish_reason -> count
        self.http_errors = CounterView(errors, (model_name,))   # status code -> count
        self.rejected = CounterView(rejected, (model_name,))    # reason -> count
        for reason in FINISH_REASONS:
            self.finished[reason] += 0
        for reason in REJECT_REASONS:
            self.rejected[reason] += 0
        self.registry.register(_EngineCollector(self))

    def render(self, stats: EngineStats) -> str:
        self._stats = stats
        text = generate_latest(self.registry).decode()
        if getattr(stats, "tiers", None) is not None:   # L2/L3 cache tiers (server/tier_metrics.py)
            from tokenmill.server.tier_metrics import render_tier_metrics

            text += "\n".join(render_tier_metrics(stats.tiers, stats.kv_pages_cached, stats.kv_pages_total,
                                                  self.labels)) + "\n"
        return text


class _EngineCollector:
    """Gauges and counters read from the engine snapshot handed to :meth:`ServerMetrics.render`."""

    def __init__(self, metrics: ServerMetrics) -> None:
        self.m = metrics

    def collect(self) -> Iterator[Any]:
        stats = self.m._stats
        if stats is None:
            return
        model = self.m.labels["model_name"]

        def family(cls: Any, name: str, help: str, value: float) -> Any:
            fam = cls(PREFIX + name, help, labels=["model_name"])
            fam.add_metric([model], value)
            return fam

        g, c = GaugeMetricFamily, CounterMetricFamily
        yield family(g, "num_requests_running", "Requests in the running batch.", stats.num_running)
        yield family(g, "num_requests_waiting", "Requests waiting to be admitted (the queue length).",
                     stats.num_waiting)
        if self.m.max_waiting_requests is not None:
            yield family(g, "max_waiting_requests", "Bound of the waiting queue; more get 429.",
                         self.m.max_waiting_requests)
        yield family(g, "kv_cache_usage_perc", "Fraction of KV-cache pages in use (1 = full).", stats.kv_cache_usage)
        yield family(g, "kv_pages_total", "KV-cache pages in the pool.", stats.kv_pages_total)
        yield family(g, "kv_pages_free", "KV-cache pages on the free list.", stats.kv_pages_free)
        yield family(g, "kv_pages_in_use", "KV-cache pages held by requests alone.", stats.kv_pages_in_use)
        yield family(g, "kv_cache_capacity_tokens", "Tokens the KV-cache pool holds.", stats.kv_capacity_tokens)
        yield family(g, "kv_cache_bytes_per_token", "KV bytes per token over all layers (per-token fp8 scales included).",
                     stats.kv_bytes_per_token)
        if getattr(stats, "state_slots_total", 0):   # hybrid models: the state pool beside the pages
            yield family(g, "state_pool_usage_perc", "Fraction of state-pool request slots in use (1 = full).",
                         stats.state_pool_usage)
            yield family(g, "state_slots_total", "State-pool request slots (one per running request).",
                         stats.state_slots_total)
            yield family(g, "state_slots_free", "State-pool request slots free.", stats.state_slots_free)
            yield family(g, "state_snapshot_slots", "State-pool slots for prefix-cache state snapshots.",
                         stats.state_snapshot_slots)
            yield family(g, "state_snapshots_cached", "Snapshot slots holding a prefix-cache state snapshot.",
                         stats.state_snapshots_cached)
            yield family(g, "state_bytes_per_request", "State-pool bytes of one request slot (all linear layers).",
                         stats.state_bytes_per_request)
        queries = stats.prompt_tokens_total if self.m.prefix_cache_enabled else 0
        yield family(c, "prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", queries)
        yield family(c, "prefix_cache_hits", "Prompt tokens found in the prefix cache.", stats.cached_tokens_total)
        yield family(c, "prompt_tokens", "Prompt tokens received by the engine.", stats.prompt_tokens_total)
        yield family(c, "generation_tokens", "Tokens generated.", stats.generation_tokens_total)
        yield family(c, "decode_chains", "Chains of greedy decode steps run in one native call.",
                     stats.decode_chains_total)
        yield family(c, "decode_chain_steps", "Decode steps run inside chains.", stats.decode_chain_steps_total)
        try:
            tasks = len(asyncio.all_tasks())
        except RuntimeError:   # scraped outside the event loop
            tasks = 0
        yield family(g, "event_loop_tasks", "asyncio tasks alive on the server's event loop.", tasks)
        yield family(g, "process_threads", "Threads alive in the server process.", threading.active_count())
        if getattr(stats, "spec", None) is not None:
            yield from _spec_families(stats.spec, model)
        if getattr(stats, "step_seconds", None):
            yield _step_seconds_family(stats.step_seconds, model)


def _step_seconds_family(step_seconds: dict[str, Any], model: str) -> Any:
    """Engine step wall time by kind: decode (decodes only), mixed (decodes beside prefill), prefill."""
    from tokenmill.engine.step_cost import STEP_SECONDS_BUCKETS

    hist = HistogramMetricFamily(PREFIX + "engine_step_seconds",
                                 "Wall time of engine steps by kind (decode, mixed, prefill).",
                                 labels=["model_name", "kind"])
    for kind, (cumulative, total_s, count) in step_seconds.items():
        buckets = [(str(float(b)), n) for b, n in zip(STEP_SECONDS_BUCKETS, cumulative)]
        buckets.append(("+Inf", count))
        hist.add_metric([model, kind], buckets, total_s)
    return hist


def _spec_families(spec: Any, model: str) -> Iterator[Any]:
    """Speculative decoding: drafts proposed/accepted, acceptance length, per-position rate."""
    from tokenmill.engine.spec.base import ACCEPT_LENGTH_BUCKETS

    names, values = ["model_name", "method"], [model, spec.method]
    for name, help, value in (
            ("spec_decode_num_draft_tokens", "Draft tokens verified.", spec.proposed),
            ("spec_decode_num_accepted_tokens", "Draft tokens accepted.", spec.accepted),
            ("spec_decode_num_drafts", "Request-steps that verified drafts.", spec.verify_steps)):
        fam = CounterMetricFamily(PREFIX + name, help, labels=names)
        fam.add_metric(values, value)
        yield fam
    hist = HistogramMetricFamily(PREFIX + "spec_decode_acceptance_length",
                                 "Tokens emitted per verified request-step (accepted drafts + 1).", labels=names)
    buckets, cumulative = [], 0
    for bound, n in zip(ACCEPT_LENGTH_BUCKETS, spec.length_counts):
        cumulative += n
        buckets.append((str(float(bound)), cumulative))
    buckets.append(("+Inf", spec.verify_steps))
    hist.add_metric(values, buckets, spec.emitted)
    yield hist
    rate = GaugeMetricFamily(PREFIX + "spec_decode_position_acceptance_rate",
                             "Share of drafts at each position that were accepted.", labels=names + ["position"])
    for j, (prop, acc) in enumerate(zip(spec.position_proposed, spec.position_accepted)):
        rate.add_metric(values + [str(j)], acc / prop if prop else 0.0)
    yield rate


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
            for _ in range(n - 1):
                self.metrics.itl.observe(0.0)
        else:
            gap = (now - self.last) / n
            for _ in range(n):
                self.metrics.itl.observe(gap)
        self.last = now
        self.num_tokens += n

    def on_finish(self, reason: str | None, now: float) -> None:
        self.metrics.e2e.observe(now - self.arrival)
        self.metrics.finished[reason or "abort"] += 1
        if reason == "deadline":
            self.metrics.deadline_expired.inc()
