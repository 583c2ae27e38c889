"""Prometheus text for the router's ``GET /metrics``: its own counters and each replica's state."""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tokenmill.router.app import Router

PREFIX = "tokenmill_router_"


def _escape(v: str) -> str:
    return v.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _labels(labels: dict[str, str]) -> str:
    if not labels:
        return ""
    return "{" + ",".join(f'{k}="{_escape(v)}"' for k, v in labels.items()) + "}"


def _num(v: float) -> str:
    return str(int(v)) if float(v).is_integer() else repr(float(v))


def render_metrics(router: Router) -> str:
    """Text exposition format 0.0.4."""
    lines: list[str] = []

    def family(name: str, kind: str, help: str, samples: list[tuple[dict[str, str], float]]) -> None:
        full = PREFIX + name
        lines.append(f"# HELP {full} {help}")
        lines.append(f"# TYPE {full} {kind}")
        lines.extend(f"{full}{_labels(lab)} {_num(v)}" for lab, v in samples)

    family("requests_total", "counter", "Requests answered by the router, by endpoint and status.",
           [({"endpoint": ep, "status": str(code)}, n) for (ep, code), n in sorted(router.requests.items())])
    kinds = sorted(set(router.policy.counters) | {"placed", "sticky", "split", "moved", "failover"})
    family("decisions_total", "counter", "Routing decisions by kind.",
           [({"policy": router.policy.name, "kind": k}, router.policy.counters[k]) for k in kinds])
    family("retries_total", "counter", "Requests retried on another replica.", [({}, router.retries)])
    family("upstream_errors_total", "counter", "Failed upstream attempts before the first byte, by reason.",
           [({"reason": r}, n) for r, n in sorted(router.upstream_errors.items())])
    family("midstream_errors_total", "counter", "Responses that broke off after the first byte.",
           [({}, router.midstream_errors)])
    sessions = getattr(router.policy, "sessions_per_replica", lambda: {})()
    replicas = router.registry.all()
    per_replica = [
        ("replica_inflight", "Requests the router has in flight on the replica.", lambda r: r.inflight),
        ("replica_healthy", "1 when the replica passes health checks.", lambda r: int(r.healthy)),
        ("replica_draining", "1 when the replica is draining.", lambda r: int(r.draining)),
        ("replica_num_running", "Running requests the replica last reported.", lambda r: r.num_running),
        ("replica_num_waiting", "Waiting requests the replica last reported.", lambda r: r.num_waiting),
        ("replica_kv_cache_usage", "KV-cache usage (0..1) the replica last reported.", lambda r: r.kv_cache_usage),
        ("replica_sessions", "Sessions homed on the replica in the policy's table.", lambda r: sessions.get(r.id, 0)),
    ]
    for name, help, get in per_replica:
        family(name, "gauge", help, [({"replica": r.id}, get(r)) for r in replicas])
    family("replica_requests_total", "counter", "Requests sent to the replica.",
           [({"replica": r.id}, r.requests_total) for r in replicas])
    d = router.registry.dispersion
    family("load_dispersion_index", "gauge",
           "Variance / mean of per-replica in-flight requests, sampled while busy.", [({}, d.index)])
    family("load_dispersion_samples", "gauge", "Replica samples behind the dispersion index.", [({}, d.count)])
    return "\n".join(lines) + "\n"
