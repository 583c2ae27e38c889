"""Replica registry of the live router: who the replicas are, whether they are up, how busy.

``ReplicaRegistry`` is plain state, changed only on the event loop: the proxy counts requests
in and out, the monitor records health checks and load reports, discovery adds and drains
replicas. ``ReplicaMonitor`` runs the periodic I/O (health checks, load polling).

Health state machine of one replica (thresholds from ``HealthConfig``)::

    new --(1 success)--> healthy --(failure_threshold failures in a row)--> unhealthy
                            ^                                                   |
                            +------(recovery_threshold successes in a row)------+

A failure is a failed health check or a connect error while proxying. A draining replica gets
no new requests and leaves the registry when its last in-flight request ends.

Circuit breaker, on top of health checks: ``breaker_threshold`` proxied requests in a row that
fail (5xx, connect error, timeout) open the replica's circuit for ``breaker_cooldown_s``; it gets
no requests meanwhile even if ``/health`` still answers 200. After the cooldown it is half-open:
the next failure opens it again at once, a success closes it. When a replica fails its health
checks (dead, hung, or too slow to answer them) ``on_down(replica_id)`` is called, so the proxy
can take its in-flight attempts elsewhere. Overload answers (429, or 503 with ``Retry-After``)
are not failures: the proxy tries another replica without feeding the breaker.
"""
from __future__ import annotations

import asyncio
import logging
import math
import re
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from urllib.parse import urlsplit

import httpx

from tokenmill.router.policies import ReplicaView

log = logging.getLogger("tokenmill.router")


@dataclass(frozen=True)
class HealthConfig:
    """Health checking and load polling of the replicas."""

    health_path: str = "/health"
    health_interval_s: float = 2.0
    health_timeout_s: float = 2.0
    failure_threshold: int = 2
    recovery_threshold: int = 2
    load_interval_s: float = 0.5
    breaker_threshold: int = 3
    breaker_cooldown_s: float = 5.0

    def __post_init__(self) -> None:
        if not self.health_path.startswith("/"):
            raise ValueError(f"health path must start with '/', got {self.health_path!r}")
        for name in ("health_interval_s", "health_timeout_s", "load_interval_s", "breaker_cooldown_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)!r}")
        for name in ("failure_threshold", "recovery_threshold", "breaker_threshold"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)!r}")


def normalize_url(url: str) -> str:
    """``host:port`` or ``http(s)://host:port[/prefix]`` -> base URL without a trailing slash."""
    url = url.strip()
    if "://" not in url:
        url = "http://" + url
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"not a replica URL: {url!r} (expected http://HOST:PORT)")
    try:
        parts.port
    except ValueError as e:
        raise ValueError(f"bad port in replica URL {url!r}: {e}") from None
    return url.rstrip("/")


def replica_id_for(url: str) -> str:
    """Default replica id: ``host:port`` of its URL (path-safe, stable across restarts)."""
    parts = urlsplit(url)
    port = parts.port or (443 if parts.scheme == "https" else 80)
    return f"{parts.hostname}:{port}"


@dataclass
class Replica:
    """One upstream server and everything the router knows about it."""

    id: str
    url: str
    source: str                      # flag | file | dns | admin
    healthy: bool = False
    ever_healthy: bool = False
    draining: bool = False
    consecutive_failures: int = 0
    consecutive_successes: int = 0
    inflight: int = 0
    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    load_source: str = "none"        # v1/loads | metrics | none
    requests_total: int = 0
    failures_total: int = 0
    circuit_open: bool = False
    circuit_until: float = 0.0       # time.monotonic() when an open circuit turns half-open
    request_failures: int = 0        # proxied requests in a row that failed

    def view(self) -> ReplicaView:
        return ReplicaView(id=self.id, healthy=self.healthy and not self.circuit_open, inflight=self.inflight,
                           num_running=self.num_running, num_waiting=self.num_waiting,
                           kv_cache_usage=self.kv_cache_usage, draining=self.draining)

    def as_dict(self) -> dict[str, object]:
        return {"id": self.id, "url": self.url, "source": self.source, "healthy": self.healthy,
                "draining": self.draining, "inflight": self.inflight, "num_running": self.num_running,
                "num_waiting": self.num_waiting, "kv_cache_usage": self.kv_cache_usage,
                "load_source": self.load_source, "requests_total": self.requests_total,
                "failures_total": self.failures_total, "circuit_open": self.circuit_open}


class DispersionSampler:
    """Running mean and variance (Welford) of per-replica in-flight counts, sampled over time.

    ``index`` = variance / mean: 1 for Poisson-like spread, lower is more even.
    """

    def __init__(self) -> None:
        self.count = 0
        self.mean = 0.0
        self._m2 = 0.0

    def add(self, values: Iterable[float]) -> None:
        for x in values:
            self.count += 1
            delta = x - self.mean
            self.mean += delta / self.count
            self._m2 += delta * (x - self.mean)

    @property
    def variance(self) -> float:
        return self._m2 / self.count if self.count else 0.0

    @property
    def index(self) -> float:
        return self.variance / self.mean if self.mean > 0 else 0.0

    def as_dict(self) -> dict[str, float]:
        return {"samples": self.count, "mean": self.mean, "variance": self.variance, "index": self.index}


class ReplicaRegistry:
    """The set of replicas, keyed by id. Event-loop only; no locking needed."""

    def __init__(self, health: HealthConfig | None = None) -> None:
        self.health = health or HealthConfig()
        self._replicas: dict[str, Replica] = {}
        self.dispersion = DispersionSampler()
        self.on_down: Callable[[str], None] | None = None
        self.clock: Callable[[], float] = time.monotonic

    def __contains__(self, replica_id: str) -> bool:
        return replica_id in self._replicas

    def get(self, replica_id: str) -> Replica | None:
        return self._replicas.get(replica_id)

    def all(self) -> list[Replica]:
        return list(self._replicas.values())

    def views(self) -> list[ReplicaView]:
        now = self.clock()
        for r in self._replicas.values():
            if r.circuit_open and now >= r.circuit_until:   # half-open: one more failure reopens it
                r.circuit_open = False
                r.request_failures = self.health.breaker_threshold - 1
                log.info("replica %s circuit half-open", r.id)
        return [r.view() for r in self._replicas.values()]

    def record_request_result(self, replica_id: str, ok: bool, reason: str = "") -> bool:
        """Feed the circuit breaker with one proxied request's outcome; True if it opened the circuit.

        An open circuit stops new requests only: the replica still answers, so what is in flight
        on it is left to finish (``on_down`` is for replicas that fail their health checks).
        """
        replica = self._replicas.get(replica_id)
        if replica is None:
            return False
        if ok:
            replica.request_failures = 0
            return False
        replica.request_failures += 1
        if not replica.circuit_open and replica.request_failures >= self.health.breaker_threshold:
            replica.circuit_open = True
            replica.circuit_until = self.clock() + self.health.breaker_cooldown_s
            log.warning("replica %s circuit open for %.1fs after %d failed requests (%s)", replica_id,
                        self.health.breaker_cooldown_s, replica.request_failures, reason)
            return True
        return False

    def _went_down(self, replica_id: str) -> None:
        if self.on_down is not None:
            self.on_down(replica_id)

    def add(self, url: str, *, source: str, replica_id: str | None = None) -> Replica:
        """Add a replica (not healthy until its first successful check). Re-adding a draining
        replica cancels the drain. Raises ValueError for a bad URL or an id clash."""
        url = normalize_url(url)
        rid = replica_id or replica_id_for(url)
        if not re.fullmatch(r"[A-Za-z0-9._:\-]+", rid):
            raise ValueError(f"replica id {rid!r} may only hold letters, digits and . _ : -")
        existing = self._replicas.get(rid)
        if existing is not None:
            if existing.url != url:
                raise ValueError(f"replica id {rid!r} already names {existing.url}")
            existing.draining = False
            return existing
        replica = Replica(id=rid, url=url, source=source)
        self._replicas[rid] = replica
        log.info("replica %s added (%s, %s)", rid, url, source)
        return replica

    def drain(self, replica_id: str) -> Replica:
        """Stop sending new requests; the replica is removed once nothing is in flight."""
        replica = self._replicas.get(replica_id)
        if replica is None:
            raise KeyError(replica_id)
        replica.draining = True
        log.info("replica %s draining (%d in flight)", replica_id, replica.inflight)
        self._remove_if_drained(replica)
        return replica

    def request_started(self, replica_id: str) -> None:
        replica = self._replicas[replica_id]
        replica.inflight += 1
        replica.requests_total += 1

    def request_finished(self, replica_id: str) -> None:
        replica = self._replicas.get(replica_id)
        if replica is None:
            return
        replica.inflight = max(0, replica.inflight - 1)
        # The last load report is up to one poll old and likely counted this request: take it
        # off now rather than let a stale "running" make an idle replica look busy until the
        # next poll (an undercount is corrected by that poll).
        if replica.num_running > 0:
            replica.num_running -= 1
        elif replica.num_waiting > 0:
            replica.num_waiting -= 1
        self._remove_if_drained(replica)

    def record_success(self, replica_id: str) -> None:
        replica = self._replicas.get(replica_id)
        if replica is None:
            return
        replica.consecutive_failures = 0
        replica.consecutive_successes += 1
        needed = self.health.recovery_threshold if replica.ever_healthy else 1
        if not replica.healthy and replica.consecutive_successes >= needed:
            replica.healthy = replica.ever_healthy = True
            log.info("replica %s healthy", replica_id)

    def record_failure(self, replica_id: str, reason: str) -> None:
        replica = self._replicas.get(replica_id)
        if replica is None:
            return
        replica.failures_total += 1
        replica.consecutive_successes = 0
        replica.consecutive_failures += 1
        if replica.healthy and replica.consecutive_failures >= self.health.failure_threshold:
            replica.healthy = False
            log.warning("replica %s unhealthy: %s", replica_id, reason)
            self._went_down(replica_id)

    def record_load(self, replica_id: str, running: int, waiting: int, kv_usage: float, source: str) -> None:
        replica = self._replicas.get(replica_id)
        if replica is None:
            return
        replica.num_running, replica.num_waiting = max(0, running), max(0, waiting)
        replica.kv_cache_usage = min(max(kv_usage, 0.0), 1.0) if math.isfinite(kv_usage) else 0.0
        replica.load_source = source

    def sample_dispersion(self) -> None:
        """Add one sample of in-flight counts over the eligible replicas, if anything is in flight."""
        live = [r.inflight for r in self._replicas.values() if r.healthy and not r.draining]
        if live and sum(live) > 0:
            self.dispersion.add(float(x) for x in live)

    def _remove_if_drained(self, replica: Replica) -> None:
        if replica.draining and replica.inflight == 0 and self._replicas.get(replica.id) is replica:
            del self._replicas[replica.id]
            log.info("replica %s drained and removed", replica.id)


# Gauge names understood in /metrics, first match wins: tokenmill, vLLM, SGLang.
_RUNNING = ("tokenmill:num_requests_running", "vllm:num_requests_running", "sglang:num_running_reqs")
_WAITING = ("tokenmill:num_requests_waiting", "vllm:num_requests_waiting", "sglang:num_queue_reqs")
_SAMPLE = re.compile(r"^([A-Za-z_:][A-Za-z0-9_:]*)(?:\{[^}]*\})?\s+(\S+)")
_KV = ("tokenmill:kv_cache_usage_perc", "vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc",
       "sglang:token_usage")


def parse_loads_json(data: object) -> tuple[int, int, float] | None:
    """Read ``/v1/loads``: a dict with num_running/num_waiting/kv_cache_usage at the top level
    (or a list of such dicts, e.g. one per data-parallel rank, which are summed/averaged). A hybrid
    model's replica also reports ``state_pool_usage`` (its state slots); the usage is then that of
    the fuller of its two pools, since either one running out stops admission."""
    items = data if isinstance(data, list) else [data.get("loads", data)] if isinstance(data, dict) else []
    if items and isinstance(items[0], list):
        items = items[0]
    rows = [d for d in items if isinstance(d, dict) and "num_running" in d]
    if not rows:
        return None
    running = sum(int(d.get("num_running", 0)) for d in rows)
    waiting = sum(int(d.get("num_waiting", 0)) for d in rows)
    kv = sum(max(float(d.get("kv_cache_usage", 0.0)), float(d.get("state_pool_usage", 0.0))) for d in rows) / len(rows)
    return running, waiting, kv


def parse_metrics_text(text: str) -> tuple[int, int, float] | None:
    """Read running/waiting/KV-usage gauges from Prometheus text (sums over label sets)."""
    values: dict[str, float] = {}
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if m is None:
            continue
        try:
            value = float(m.group(2))
        except ValueError:
            continue
        if math.isfinite(value):
            values[m.group(1)] = values.get(m.group(1), 0.0) + value

    def first(names: tuple[str, ...]) -> float | None:
        return next((values[n] for n in names if n in values), None)

    running, waiting = first(_RUNNING), first(_WAITING)
    if running is None and waiting is None:
        return None
    return int(running or 0), int(waiting or 0), float(first(_KV) or 0.0)


class ReplicaMonitor:
    """Background health checks and load polling over a registry (one task each)."""

    def __init__(self, registry: ReplicaRegistry, client: httpx.AsyncClient,
                 headers: dict[str, str] | None = None) -> None:
        self.registry = registry
        self.client = client
        self.headers = headers or {}     # e.g. the replicas' API key
        self._tasks: list[asyncio.Task[None]] = []

    async def check_health(self, replica: Replica) -> bool:
        cfg = self.registry.health
        try:
            r = await self.client.get(replica.url + cfg.health_path, timeout=cfg.health_timeout_s,
                                      headers=self.headers)
            ok = r.status_code == 200
            reason = f"{cfg.health_path} answered {r.status_code}"
        except httpx.HTTPError as e:
            ok, reason = False, f"{type(e).__name__}: {e}"
        if ok:
            self.registry.record_success(replica.id)
        else:
            self.registry.record_failure(replica.id, reason)
        return ok

    async def poll_load(self, replica: Replica) -> None:
        timeout = self.registry.health.health_timeout_s
        report = None
        try:
            if replica.load_source != "metrics":
                r = await self.client.get(replica.url + "/v1/loads", timeout=timeout, headers=self.headers)
                if r.status_code == 200:
                    report = parse_loads_json(r.json())
                    source = "v1/loads"
            if report is None:
                r = await self.client.get(replica.url + "/metrics", timeout=timeout, headers=self.headers)
                if r.status_code == 200:
                    report = parse_metrics_text(r.text)
                    source = "metrics"
        except (httpx.HTTPError, ValueError):
            return      # health checks decide about failures; a missed load report is not one
        if report is not None:
            self.registry.record_load(replica.id, *report, source=source)

    async def check_all(self) -> None:
        await asyncio.gather(*(self.check_health(r) for r in self.registry.all()))

    async def _health_loop(self) -> None:
        while True:
            await asyncio.sleep(self.registry.health.health_interval_s)
            await self.check_all()

    async def _load_loop(self) -> None:
        while True:
            await asyncio.gather(*(self.poll_load(r) for r in self.registry.all() if r.healthy))
            await asyncio.sleep(self.registry.health.load_interval_s)

    async def _sample_loop(self, interval: float = 0.05) -> None:
        while True:
            self.registry.sample_dispersion()
            await asyncio.sleep(interval)

    def start(self) -> None:
        self._tasks = [asyncio.create_task(c) for c in (self._health_loop(), self._load_loop(), self._sample_loop())]

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []


__all__ = ["DispersionSampler", "HealthConfig", "Replica", "ReplicaMonitor", "ReplicaRegistry",
           "normalize_url", "parse_loads_json", "parse_metrics_text", "replica_id_for"]
