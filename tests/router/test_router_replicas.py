"""Replica registry, load parsing and discovery (no replicas needed: plain state and files)."""
from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from tokenmill.router.app import RouterConfig, prompt_prefix_key
from tokenmill.router.discovery import Discovery, parse_dns_target, read_replica_file, sync_source
from tokenmill.router.replicas import (
    DispersionSampler, HealthConfig, ReplicaRegistry, normalize_url, parse_loads_json, parse_metrics_text,
)


def test_urls_are_normalized_and_bad_ones_rejected():
    assert normalize_url("127.0.0.1:8000/") == "http://127.0.0.1:8000"
    assert normalize_url(" https://h.example:9/api ") == "https://h.example:9/api"
    for bad in ("ftp://x:1", "http://", "http://h:notaport"):
        with pytest.raises(ValueError):
            normalize_url(bad)


def test_health_state_machine_uses_thresholds():
    reg = ReplicaRegistry(HealthConfig(failure_threshold=2, recovery_threshold=3))
    r = reg.add("http://127.0.0.1:9001", source="flag")
    assert r.id == "127.0.0.1:9001" and not r.healthy
    reg.record_success(r.id)                 # a new replica needs one success
    assert r.healthy
    reg.record_failure(r.id, "x")
    assert r.healthy                         # one failure is not enough
    reg.record_failure(r.id, "x")
    assert not r.healthy
    reg.record_success(r.id)
    reg.record_success(r.id)
    assert not r.healthy                     # recovery needs three in a row
    reg.record_failure(r.id, "x")
    reg.record_success(r.id)
    reg.record_success(r.id)
    reg.record_success(r.id)
    assert r.healthy and r.failures_total == 3


def test_draining_replica_leaves_when_its_last_request_ends():
    reg = ReplicaRegistry()
    r = reg.add("http://127.0.0.1:9001", source="admin")
    reg.request_started(r.id)
    reg.drain(r.id)
    assert r.id in reg and r.view().draining and not r.view().eligible
    reg.request_finished(r.id)
    assert r.id not in reg
    with pytest.raises(KeyError):
        reg.drain(r.id)
    with pytest.raises(ValueError, match="already names"):
        reg.add("http://127.0.0.1:9002", source="admin", replica_id="a")
        reg.add("http://127.0.0.1:9003", source="admin", replica_id="a")
    with pytest.raises(ValueError, match="may only hold"):
        reg.add("http://127.0.0.1:9004", source="admin", replica_id="a/b")


def test_finished_requests_come_off_the_last_load_report():
    reg = ReplicaRegistry()
    r = reg.add("http://127.0.0.1:9001", source="flag")
    reg.request_started(r.id)
    reg.request_started(r.id)
    reg.record_load(r.id, 1, 1, 0.5, source="v1/loads")
    assert r.view().active == 2
    reg.request_finished(r.id)
    assert (r.num_running, r.num_waiting, r.view().active) == (0, 1, 1)
    reg.request_finished(r.id)
    assert r.view().active == 0 and r.kv_cache_usage == 0.5


def test_load_reports_from_v1_loads_and_prometheus_text():
    assert parse_loads_json({"num_running": 2, "num_waiting": 1, "kv_cache_usage": 0.5, "model": "m"}) == (2, 1, 0.5)
    # a hybrid model's replica: the fuller of its KV pages and its state slots
    assert parse_loads_json({"num_running": 4, "num_waiting": 3, "kv_cache_usage": 0.1, "state_pool_usage": 1.0}) == (4, 3, 1.0)
    assert parse_loads_json({"num_running": 1, "num_waiting": 0, "kv_cache_usage": 0.6, "state_pool_usage": 0.25}) == (1, 0, 0.6)
    assert parse_loads_json([{"num_running": 1, "num_waiting": 0, "kv_cache_usage": 0.2},
                             {"num_running": 3, "num_waiting": 2, "kv_cache_usage": 0.4}]) == (4, 2, pytest.approx(0.3))
    assert parse_loads_json({"status": "ok"}) is None
    text = "\n".join([
        "# HELP vllm:num_requests_running x", "# TYPE vllm:num_requests_running gauge",
        'vllm:num_requests_running{model_name="a",engine="0"} 3', 'vllm:num_requests_running{model_name="a",engine="1"} 2',
        'vllm:num_requests_waiting{model_name="a"} 4', 'vllm:kv_cache_usage_perc{model_name="a"} 0.75',
        "garbage line", 'vllm:num_requests_waiting_by_reason{reason="x"} NaN'])
    assert parse_metrics_text(text) == (5, 4, 0.75)
    assert parse_metrics_text("sglang:num_running_reqs 7\nsglang:num_queue_reqs 1\nsglang:token_usage 0.1") == (7, 1, 0.1)
    assert parse_metrics_text("up 1") is None


def test_dispersion_index_is_variance_over_mean():
    d = DispersionSampler()
    d.add([2, 2, 2, 2])
    assert d.index == 0.0
    d.add([0, 4, 0, 4])            # all 8 values: mean 2, variance 2
    assert d.mean == pytest.approx(2.0) and d.variance == pytest.approx(2.0) and d.index == pytest.approx(1.0)
    reg = ReplicaRegistry()
    a = reg.add("http://127.0.0.1:1", source="flag")
    reg.record_success(a.id)
    reg.sample_dispersion()         # nothing in flight: no sample
    assert reg.dispersion.count == 0
    reg.request_started(a.id)
    reg.sample_dispersion()
    assert reg.dispersion.count == 1


def test_replica_file_parsing_and_source_sync(tmp_path: Path):
    f = tmp_path / "r.txt"
    f.write_text("# comment\n\nhttp://10.0.0.1:8000\n10.0.0.2:8000  # trailing\n")
    assert read_replica_file(f) == ["http://10.0.0.1:8000", "http://10.0.0.2:8000"]
    f.write_text("http://ok:1\nftp://nope\n")
    with pytest.raises(ValueError, match=r"r.txt:2"):
        read_replica_file(f)
    reg = ReplicaRegistry()
    reg.add("http://10.0.0.9:8000", source="flag")
    sync_source(reg, "file", ["http://10.0.0.1:8000", "http://10.0.0.2:8000", "http://10.0.0.9:8000"])
    assert {r.id: r.source for r in reg.all()} == {"10.0.0.9:8000": "flag", "10.0.0.1:8000": "file",
                                                   "10.0.0.2:8000": "file"}
    reg.request_started("10.0.0.2:8000")
    sync_source(reg, "file", [])     # the flag replica stays; the busy one drains, the idle one goes
    assert {r.id: r.draining for r in reg.all()} == {"10.0.0.9:8000": False, "10.0.0.2:8000": True}


def test_discovery_reloads_the_file_only_when_it_changes(tmp_path: Path):
    f = tmp_path / "r.txt"
    f.write_text("http://10.0.0.1:8000\n")
    reg = ReplicaRegistry()
    disc = Discovery(reg, str(f), (), 1.0)
    assert disc.load_file() and not disc.load_file()
    f.write_text("http://10.0.0.1:8000\nhttp://10.0.0.3:8000\n")
    assert disc.load_file() and len(reg.all()) == 2
    f.write_text("broken ftp://\n")
    assert not disc.load_file() and len(reg.all()) == 2


def test_dns_discovery_resolves_localhost():
    assert parse_dns_target("svc.ns.svc.cluster.local:8000") == ("svc.ns.svc.cluster.local", 8000)
    for bad in ("svc", "svc:", ":80", "svc:99999"):
        with pytest.raises(ValueError):
            parse_dns_target(bad)
    reg = ReplicaRegistry()
    asyncio.run(Discovery(reg, None, ("localhost:8123",), 1.0).resolve_dns())
    assert [r.id for r in reg.all()] == ["127.0.0.1:8123"]


def test_prefix_keys_keep_earlier_turns_as_prefixes():
    turn1 = {"messages": [{"role": "system", "content": "S"}, {"role": "user", "content": "u1"}]}
    turn2 = {"messages": turn1["messages"] + [{"role": "assistant", "content": "a1"},
                                              {"role": "user", "content": [{"type": "text", "text": "u2"}]}]}
    k1, k2 = prompt_prefix_key("/v1/chat/completions", turn1), prompt_prefix_key("/v1/chat/completions", turn2)
    assert isinstance(k1, str) and isinstance(k2, str) and k2.startswith(k1)
    assert prompt_prefix_key("/v1/completions", {"prompt": [1, 2, 3]}) == [1, 2, 3]
    assert prompt_prefix_key("/v1/completions", {"prompt": ["abc", "def"]}) == "abc"
    assert prompt_prefix_key("/v1/completions", {"prompt": 5}) is None


def test_router_config_needs_replicas_and_a_known_policy():
    with pytest.raises(ValueError, match="no replicas"):
        RouterConfig()
    with pytest.raises(ValueError, match="unknown policy"):
        RouterConfig(replicas=["http://h:1"], policy="nope")
    assert RouterConfig(admin_key="k").policy == "agentic"


def test_circuit_breaker_opens_half_opens_and_closes():
    now = [100.0]
    reg = ReplicaRegistry(HealthConfig(breaker_threshold=3, breaker_cooldown_s=5.0))
    reg.clock = lambda: now[0]
    downs: list[str] = []
    reg.on_down = downs.append
    r = reg.add("http://127.0.0.1:9001", source="flag")
    reg.record_success(r.id)
    reg.record_request_result(r.id, False, "http_500")
    reg.record_request_result(r.id, False, "http_500")
    reg.record_request_result(r.id, True)                  # a success resets the count
    reg.record_request_result(r.id, False, "http_500")
    reg.record_request_result(r.id, False, "http_500")
    assert [v.eligible for v in reg.views()] == [True] and downs == []
    assert reg.record_request_result(r.id, False, "http_500") is True
    assert r.circuit_open and downs == []                  # in-flight requests may still finish there
    assert [v.eligible for v in reg.views()] == [False]    # /health may still say 200: no requests
    now[0] += 5.0
    assert [v.eligible for v in reg.views()] == [True]     # half-open: a trial is allowed
    assert reg.record_request_result(r.id, False, "http_500") is True   # the trial fails: open again
    assert r.circuit_open
    now[0] += 5.0
    reg.views()
    reg.record_request_result(r.id, True)
    reg.record_request_result(r.id, False, "http_500")
    assert not r.circuit_open                              # closed again: needs 3 failures anew


def test_health_failure_calls_on_down_once():
    reg = ReplicaRegistry(HealthConfig(failure_threshold=2))
    downs: list[str] = []
    reg.on_down = downs.append
    r = reg.add("http://127.0.0.1:9002", source="flag")
    reg.record_success(r.id)
    for _ in range(4):
        reg.record_failure(r.id, "timeout")
    assert downs == [r.id] and not r.healthy


def test_router_config_checks_limits():
    for bad in ({"max_inflight": 0}, {"max_inflight_per_replica": 0}, {"max_attempts": 0}, {"api_key": ""}):
        with pytest.raises(ValueError):
            RouterConfig(replicas=["http://127.0.0.1:1"], **bad)
