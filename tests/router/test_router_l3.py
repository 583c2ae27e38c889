"""A session moved between replicas finds its prefix in the shared L3 tier (a real Redis).

Two ``tokenmill serve`` replicas share one ``redis-server``; a ``tokenmill route`` process sits
in front. A session runs a few turns on its home replica, the home replica is killed, and the
next turn (routed to the survivor) reports most of its prompt as cached, from L3.
"""
from __future__ import annotations

import os
import re
import signal
import time

import httpx
import openai
import pytest

from router_fleet import MODEL, serve_argv, start_router
from tokenmill.utils.proc import ServiceProcess

REPLICA = "x-tokenmill-replica"


def metric(base: str, name: str, tier: str) -> float:
    text = httpx.get(base + "/metrics", timeout=10).text
    m = re.search(rf'^tokenmill:{name}{{model_name="{MODEL}",tier="{tier}"}} (\S+)$', text, re.M)
    assert m, f"{name} missing from /metrics"
    return float(m.group(1))


@pytest.fixture
def redis_url():
    from tokenmill.utils.redis_server import RedisServer

    try:
        server = RedisServer()
    except FileNotFoundError as e:
        if os.environ.get("CI"):
            pytest.fail(str(e))
        pytest.skip(str(e))
    with server:
        yield server.url


def test_moved_session_finds_its_prefix_in_redis(tiny_dir: str, redis_url: str) -> None:
    argv = serve_argv(tiny_dir) + ["--cache-storage", redis_url, "--page-size", "16"]
    replicas = [ServiceProcess(argv), ServiceProcess(argv)]
    router = None
    try:
        for r in replicas:
            r.start()
        router = start_router([r.base_url for r in replicas])
        client = openai.OpenAI(base_url=router.base_url + "/v1", api_key="none", max_retries=0)
        messages = [{"role": "system", "content": "You are a coding agent. " * 30}]
        home = None
        for turn in range(3):
            messages.append({"role": "user", "content": f"step {turn}: run the tests " * 8})
            raw = client.chat.completions.with_raw_response.create(
                model=MODEL, messages=messages, max_tokens=6, temperature=0,
                extra_headers={"X-Session-ID": "moving"})
            home = home or raw.headers[REPLICA]
            assert raw.headers[REPLICA] == home
            messages.append({"role": "assistant", "content": raw.parse().choices[0].message.content})
        idx = [r.base_url.split("://", 1)[1] for r in replicas].index(home)
        survivor = replicas[1 - idx]
        # write-through pages reach Redis off the engine step; wait until the last turn's are
        # there, then kill the home replica hard
        last = raw.parse().usage
        want = (last.prompt_tokens + last.completion_tokens - 1) // 16
        deadline = time.monotonic() + 20
        while metric(replicas[idx].base_url, "cache_tier_pages_written_total", "l3") < want:
            assert time.monotonic() < deadline, "write-through pages never reached Redis"
            time.sleep(0.1)
        replicas[idx].stop(signal.SIGKILL)
        messages.append({"role": "user", "content": "step 3: now fix the failing test " * 4})
        raw = None
        for _ in range(40):   # until the router has seen the replica go
            try:
                raw = client.chat.completions.with_raw_response.create(
                    model=MODEL, messages=messages, max_tokens=6, temperature=0,
                    extra_headers={"X-Session-ID": "moving"})
                break
            except openai.APIError:
                time.sleep(0.25)
        assert raw is not None and raw.headers[REPLICA] == survivor.base_url.split("://", 1)[1]
        usage = raw.parse().usage
        details = usage.prompt_tokens_details
        tiers = details.model_extra["cached_tokens_by_tier"]
        assert details.cached_tokens >= 0.8 * usage.prompt_tokens, (usage, tiers)
        assert tiers["l3"] >= 0.8 * usage.prompt_tokens and tiers["l1"] == 0
        assert metric(survivor.base_url, "cache_tier_hit_tokens_total", "l3") == tiers["l3"]
        # admin: flush this model's L3 pages; the next cold replica finds nothing
        flushed = httpx.post(survivor.base_url + "/flush_cache/storage", timeout=30).json()
        assert flushed["flushed"] and flushed["pages_deleted"] > 0
        assert httpx.post(survivor.base_url + "/flush_cache", timeout=30).json() == {"flushed": True}
        again = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, temperature=0,
                                               extra_headers={"X-Session-ID": "moving"})
        assert again.usage.prompt_tokens_details.cached_tokens == 0
    finally:
        if router is not None:
            router.stop()
        for r in replicas:
            if r.proc is not None:
                r.stop()
