"""The Grafana dashboard under examples/ only queries metrics the server and router export."""
from __future__ import annotations

import json
import re
from pathlib import Path

from tokenmill.engine.engine import EngineStats
from tokenmill.router.app import Router, RouterConfig
from tokenmill.router.metrics import render
from tokenmill.server.metrics import ServerMetrics

DASHBOARD = Path(__file__).resolve().parents[1] / "examples" / "grafana" / "tokenmill-dashboard.json"
# PromQL functions, keywords and Grafana variables that look like identifiers
NOT_METRICS = {"sum", "by", "rate", "increase", "histogram_quantile", "max", "le", "label_values", "model_name",
               "instance", "reason", "status", "finished_reason", "kind", "replica", "without", "avg", "min"}


def exported_names() -> set[str]:
    metrics = ServerMetrics("m", max_waiting_requests=8)
    stats = EngineStats(num_running=1, num_waiting=0, kv_pages_total=10, kv_pages_free=9, kv_cache_usage=0.1,
                        prompt_tokens_total=5, cached_tokens_total=0, generation_tokens_total=3)
    metrics.ttft.observe(0.1)
    metrics.http_errors[400] += 1
    text = metrics.render(stats)
    router = Router(RouterConfig(replicas=["http://127.0.0.1:1"]))
    # one of each event, as traffic would leave them (families without samples print no lines)
    router.stats.requests[("/v1/chat/completions", 200)] += 1
    router.stats.upstream_errors["ConnectError"] += 1
    text += render(router.metrics_registry)
    return {line.split("{")[0].split(" ")[0] for line in text.splitlines() if line and not line.startswith("#")}


def queries() -> list[str]:
    doc = json.loads(DASHBOARD.read_text())
    out = [t["expr"] for p in doc["panels"] for t in p.get("targets", [])]
    out += [v["query"] for v in doc["templating"]["list"] if v.get("type") == "query"]
    return out


def test_every_query_names_an_exported_metric() -> None:
    exported = exported_names()
    assert "tokenmill:time_to_first_token_seconds_bucket" in exported and "tokenmill_router_requests_total" in exported
    seen = set()
    for expr in queries():
        stripped = re.sub(r'\{[^}]*\}|"[^"]*"|\[[^\]]*\]|\$\w+', " ", expr)
        names = {n for n in re.findall(r"[a-zA-Z_:][a-zA-Z0-9_:]*", stripped)
                 if n not in NOT_METRICS and not re.fullmatch(r"[0-9.]+", n)}
        assert names, f"no metric in {expr!r}"
        missing = names - exported
        assert not missing, f"{expr!r} names {missing}, not exported"
        seen |= names
    # the dashboard covers the new admission metrics and both components
    assert {"tokenmill:requests_rejected_total", "tokenmill:request_deadline_expired_total",
            "tokenmill:num_requests_waiting", "tokenmill_router_requests_rejected_total",
            "tokenmill_router_replica_circuit_open"} <= seen
