"""The router's ``GET /metrics`` through ``prometheus_client``: its own counters and each replica's state.

:class:`RouterStats` holds the counters the proxy bumps; :class:`RouterCollector` turns them,
the registry and the policy's counters into metric families at scrape time. Neither imports the
proxy (``router/app.py`` imports this module, never the other way round).
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import prometheus_client
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from tokenmill.router.policies import Policy
from tokenmill.router.replicas import ReplicaRegistry

prometheus_client.disable_created_metrics()

PREFIX = "tokenmill_router_"
CONTENT_TYPE = prometheus_client.CONTENT_TYPE_LATEST
REJECT_REASONS = ("fleet_full", "replicas_full", "replica_429", "replica_503", "request_too_large", "json_too_deep")


@dataclass
class RouterStats:
    """Counters of the proxy (event-loop only)."""

    requests: Counter[tuple[str, int]] = field(default_factory=Counter)   # (endpoint, status) -> count
    retries: int = 0
    upstream_errors: Counter[str] = field(default_factory=Counter)        # reason -> count
    midstream_errors: int = 0
    rejected: Counter[str] = field(default_factory=Counter)               # reason -> count
    ejections: Counter[str] = field(default_factory=Counter)              # replica id -> times taken out


class RouterCollector:
    """Metric families read from the router's state on every scrape."""

    def __init__(self, stats: RouterStats, registry: ReplicaRegistry, policy: Policy,
                 sessions_per_replica: Callable[[], dict[str, int]]) -> None:
        self.stats = stats
        self.registry = registry
        self.policy = policy
        self.sessions_per_replica = sessions_per_replica

    def collect(self) -> Iterator[Any]:
        st = self.stats

        def family(cls: Any, name: str, help: str, labels: list[str],
                   samples: list[tuple[list[str], float]]) -> Any:
            fam = cls(PREFIX + name, help, labels=labels)
            for values, v in samples:
                fam.add_metric(values, v)
            return fam

        c, g = CounterMetricFamily, GaugeMetricFamily
        yield family(c, "requests", "Requests answered by the router, by endpoint and status.", ["endpoint", "status"],
                     [([ep, str(code)], n) for (ep, code), n in sorted(st.requests.items())])
        kinds = sorted(set(self.policy.counters) | {"placed", "sticky", "split", "moved", "failover"})
        yield family(c, "decisions", "Routing decisions by kind.", ["policy", "kind"],
                     [([self.policy.name, k], self.policy.counters[k]) for k in kinds])
        yield family(c, "retries", "Requests retried on another replica.", [], [([], st.retries)])
        yield family(c, "upstream_errors", "Failed upstream attempts before the first byte, by reason.", ["reason"],
                     [([r], n) for r, n in sorted(st.upstream_errors.items())])
        yield family(c, "midstream_errors", "Responses that broke off after the first byte.", [],
                     [([], st.midstream_errors)])
        reasons = sorted(set(REJECT_REASONS) | set(st.rejected))
        yield family(c, "requests_rejected", "Requests refused by an admission limit, by reason.", ["reason"],
                     [([r], st.rejected[r]) for r in reasons])
        replicas = self.registry.all()
        yield family(g, "inflight", "Requests the router has in flight, all replicas together.", [],
                     [([], sum(r.inflight for r in replicas))])
        sessions = self.sessions_per_replica()
        per_replica: list[tuple[str, str, Callable[[Any], float]]] = [
            ("replica_inflight", "Requests the router has in flight on the replica.", lambda r: r.inflight),
            ("replica_healthy", "1 when the replica passes health checks.", lambda r: int(r.healthy)),
            ("replica_draining", "1 when the replica is draining.", lambda r: int(r.draining)),
            ("replica_circuit_open", "1 while the circuit breaker keeps requests off the replica.",
             lambda r: int(r.circuit_open)),
            ("replica_num_running", "Running requests the replica last reported.", lambda r: r.num_running),
            ("replica_num_waiting", "Waiting requests the replica last reported.", lambda r: r.num_waiting),
            ("replica_kv_cache_usage", "KV-cache usage (0..1) the replica last reported.", lambda r: r.kv_cache_usage),
            ("replica_sessions", "Sessions homed on the replica in the policy's table.",
             lambda r: sessions.get(r.id, 0)),
        ]
        for name, help, get in per_replica:
            yield family(g, name, help, ["replica"], [([r.id], get(r)) for r in replicas])
        yield family(c, "replica_requests", "Requests sent to the replica.", ["replica"],
                     [([r.id], r.requests_total) for r in replicas])
        yield family(c, "replica_ejections", "Times the replica was taken out (failed health checks or circuit opened).", ["replica"],
                     [([r.id], st.ejections[r.id]) for r in replicas])
        d = self.registry.dispersion
        yield family(g, "load_dispersion_index", "Variance / mean of per-replica in-flight requests, sampled while busy.",
                     [], [([], d.index)])
        yield family(g, "load_dispersion_samples", "Replica samples behind the dispersion index.", [], [([], d.count)])


def make_registry(collector: RouterCollector) -> CollectorRegistry:
    reg = CollectorRegistry(auto_describe=False)
    reg.register(collector)
    return reg


def render(registry: CollectorRegistry) -> str:
    return generate_latest(registry).decode()
