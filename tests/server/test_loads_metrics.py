"""/v1/loads, /metrics, /flush_cache, /v1/models, concurrency and client disconnects."""
from __future__ import annotations

import asyncio
import re
import time
import uuid

import httpx
import openai

from tests.server.conftest import MODEL_NAME, PAGE_SIZE, loads

_SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})? (\S+)$')


def scrape(http: httpx.Client) -> dict[str, float]:
    """Metric samples as {'name{labels}': value}; checks the exposition format on the way."""
    resp = http.get("/metrics")
    assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/plain")
    out: dict[str, float] = {}
    typed: set[str] = set()
    for line in resp.text.splitlines():
        if line.startswith("# TYPE "):
            typed.add(line.split()[2])
            continue
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE.match(line)
        assert m, f"bad exposition line: {line!r}"
        name = m.group(1)
        assert any(name == t or name.startswith(t + "_") for t in typed), f"{name} has no TYPE line"
        assert 'model_name="' in (m.group(2) or ""), f"{line!r} lacks the model_name label"
        rest = [p for p in re.findall(r'[a-zA-Z_]+="[^"]*"', m.group(2)) if not p.startswith("model_name=")]
        labels = "{" + ",".join(sorted(rest)) + "}" if rest else ""
        out[name + labels] = float(m.group(3))
    return out


def wait_until_idle(http: httpx.Client, timeout: float = 60.0) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        state = loads(http)
        if state["num_running"] == 0 and state["num_waiting"] == 0:
            return state
        time.sleep(0.05)
    raise AssertionError(f"engine still busy after {timeout}s: {loads(http)}")


def test_models_and_health(client: openai.OpenAI, http: httpx.Client) -> None:
    assert [m.id for m in client.models.list().data] == [MODEL_NAME]
    assert http.get("/health").json() == {"status": "ok"}


def test_metrics_counters_move(client: openai.OpenAI, http: httpx.Client) -> None:
    before = scrape(http)
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc",
                 "prefix_cache_queries_total", "prefix_cache_hits_total", "prompt_tokens_total",
                 "generation_tokens_total"):
        assert f"tokenmill:{name}" in before
    ids = [int(x) for x in range(1000, 1000 + 40)]
    first = client.completions.create(model=MODEL_NAME, prompt=ids, max_tokens=7, extra_body={"ignore_eos": True})
    second = client.completions.create(model=MODEL_NAME, prompt=ids, max_tokens=7, extra_body={"ignore_eos": True})
    after = scrape(http)

    def delta(name: str) -> float:
        return after[name] - before.get(name, 0.0)

    assert first.usage.prompt_tokens_details.cached_tokens == 0
    hit = second.usage.prompt_tokens_details.cached_tokens
    assert hit == (40 - 1) // PAGE_SIZE * PAGE_SIZE  # turn 1 cached the whole pages of the prompt
    assert delta("tokenmill:prompt_tokens_total") == 80
    assert delta("tokenmill:prefix_cache_queries_total") == 80
    assert delta("tokenmill:prefix_cache_hits_total") == hit
    assert delta("tokenmill:generation_tokens_total") == 14
    assert delta('tokenmill:request_success_total{finished_reason="length"}') == 2
    assert delta("tokenmill:time_to_first_token_seconds_count") == 2
    assert delta("tokenmill:e2e_request_latency_seconds_count") == 2
    assert delta("tokenmill:inter_token_latency_seconds_count") == 12
    assert delta('tokenmill:e2e_request_latency_seconds_bucket{le="+Inf"}') == 2
    assert after["tokenmill:e2e_request_latency_seconds_sum"] > before["tokenmill:e2e_request_latency_seconds_sum"]
    assert after["tokenmill:num_requests_running"] == 0
    buckets = [v for k, v in after.items() if k.startswith("tokenmill:time_to_first_token_seconds_bucket")]
    assert buckets == sorted(buckets)  # cumulative


def test_sixteen_concurrent_streams_all_finish(async_client: openai.AsyncOpenAI, http: httpx.Client) -> None:
    async def one(i: int) -> tuple[str, str | None, int]:
        stream = await async_client.chat.completions.create(
            model=MODEL_NAME, messages=[{"role": "user", "content": f"stream {i} {uuid.uuid4().hex}"}],
            max_tokens=24, stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        text, finish, tokens = "", None, 0
        async for chunk in stream:
            if chunk.usage is not None:
                tokens = chunk.usage.completion_tokens
            if chunk.choices:
                text += chunk.choices[0].delta.content or ""
                finish = chunk.choices[0].finish_reason or finish
        return text, finish, tokens

    async def main() -> list[tuple[str, str | None, int]]:
        return await asyncio.gather(*(one(i) for i in range(16)))

    results = asyncio.run(main())
    assert len(results) == 16
    assert all(finish == "length" and tokens == 24 and text for text, finish, tokens in results)
    assert wait_until_idle(http)["num_running"] == 0


def test_disconnect_mid_stream_frees_pages(server, http: httpx.Client) -> None:
    assert http.post("/flush_cache").json() == {"flushed": True}
    idle = wait_until_idle(http)
    assert idle["kv_pages_free"] == idle["kv_pages_total"]
    body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "go on " * 20}], "max_tokens": 900,
            "stream": True, "ignore_eos": True}
    with httpx.Client(base_url=server.base_url, timeout=60) as own:
        with own.stream("POST", "/v1/chat/completions", json=body) as resp:
            assert resp.status_code == 200
            # the line iterator stays open while loads are read: closing it (a break out of the
            # loop) can drop the connection, and the server would abort before the read
            lines, seen = resp.iter_lines(), 0
            while seen < 4:
                line = next(lines)
                seen += line.startswith("data: ") and '"content"' in line
            busy = loads(http)
            lines.close()
            assert busy["num_running"] == 1 and busy["kv_pages_free"] < idle["kv_pages_free"]
    # the client is gone: the request must be aborted (it would run for 900 tokens otherwise)
    after = wait_until_idle(http, timeout=30)
    assert after["kv_pages_free"] + after["kv_pages_cached"] == after["kv_pages_total"]
    assert after["generation_tokens"] - busy["generation_tokens"] < 900 - 4
    assert http.post("/flush_cache").json() == {"flushed": True}
    assert loads(http)["kv_pages_free"] == idle["kv_pages_free"]
    metrics = scrape(http)
    assert metrics['tokenmill:request_success_total{finished_reason="abort"}'] >= 1


def test_disconnect_of_non_streamed_request_aborts_it(server, http: httpx.Client) -> None:
    before = loads(http)
    body = {"model": MODEL_NAME, "prompt": "wait for me", "max_tokens": 900, "ignore_eos": True}
    with httpx.Client(base_url=server.base_url, timeout=httpx.Timeout(60, read=0.5)) as own:
        try:
            own.post("/v1/completions", json=body)
            raise AssertionError("a 900-token completion should not be ready within the read timeout")
        except httpx.ReadTimeout:
            pass
    after = wait_until_idle(http, timeout=30)
    assert after["generation_tokens"] - before["generation_tokens"] < 900


def test_flush_cache_empties_prefix_cache(client: openai.OpenAI, http: httpx.Client) -> None:
    ids = list(range(2000, 2000 + 3 * PAGE_SIZE + 5))
    client.completions.create(model=MODEL_NAME, prompt=ids, max_tokens=1)
    warm = client.completions.create(model=MODEL_NAME, prompt=ids, max_tokens=1)
    assert warm.usage.prompt_tokens_details.cached_tokens == 3 * PAGE_SIZE
    assert http.post("/flush_cache").json() == {"flushed": True}
    state = loads(http)
    assert state["kv_pages_cached"] == 0 and state["kv_pages_free"] == state["kv_pages_total"]
    cold = client.completions.create(model=MODEL_NAME, prompt=ids, max_tokens=1)
    assert cold.usage.prompt_tokens_details.cached_tokens == 0
