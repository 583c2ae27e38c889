"""Admission control and limits on a server that can run one request at a time:
a bounded queue (429 + Retry-After), a queue-wait limit (503), deadlines (finish_reason
"deadline"), body size (413 before parsing), JSON depth (400), early refusal of huge prompts,
the metrics that count all of these, and that pages are back after each."""
from __future__ import annotations

import concurrent.futures
import json
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from tokenmill.utils.proc import ServiceProcess

MAX_BYTES = 12 * 2**20
LONG = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 600, "ignore_eos": True}


def _one_at_a_time(checkpoint: Path, log: Path, queue_wait_s: float) -> ServiceProcess:
    argv = ["serve", "--model", str(checkpoint), "--served-model-name", "tiny", "--kv-cache-tokens", "8192",
            "--max-model-len", "1024", "--max-running-requests", "1", "--max-waiting-requests", "2",
            "--max-queue-wait-s", str(queue_wait_s), "--max-request-bytes", str(MAX_BYTES), "--max-json-depth", "32",
            "--retry-after-s", "3", "--log-requests", "--debug-checks"]
    return ServiceProcess(argv, log_path=log)


@pytest.fixture(scope="module")
def busy_server(tiny_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServiceProcess]:
    with _one_at_a_time(tiny_checkpoint, tmp_path_factory.mktemp("overload") / "server.log", 0.5) as proc:
        yield proc


@pytest.fixture(scope="module")
def patient_server(tiny_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServiceProcess]:
    """The same limits with a queue wait of a minute: a full queue stays full while it is probed
    (with 0.5 s, a loaded machine could time the queued requests out before the probe saw them)."""
    with _one_at_a_time(tiny_checkpoint, tmp_path_factory.mktemp("overload-full") / "server.log", 60.0) as proc:
        yield proc


@pytest.fixture(scope="module")
def http(busy_server: ServiceProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=busy_server.base_url, timeout=120) as c:
        yield c


def idle_loads(http: httpx.Client, timeout: float = 60.0) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        s = http.get("/v1/loads").json()
        if s["num_running"] == 0 and s["num_waiting"] == 0:
            assert s["kv_pages_in_use"] == 0, s
            assert s["kv_pages_free"] + s["kv_pages_cached"] == s["kv_pages_total"], s
            return s
        time.sleep(0.05)
    raise AssertionError(f"still busy: {http.get('/v1/loads').json()}")


def metric(http: httpx.Client, name: str, **labels: str) -> float:
    want = [f'{k}="{v}"' for k, v in labels.items()]
    for line in http.get("/metrics").text.splitlines():
        if line.startswith(name + "{") and all(w in line for w in want):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} {labels} not exported")


def error_of(resp: httpx.Response, status: int, code: str) -> dict:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == code, err
    return err


def wait_running(http: httpx.Client, running: int, waiting: int = 0) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        s = http.get("/v1/loads").json()
        if s["num_running"] >= running and s["num_waiting"] >= waiting:
            return
        time.sleep(0.02)
    raise AssertionError(f"never reached running={running} waiting={waiting}: {s}")


def start_running(http: httpx.Client, pool: concurrent.futures.Executor, body: dict) -> concurrent.futures.Future:
    """Send the request that takes the one running slot; return its future once the server shows
    it running. With the busy server's queue wait of 0.5 s, a loaded machine can delay even this
    first request that long between its arrival and the engine (CI once saw it): it then comes
    back 503 queue_timeout, and is sent again (at most three times)."""
    for _ in range(3):
        fut = pool.submit(http.post, "/v1/completions", json=body)
        deadline = time.monotonic() + 30
        while not fut.done() and time.monotonic() < deadline:
            s = http.get("/v1/loads").json()
            if s["num_running"] >= 1:
                return fut
            time.sleep(0.02)
        if not fut.done():
            raise AssertionError(f"never running after 30 s: {s}")
        r = fut.result()
        if r.status_code == 503:
            error_of(r, 503, "queue_timeout")
        else:
            assert r.status_code == 200, r.text   # done before a poll saw it: send it again
    raise AssertionError(f"three tries never saw the first request running: {http.get('/v1/loads').json()}")


def test_queue_full_gets_429_with_retry_after(patient_server: ServiceProcess) -> None:
    with httpx.Client(base_url=patient_server.base_url, timeout=120) as http:
        _queue_full(http, patient_server)


def _queue_full(http: httpx.Client, server: ServiceProcess) -> None:
    before = metric(http, "tokenmill:requests_rejected_total", reason="queue_full")
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        first = start_running(http, pool, LONG)
        queued = [pool.submit(http.post, "/v1/completions", json={**LONG, "max_tokens": 4}) for _ in range(2)]
        wait_running(http, 1, 2)
        over = http.post("/v1/completions", json=LONG)
        err = error_of(over, 429, "queue_full")
        assert over.headers["retry-after"] == "3" and "overloaded" in err["message"]
        # the official client sees a RateLimitError
        client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0)
        with pytest.raises(openai.RateLimitError):
            client.completions.create(model="tiny", prompt="hi", max_tokens=2)
        assert first.result().status_code == 200
        for q in queued:   # they waited behind a 600-token request, well within the queue wait: served
            r = q.result()
            assert r.status_code == 200, r.text
    assert metric(http, "tokenmill:requests_rejected_total", reason="queue_full") >= before + 2
    assert metric(http, "tokenmill:max_waiting_requests") == 2
    idle_loads(http)


def test_queue_wait_limit_gives_503(http: httpx.Client) -> None:
    before = metric(http, "tokenmill:requests_rejected_total", reason="queue_timeout")
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        first = start_running(http, pool, {**LONG, "max_tokens": 1000})
        waited = pool.submit(http.post, "/v1/completions", json={**LONG, "max_tokens": 2})
        body = {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "max_tokens": 2, "stream": True}
        with http.stream("POST", "/v1/chat/completions", json=body) as streamed:
            streamed.read()
            error_of(streamed, 503, "queue_timeout")
            assert streamed.headers["retry-after"] == "3"
        err = error_of(waited.result(), 503, "queue_timeout")
        assert "0.5" in err["message"]
        assert first.result().status_code == 200
    assert metric(http, "tokenmill:requests_rejected_total", reason="queue_timeout") >= before + 2
    idle_loads(http)


def test_deadline_finishes_request_and_frees_pages(http: httpx.Client, busy_server: ServiceProcess) -> None:
    before = metric(http, "tokenmill:request_deadline_expired_total")
    t0 = time.monotonic()
    r = http.post("/v1/completions", json={**LONG, "max_tokens": 1000, "deadline_s": 0.4})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "deadline"
    assert 0 < r.json()["usage"]["completion_tokens"] < 1000
    assert time.monotonic() - t0 < 30
    # streamed, with the official client: the last chunk carries the reason
    client = openai.OpenAI(base_url=busy_server.base_url + "/v1", api_key="x", max_retries=0)
    chunks = list(client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "go"}], max_tokens=900, stream=True,
        extra_body={"ignore_eos": True, "deadline_s": 0.4}))
    assert chunks[-1].choices[0].finish_reason == "deadline"
    assert metric(http, "tokenmill:request_deadline_expired_total") >= before + 2
    assert metric(http, "tokenmill:request_success_total", finished_reason="deadline") >= 2
    error_of(http.post("/v1/completions", json={**LONG, "deadline_s": -1}), 400, "invalid_value")
    idle_loads(http)


def test_deadline_while_waiting(http: httpx.Client) -> None:
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        first = start_running(http, pool, {**LONG, "max_tokens": 800})
        r = http.post("/v1/completions", json={**LONG, "deadline_s": 0.3})
        assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "deadline", r.text
        assert r.json()["usage"]["completion_tokens"] == 0
        assert first.result().status_code == 200
    idle_loads(http)


def test_body_too_large_is_413_before_parsing(http: httpx.Client) -> None:
    before = metric(http, "tokenmill:requests_rejected_total", reason="request_too_large")
    big = b'{"model": "tiny", "prompt": "' + b"a" * MAX_BYTES + b'"}'
    error_of(http.post("/v1/completions", content=big, headers={"content-type": "application/json"}),
             413, "request_too_large")

    def chunks() -> Iterator[bytes]:   # no Content-Length: refused while reading
        for _ in range(MAX_BYTES // 2**20 + 2):
            yield b"x" * 2**20

    error_of(http.post("/v1/chat/completions", content=chunks()), 413, "request_too_large")
    # the limit sits in front of every route, in the shape of the API a path belongs to
    r = http.post("/v1/messages", content=big, headers={"content-type": "application/json"})
    assert r.status_code == 413 and r.json()["type"] == "error", r.text
    assert r.json()["error"]["type"] == "request_too_large"
    assert metric(http, "tokenmill:requests_rejected_total", reason="request_too_large") >= before + 3
    assert http.post("/v1/completions", json={**LONG, "max_tokens": 2}).status_code == 200


@pytest.mark.parametrize("depth", [33, 5000, 200_000])
def test_deep_json_is_400(http: httpx.Client, depth: int) -> None:
    body = '{"model": "tiny", "prompt": "x", "extra": ' + "[" * depth + "]" * depth + "}"
    err = error_of(http.post("/v1/completions", content=body, headers={"content-type": "application/json"}),
                   400, "json_too_deep")
    assert "32" in err["message"]
    deep_obj = {"model": "tiny", "messages": [{"role": "user", "content": "x"}]}
    node = deep_obj
    for _ in range(depth):
        node["n"] = {}
        node = node["n"]
    if depth < 1000:
        error_of(http.post("/v1/chat/completions", json=deep_obj), 400, "json_too_deep")
    ok = {"model": "tiny", "prompt": "x", "max_tokens": 1, "extra": json.loads("[" * 20 + "]" * 20)}
    assert http.post("/v1/completions", json=ok).status_code == 200


def test_huge_prompt_refused_before_tokenizing(http: httpx.Client) -> None:
    text = "lorem ipsum " * (8 * 2**20 // 12)     # about 8 MB of text
    for path, body in (("/v1/completions", {"model": "tiny", "prompt": text}),
                       ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": text}]})):
        err = error_of(http.post(path, json=body), 400, "context_length_exceeded")
        assert "characters" in err["message"], err   # the early check, not the tokenizer's count
    idle_loads(http)


def test_prompts_logged_only_when_asked(http: httpx.Client, busy_server: ServiceProcess) -> None:
    r = http.post("/v1/chat/completions", json={"model": "tiny", "max_tokens": 2,
                                                "messages": [{"role": "user", "content": "zebra-quartz-1729"}]})
    assert r.status_code == 200
    time.sleep(0.2)
    assert "zebra-quartz-1729" in busy_server.log_tail(200_000)   # this server runs --log-requests
