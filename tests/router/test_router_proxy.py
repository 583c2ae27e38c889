"""The router in front of real replicas: ``tokenmill serve`` processes on a tiny random model.

Each test starts its own ``tokenmill route`` process over the module's fleet (see conftest).
The test that kills a replica runs last in this file.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import json
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import openai
import pytest

from router_fleet import MODEL, Fleet, metric, metric_samples, start_router
from tokenmill.utils.proc import free_port

REPLICA = "x-tokenmill-replica"


def rid(url: str) -> str:
    return url.split("://", 1)[1]


def chat(base: str, session: str | None, text: str, max_tokens: int = 4, **kw) -> httpx.Response:
    headers = {"X-Session-ID": session} if session else {}
    body = {"model": MODEL, "messages": [{"role": "user", "content": text}], "max_tokens": max_tokens,
            "temperature": 0, **kw}
    return httpx.post(base + "/v1/chat/completions", json=body, headers=headers, timeout=120)


def loads(base: str) -> dict:
    return httpx.get(base + "/v1/loads", timeout=10).json()


def wait_for(predicate, timeout: float = 20.0, interval: float = 0.1) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()


def test_openai_client_through_the_router(fleet: Fleet):
    urls = [fleet.url(i) for i in range(3)]
    router = start_router(urls)
    try:
        client = openai.OpenAI(base_url=router.base_url + "/v1", api_key="unused", max_retries=0)
        assert [m.id for m in client.models.list().data] == [MODEL]
        raw = client.chat.completions.with_raw_response.create(
            model=MODEL, messages=[{"role": "user", "content": "Say something."}], max_tokens=6,
            extra_headers={"X-Session-ID": "oa-1"})
        first = raw.headers[REPLICA]
        assert first in {rid(u) for u in urls}
        assert raw.parse().usage.completion_tokens == 6
        # streaming goes through chunk by chunk and keeps the session on its replica
        chunks = []
        with client.chat.completions.with_streaming_response.create(
                model=MODEL, messages=[{"role": "user", "content": "Say something."}], max_tokens=6,
                stream=True, extra_headers={"X-Session-ID": "oa-1"}) as resp:
            assert resp.headers[REPLICA] == first
            assert resp.headers["content-type"].startswith("text/event-stream")
            for chunk in resp.parse():
                chunks.append(chunk)
        assert len([c for c in chunks if c.choices and c.choices[0].delta.content is not None]) >= 1
        comp = client.completions.with_raw_response.create(model=MODEL, prompt="Hello", max_tokens=3,
                                                           user="oa-1")   # body field works too
        assert comp.headers[REPLICA] == first and comp.parse().usage.completion_tokens == 3

        h = httpx.get(router.base_url + "/health").json()
        assert h["healthy_replicas"] == 3
        view = loads(router.base_url)
        assert view["router"]["decisions"] == {"placed": 1, "sticky": 2}
        assert {r["id"] for r in view["replicas"]} == {rid(u) for u in urls}
        assert sum(r["sessions"] for r in view["replicas"]) == 1
        assert all(r["load_source"] == "v1/loads" for r in view["replicas"])
        metrics = httpx.get(router.base_url + "/metrics").text
        assert metric(metrics, "tokenmill_router_decisions_total", policy="agentic", kind="sticky") == 2
        sent = {dict(lab)["replica"]: int(v)
                for lab, v in metric_samples(metrics, "tokenmill_router_replica_requests_total").items()}
        assert sum(sent.values()) == 4 and sent[first] >= 3     # /v1/models went to any replica

        bad = httpx.post(router.base_url + "/v1/chat/completions", content=b"{not json", timeout=10)
        assert bad.status_code == 400 and "not valid JSON" in bad.json()["error"]["message"]
        # a replica's own 4xx passes through unchanged (not retried)
        r = httpx.post(router.base_url + "/v1/chat/completions", json={"model": "nope", "messages": []},
                       timeout=10)
        assert r.status_code in (400, 404) and loads(router.base_url)["router"]["retries"] == 0
        assert httpx.post(router.base_url + "/replicas", json={"url": "http://x:1"}).status_code == 403

        # a client that walks away mid-stream frees its slot in the router and on the replica
        body = {"model": MODEL, "messages": [{"role": "user", "content": "long"}], "max_tokens": 4000,
                "ignore_eos": True, "stream": True}
        with httpx.stream("POST", router.base_url + "/v1/chat/completions", json=body, timeout=60,
                          headers={"X-Session-ID": "walks-away"}) as resp:
            lines = resp.iter_lines()
            assert next(line for line in lines if line.startswith("data:"))
            assert loads(router.base_url)["router"]["inflight"] == 1
        assert wait_for(lambda: loads(router.base_url)["router"]["inflight"] == 0)
        assert wait_for(lambda: all(httpx.get(u + "/v1/loads").json()["num_running"] == 0 for u in urls))
    finally:
        router.stop()


def test_anthropic_and_responses_apis_through_the_router(fleet: Fleet):
    import anthropic

    urls = [fleet.url(i) for i in range(3)]
    router = start_router(urls)
    try:
        claude = anthropic.Anthropic(base_url=router.base_url, api_key="unused", max_retries=0)
        homes = set()
        for turn in range(3):   # metadata.user_id is the session: every turn lands on one replica
            raw = claude.messages.with_raw_response.create(
                model=MODEL, max_tokens=3, metadata={"user_id": "claude-session-1"},
                messages=[{"role": "user", "content": f"turn {turn}"}])
            homes.add(raw.headers[REPLICA])
            assert raw.parse().usage.output_tokens >= 1
        assert len(homes) == 1
        counted = claude.messages.count_tokens(model=MODEL, messages=[{"role": "user", "content": "hi"}])
        assert counted.input_tokens > 0

        client = openai.OpenAI(base_url=router.base_url + "/v1", api_key="unused", max_retries=0)
        for _ in range(2):   # without any session id: previous_response_id keeps the conversation home
            raw = client.responses.with_raw_response.create(model=MODEL, input="start", max_output_tokens=3)
            home, resp = raw.headers[REPLICA], raw.parse()
            for turn in range(2):
                events = list(client.responses.create(model=MODEL, input=f"more {turn}", max_output_tokens=3,
                                                      previous_response_id=resp.id, stream=True))
                resp = events[-1].response
                assert resp.previous_response_id is not None
                got = client.responses.with_raw_response.retrieve(resp.id)
                assert got.headers[REPLICA] == home and got.parse().id == resp.id
        assert loads(router.base_url)["router"]["decisions"].get("sticky", 0) >= 2 + 4
    finally:
        router.stop()


def run_bench(base: str, out: Path, seed: int) -> dict:
    cmd = [sys.executable, "-m", "tokenmill.cli", "bench", "--base-url", base, "--model", MODEL,
           "--concurrency", "6", "--sessions", "6", "--turns", "5", "--first-turn-tokens", "96",
           "--new-tokens", "32", "--output-tokens", "8", "--shared-prompt-tokens", "32",
           "--user-turn-prob", "0", "--think-scale", "0.05", "--flush-cache", "--no-progress",
           "--seed", str(seed), "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    doc = json.loads((out / "results.json").read_text())
    (run,) = doc["runs"]
    assert run["num_ok"] == 30 and run["errors"] == 0
    return run


def test_sessions_stick_and_keep_the_single_replica_cache_hit_rate(fleet: Fleet, tmp_path: Path):
    single = run_bench(fleet.url(3), tmp_path / "single", seed=11)
    router = start_router([fleet.url(i) for i in range(3)])
    try:
        routed = run_bench(router.base_url, tmp_path / "routed", seed=11)
        decisions = loads(router.base_url)["router"]["decisions"]
    finally:
        router.stop()
    # 6 sessions x 5 turns: each session placed once, every later turn on the same replica
    # (the bench's warm-up probe carries no session id and is routed by least load)
    assert decisions.get("placed") == 6 and decisions.get("sticky") == 24
    assert not {"split", "moved", "failover", "retry"} & set(decisions)
    assert routed["session_header_echo_rate"] == 1.0
    assert single["cache_hit_rate"] > 0.5
    assert routed["cache_hit_rate"] >= 0.9 * single["cache_hit_rate"], (routed["cache_hit_rate"],
                                                                       single["cache_hit_rate"])


def test_hot_session_spreads_over_replicas(fleet: Fleet):
    router = start_router([fleet.url(i) for i in range(3)], "--session-max-inflight", "2")
    try:
        async def burst() -> list[httpx.Response]:
            async with httpx.AsyncClient(timeout=120) as c:
                body = {"model": MODEL, "messages": [{"role": "user", "content": "parallel " * 30}],
                        "max_tokens": 48, "ignore_eos": True}
                return await asyncio.gather(*(c.post(router.base_url + "/v1/chat/completions", json=body,
                                                     headers={"X-Session-ID": "hot"}) for _ in range(8)))

        responses = asyncio.run(burst())
        assert all(r.status_code == 200 for r in responses)
        used = {r.headers[REPLICA] for r in responses}
        assert len(used) >= 2
        decisions = loads(router.base_url)["router"]["decisions"]
        assert decisions["split"] >= 1 and decisions["placed"] == 1
        # once the burst is over the session goes home again
        home = responses[0].headers[REPLICA] if responses[0].headers.get("x-tokenmill-decision") == "placed" else None
        after = chat(router.base_url, "hot", "parallel " * 30)
        assert after.headers["x-tokenmill-decision"] == "sticky"
        if home is not None:
            assert after.headers[REPLICA] == home
    finally:
        router.stop()


def test_scale_up_moves_few_sessions_and_fills_the_new_replica(fleet: Fleet):
    router = start_router([fleet.url(i) for i in range(3)], "--admin-key", "secret")
    auth = {"Authorization": "Bearer secret"}
    try:
        homes = {}
        for k in range(12):
            homes[f"up{k}"] = chat(router.base_url, f"up{k}", f"session {k} " * 20).headers[REPLICA]
        assert len(set(homes.values())) == 3
        assert httpx.post(router.base_url + "/replicas", json={"url": fleet.url(3)}).status_code == 401
        added = httpx.post(router.base_url + "/replicas", json={"url": fleet.url(3)}, headers=auth)
        assert added.status_code == 201 and added.json()["healthy"] is True
        new_id = added.json()["id"]
        moved = 0
        for k in range(12):
            r = chat(router.base_url, f"up{k}", f"session {k} " * 20)
            assert r.status_code == 200
            moved += r.headers[REPLICA] != homes[f"up{k}"]
        assert moved <= 12 // 4 + 1
        fresh = [chat(router.base_url, f"new{k}", f"fresh {k} " * 20).headers[REPLICA] for k in range(4)]
        assert sum(r == new_id for r in fresh) >= 3
        # drain: no new requests go there, and it leaves once idle
        d = httpx.delete(router.base_url + f"/replicas/{new_id}", headers=auth)
        assert d.status_code == 202 and d.json()["removed"] is True
        assert all(chat(router.base_url, f"new{k}", "x").headers[REPLICA] != new_id for k in range(4))
        assert httpx.delete(router.base_url + "/replicas/nope:1", headers=auth).status_code == 404
    finally:
        router.stop()


def test_replica_file_and_dns_discovery(fleet: Fleet, tmp_path: Path):
    listing = tmp_path / "replicas.txt"
    listing.write_text(f"# fleet\n{fleet.url(0)}\n")
    port2 = fleet.url(2).rsplit(":", 1)[1]
    router = start_router([], "--replica-file", str(listing), "--replica-dns", f"localhost:{port2}",
                          "--discovery-interval", "0.2")
    try:
        def ids() -> set[str]:
            return {r["id"] for r in loads(router.base_url)["replicas"]}

        assert ids() == {rid(fleet.url(0)), f"127.0.0.1:{port2}"}
        listing.write_text(f"{fleet.url(0)}\n{fleet.url(1)}  # added\n")
        assert wait_for(lambda: ids() == {rid(fleet.url(0)), rid(fleet.url(1)), f"127.0.0.1:{port2}"})
        listing.write_text(f"{fleet.url(1)}\n")
        assert wait_for(lambda: ids() == {rid(fleet.url(1)), f"127.0.0.1:{port2}"})
        assert chat(router.base_url, "disc", "hello").status_code == 200
        listing.write_text("not a url at all ::\n")     # a bad file keeps the current replicas
        time.sleep(1.0)
        assert ids() == {rid(fleet.url(1)), f"127.0.0.1:{port2}"}
    finally:
        router.stop()


class _AlwaysFails(BaseHTTPRequestHandler):
    """A real peer that is up (health 200) but answers every API call with 500."""

    def _send(self, code: int, body: bytes) -> None:
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:  # noqa: N802
        self._send(200, b'{"status":"ok"}' if self.path == "/health" else b'{"error":{"message":"boom"}}')

    def do_POST(self) -> None:  # noqa: N802
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self._send(500, b'{"error":{"message":"internal error","type":"server_error","code":500}}')

    def log_message(self, *args: object) -> None:
        pass


def test_500_before_the_first_byte_is_retried_once_elsewhere(fleet: Fleet):
    port = free_port()
    bad = ThreadingHTTPServer(("127.0.0.1", port), _AlwaysFails)
    threading.Thread(target=bad.serve_forever, daemon=True).start()
    bad_url = f"http://127.0.0.1:{port}"
    router = start_router([bad_url, fleet.url(0)], "--policy", "round_robin")
    try:
        responses = [chat(router.base_url, None, f"retry {k}") for k in range(4)]
        assert all(r.status_code == 200 for r in responses)
        assert all(r.headers[REPLICA] == rid(fleet.url(0)) for r in responses)
        view = loads(router.base_url)
        totals = {r["id"]: r["requests_total"] for r in view["replicas"]}
        # every attempt on the bad replica was retried once, on the good one
        assert view["router"]["retries"] == totals[rid(bad_url)] >= 1
        assert totals[rid(fleet.url(0))] == 4
        # with only the bad replica left the client gets its 500 after one retry
        router.stop()
        router = start_router([bad_url, f"http://127.0.0.1:{free_port()}"])
        r = chat(router.base_url, "s", "x")
        assert r.status_code == 500 and r.headers[REPLICA] == rid(bad_url)
    finally:
        router.stop()
        bad.shutdown()


class _BreaksOff(BaseHTTPRequestHandler):
    """A real peer that starts a response, promises more bytes than it sends, and hangs up."""

    def do_GET(self) -> None:  # noqa: N802
        body = b'{"status":"ok"}'
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self) -> None:  # noqa: N802
        request = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
        self.send_response(200)
        if request.get("stream"):
            self.send_header("Content-Type", "text/event-stream")
            part = b'data: {"choices":[{"index":0,"delta":{"content":"partial"}}]}\n\n'
        else:
            self.send_header("Content-Type", "application/json")
            part = b'{"choices": [{"index": 0, "mess'
        self.send_header("Content-Length", "100000")
        self.end_headers()
        self.wfile.write(part)
        self.wfile.flush()
        self.close_connection = True

    def log_message(self, *args: object) -> None:
        pass


def test_failure_after_the_first_byte_reaches_the_client_as_an_error():
    port = free_port()
    peer = ThreadingHTTPServer(("127.0.0.1", port), _BreaksOff)
    threading.Thread(target=peer.serve_forever, daemon=True).start()
    router = start_router([f"http://127.0.0.1:{port}"])
    try:
        body = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "stream": True}
        with httpx.stream("POST", router.base_url + "/v1/chat/completions", json=body, timeout=30) as resp:
            assert resp.status_code == 200
            lines = [line[5:].strip() for line in resp.iter_lines() if line.startswith("data:")]
        assert lines[-1] == "[DONE]"        # the stream ends like a normal one, after the error event
        events = [json.loads(x) for x in lines[:-1]]
        assert events[0]["choices"][0]["delta"]["content"] == "partial"
        assert events[-1]["error"]["type"] == "upstream_error"
        r = httpx.post(router.base_url + "/v1/chat/completions", json={**body, "stream": False}, timeout=30)
        assert r.status_code == 502 and "broke off" in r.json()["error"]["message"]
        view = loads(router.base_url)
        assert view["router"]["retries"] == 0 and view["router"]["inflight"] == 0
        assert metric(httpx.get(router.base_url + "/metrics").text, "tokenmill_router_midstream_errors_total") == 2
    finally:
        router.stop()
        peer.shutdown()


KEY, ADMIN = "sk-router-key", "sk-router-admin"


def test_router_keys_on_every_endpoint(fleet: Fleet):
    router = start_router([fleet.url(0), fleet.url(1)], "--api-key", KEY, "--admin-key", ADMIN)
    base = router.base_url
    gen = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 1}
    user_routes = [("POST", "/v1/chat/completions", gen),
                   ("POST", "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 1}),
                   ("GET", "/v1/models", None), ("GET", "/v1/loads", None), ("GET", "/metrics", None)]
    admin_routes = [("GET", "/replicas", None), ("POST", "/replicas", {"url": "http://127.0.0.1:1"}),
                    ("DELETE", "/replicas/nope:1", None), ("POST", "/flush_cache", None)]
    wrong = [{}, {"Authorization": "Bearer nope"}, {"Authorization": f"Token {KEY}"}]
    try:
        for method, path, body in user_routes:
            for headers in [*wrong, {"Authorization": f"Bearer {ADMIN}"}]:
                r = httpx.request(method, base + path, json=body, headers=headers, timeout=30)
                assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", (path, headers)
            r = httpx.request(method, base + path, json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
            assert r.status_code == 200, (path, r.text)
        for method, path, body in admin_routes:
            for headers in [*wrong, {"Authorization": f"Bearer {KEY}"}]:
                r = httpx.request(method, base + path, json=body, headers=headers, timeout=30)
                assert r.status_code == 401, (path, headers, r.text)
        ok = {"Authorization": f"Bearer {ADMIN}"}
        assert httpx.get(base + "/replicas", headers=ok).status_code == 200
        assert httpx.delete(base + "/replicas/nope:1", headers=ok).status_code == 404
        assert httpx.post(base + "/flush_cache", headers=ok, timeout=30).json()["flushed"] is True
        assert httpx.get(base + "/health").status_code == 200           # probes need no key
        openai.OpenAI(base_url=base + "/v1", api_key=KEY, max_retries=0).models.list()
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=base + "/v1", api_key="bad", max_retries=0).models.list()
    finally:
        router.stop()


def test_router_admission_limits_and_body_limits(fleet: Fleet):
    long = {"model": MODEL, "messages": [{"role": "user", "content": "go"}], "max_tokens": 900, "ignore_eos": True}
    router = start_router([fleet.url(0), fleet.url(1)], "--max-inflight-per-replica", "1", "--retry-after-s", "2",
                          "--max-request-bytes", "65536", "--max-json-depth", "16")
    try:
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            running = [pool.submit(httpx.post, router.base_url + "/v1/chat/completions", json=long, timeout=120)
                       for _ in range(2)]
            assert wait_for(lambda: loads(router.base_url)["router"]["inflight"] == 2)
            r = httpx.post(router.base_url + "/v1/chat/completions", json=long, timeout=30)
            assert r.status_code == 429 and r.headers["retry-after"] == "2", r.text
            assert r.json()["error"]["code"] == "replicas_full"
            assert all(f.result().status_code == 200 for f in running)
        text = httpx.get(router.base_url + "/metrics").text
        assert metric(text, "tokenmill_router_requests_rejected_total", reason="replicas_full") == 1
        big = httpx.post(router.base_url + "/v1/completions", content=b"{" + b" " * 70000 + b"}", timeout=30)
        assert big.status_code == 413 and big.json()["error"]["code"] == "request_too_large"
        deep = httpx.post(router.base_url + "/v1/completions", content="[" * 20000 + "]" * 20000, timeout=30)
        assert deep.status_code == 400 and deep.json()["error"]["code"] == "json_too_deep"
        assert chat(router.base_url, None, "still here").status_code == 200
    finally:
        router.stop()
    router = start_router([fleet.url(0), fleet.url(1)], "--max-inflight", "1")
    try:
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            running = pool.submit(httpx.post, router.base_url + "/v1/chat/completions", json=long, timeout=120)
            assert wait_for(lambda: loads(router.base_url)["router"]["inflight"] == 1)
            r = httpx.post(router.base_url + "/v1/chat/completions", json=long, timeout=30)
            assert r.status_code == 429 and r.json()["error"]["code"] == "fleet_full", r.text
            assert running.result().status_code == 200
    finally:
        router.stop()


def test_killed_replica_only_its_sessions_move(fleet: Fleet):
    """Runs last: kills replica 3."""
    urls = [fleet.url(i) for i in (1, 2, 3)]
    victim = rid(fleet.url(3))
    router = start_router(urls, "--health-interval", "0.5")
    try:
        homes = {f"k{k}": chat(router.base_url, f"k{k}", f"killed {k} " * 20).headers[REPLICA] for k in range(9)}
        lost = {s for s, h in homes.items() if h == victim}
        assert lost and len(lost) < 9
        fleet.kill(3)
        second = {}
        for s in homes:                               # right after the kill: connect errors are retried
            r = chat(router.base_url, s, "next turn")
            assert r.status_code == 200
            second[s] = r.headers[REPLICA]
        assert wait_for(lambda: not next(r for r in loads(router.base_url)["replicas"] if r["id"] == victim)["healthy"])
        for s in homes:
            r = chat(router.base_url, s, "third turn")
            assert r.status_code == 200
            if s in lost:
                assert r.headers[REPLICA] != victim and r.headers[REPLICA] == second[s]
            else:
                assert r.headers[REPLICA] == homes[s] == second[s]
        decisions = loads(router.base_url)["router"]["decisions"]
        assert decisions["failover"] == len(lost)
        assert httpx.get(router.base_url + "/health").json()["healthy_replicas"] == 2
    finally:
        router.stop()
