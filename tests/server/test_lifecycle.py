"""A second server with an API key, a tool-aware chat template and a short shutdown grace:
401s, tools reaching the template, and SIGTERM (finish in-flight work, exit 0)."""
from __future__ import annotations

import json
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from tokenmill.utils.proc import ServiceProcess

KEY = "sk-test-4242"
ADMIN = "sk-admin-777"
GRACE_S = 5.0
# A ChatML template that renders tools the way Hermes-style models expect them.
HERMES_TEMPLATE = """{%- if tools %}<|im_start|>system
You may call functions. <tools>
{%- for tool in tools %}{{ "\n" }}{{ tool | tojson }}{%- endfor %}
</tools>
Reply with <tool_call>{"name": ..., "arguments": ...}</tool_call>.<|im_end|>
{% endif %}
{%- for message in messages %}<|im_start|>{{ message['role'] }}
{{ message['content'] }}<|im_end|>
{% endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                            "parameters": {"type": "object",
                                                           "properties": {"city": {"type": "string"}}}}}
CLOCK = {"type": "function", "function": {"name": "get_time", "description": "Current time",
                                          "parameters": {"type": "object", "properties": {}}}}


@pytest.fixture(scope="module")
def keyed_server(tiny_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServiceProcess]:
    tmp = tmp_path_factory.mktemp("keyed")
    template = tmp / "hermes.jinja"
    template.write_text(HERMES_TEMPLATE)
    argv = ["serve", "--model", str(tiny_checkpoint), "--served-model-name", "tiny", "--api-key", KEY,
            "--admin-key", ADMIN,
            "--chat-template", str(template), "--tool-call-parser", "hermes", "--kv-cache-tokens", "16384",
            "--shutdown-grace-s", str(GRACE_S)]
    with ServiceProcess(argv, log_path=tmp / "server.log") as proc:
        yield proc


@pytest.fixture(scope="module")
def keyed_client(keyed_server: ServiceProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=keyed_server.base_url + "/v1", api_key=KEY, max_retries=0, timeout=60)


def test_missing_or_wrong_key_is_401(keyed_server: ServiceProcess, keyed_client: openai.OpenAI) -> None:
    wrong = openai.OpenAI(base_url=keyed_server.base_url + "/v1", api_key="sk-wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as e:
        wrong.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}], max_tokens=1)
    assert e.value.status_code == 401 and e.value.body["code"] == "invalid_api_key"
    for method, path in (("POST", "/v1/completions"), ("GET", "/v1/models"), ("GET", "/metrics"),
                         ("GET", "/v1/loads"), ("POST", "/flush_cache")):
        resp = httpx.request(method, keyed_server.base_url + path, json={"model": "tiny", "prompt": "x"})
        assert resp.status_code == 401, path
        assert set(resp.json()["error"]) == {"message", "type", "param", "code"}
    assert httpx.get(keyed_server.base_url + "/health").status_code == 200   # probes need no key
    # and the right key works
    resp = keyed_client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}],
                                                max_tokens=2)
    assert resp.usage.completion_tokens >= 1
    assert [m.id for m in keyed_client.models.list().data] == ["tiny"]


ENDPOINTS = [("POST", "/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "x"}],
                                               "max_tokens": 1}),
             ("POST", "/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": 1}),
             ("GET", "/v1/models", None), ("GET", "/metrics", None), ("GET", "/v1/loads", None),
             ("GET", "/openapi.json", None)]


@pytest.mark.parametrize(("method", "path", "body"), ENDPOINTS, ids=[e[1] for e in ENDPOINTS])
def test_every_endpoint_missing_wrong_right_key(keyed_server: ServiceProcess, method: str, path: str,
                                                body: dict | None) -> None:
    url = keyed_server.base_url + path
    for headers in ({}, {"Authorization": "Bearer sk-wrong"}, {"Authorization": f"Basic {KEY}"},
                    {"Authorization": f"Bearer {ADMIN}"}):
        resp = httpx.request(method, url, json=body, headers=headers)
        assert resp.status_code == 401, (path, headers, resp.text)
        assert resp.headers["www-authenticate"] == "Bearer"
        assert resp.json()["error"]["code"] == "invalid_api_key"
    resp = httpx.request(method, url, json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
    assert resp.status_code == 200, resp.text


def test_flush_cache_needs_the_admin_key(keyed_server: ServiceProcess) -> None:
    url = keyed_server.base_url + "/flush_cache"
    for headers in ({}, {"Authorization": "Bearer sk-wrong"}, {"Authorization": f"Bearer {KEY}"}):
        resp = httpx.post(url, headers=headers)
        assert resp.status_code == 401, (headers, resp.text)
        assert "admin key" in resp.json()["error"]["message"]
    assert httpx.post(url, headers={"Authorization": f"Bearer {ADMIN}"}).json() == {"flushed": True}


def test_prompts_not_logged_by_default(keyed_server: ServiceProcess, keyed_client: openai.OpenAI) -> None:
    secret = "walrus-nebula-8086"
    keyed_client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": secret}], max_tokens=3)
    with pytest.raises(openai.BadRequestError):   # an error that quotes the input does not log it either
        keyed_client.completions.create(model="tiny", prompt=secret, max_tokens=3, extra_body={"top_k": secret})
    time.sleep(0.2)
    log = keyed_server.log_tail(1_000_000)
    assert "chat" in log and secret not in log


def _prompt_text(client: openai.OpenAI, tokenizer, **kwargs) -> str:
    resp = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "weather?"}],
                                          max_tokens=1, extra_body={"return_token_ids": True}, **kwargs)
    return tokenizer.decode(resp.prompt_token_ids)


def test_tools_reach_the_chat_template(keyed_client: openai.OpenAI, tiny_tokenizer) -> None:
    text = _prompt_text(keyed_client, tiny_tokenizer, tools=[WEATHER, CLOCK])
    assert "<tools>" in text
    rendered = [json.loads(line) for line in text.split("<tools>")[1].split("</tools>")[0].strip().splitlines()]
    assert [t["function"]["name"] for t in rendered] == ["get_weather", "get_time"]
    assert rendered[0]["function"]["parameters"]["properties"] == {"city": {"type": "string"}}
    # a named tool_choice narrows the tools to that one; "none" leaves them out
    named = _prompt_text(keyed_client, tiny_tokenizer, tools=[WEATHER, CLOCK],
                         tool_choice={"type": "function", "function": {"name": "get_time"}})
    assert "get_time" in named and "get_weather" not in named
    assert "<tools>" not in _prompt_text(keyed_client, tiny_tokenizer, tools=[WEATHER], tool_choice="none")
    assert "<tools>" not in _prompt_text(keyed_client, tiny_tokenizer)


def test_tool_choice_naming_an_unknown_tool_is_400(keyed_client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        keyed_client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}], max_tokens=1,
                                             tools=[WEATHER], tool_choice={"type": "function",
                                                                           "function": {"name": "nope"}})
    assert e.value.body["param"] == "tool_choice"


def test_tool_parser_path_streamed_and_not(keyed_client: openai.OpenAI) -> None:
    """With tools and the hermes parser on, plain text output (no calls) comes through unchanged."""
    kwargs = dict(model="tiny", messages=[{"role": "user", "content": "weather in Paris?"}], tools=[WEATHER],
                  max_tokens=10, temperature=0, extra_body={"ignore_eos": True})
    full = keyed_client.chat.completions.create(**kwargs)
    assert full.choices[0].message.tool_calls is None and full.choices[0].finish_reason == "length"
    chunks = list(keyed_client.chat.completions.create(stream=True, **kwargs))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == full.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == "length"


def _read_stream(base_url: str, body: dict, out: dict) -> None:
    lines: list[str] = []
    try:
        with httpx.stream("POST", base_url + "/v1/chat/completions", json=body, timeout=120,
                          headers={"Authorization": f"Bearer {KEY}"}) as resp:
            for line in resp.iter_lines():
                lines.append(line)
                if len(lines) == 3:
                    out["started"].set()
    except httpx.HTTPError as e:
        out["error"] = e
    out["lines"] = lines
    out["started"].set()


def test_port_in_use_exits_1_with_a_message(tiny_checkpoint: Path, tmp_path: Path) -> None:
    """The port is bound before the model loads: when it is taken, serve exits 1 with a message
    at once, without loading the model (no engine log line) and without hanging."""
    import socket
    import subprocess
    import sys

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = subprocess.run([sys.executable, "-m", "tokenmill.cli", "serve", "--model", str(tiny_checkpoint),
                               "--port", str(port), "--kv-cache-tokens", "4096"],
                              capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert f"could not start the HTTP server on 127.0.0.1:{port}" in proc.stderr
    assert "Address already in use" in proc.stderr and "KV cache" not in proc.stderr, proc.stderr[-2000:]


def test_sigterm_finishes_in_flight_work_and_exits_0(keyed_server: ServiceProcess) -> None:
    """Runs last in this module: it stops the module's server."""
    short = {"model": "tiny", "messages": [{"role": "user", "content": "short"}], "max_tokens": 40,
             "stream": True, "ignore_eos": True}
    long = {**short, "messages": [{"role": "user", "content": "long"}], "max_tokens": 4000}
    runs = [{"started": threading.Event()} for _ in range(2)]
    threads = [threading.Thread(target=_read_stream, args=(keyed_server.base_url, body, out))
               for body, out in zip((short, long), runs)]
    for t in threads:
        t.start()
    for out in runs:
        assert out["started"].wait(60)
    assert keyed_server.proc is not None
    t0 = time.monotonic()
    keyed_server.proc.send_signal(signal.SIGTERM)
    assert keyed_server.proc.wait(timeout=GRACE_S + 30) == 0
    took = time.monotonic() - t0
    for t in threads:
        t.join(30)
    short_lines = runs[0]["lines"]
    # the short stream was in flight at SIGTERM and still ran to the end
    assert "data: [DONE]" in short_lines
    finishes = [json.loads(line[6:])["choices"][0]["finish_reason"] for line in short_lines
                if line.startswith("data: {")]
    assert finishes[-1] == "length"
    # the long one either finished within the grace period or was cut when it ran out
    long_done = "data: [DONE]" in runs[1]["lines"]
    assert long_done or took >= GRACE_S * 0.9
    log = keyed_server.log_tail(20000)
    assert "Application shutdown complete" in log
    with pytest.raises(httpx.ConnectError):
        httpx.get(keyed_server.base_url + "/health", timeout=2)


@pytest.mark.parametrize(("argv", "env", "expected"), [
    (["serve", "--help"], None, "1000"),       # the engine's default, set before torch loads
    (["serve", "--help"], "7", "7"),           # the user's own setting wins
    (["plan", "--help"], None, "unset"),       # not an engine command: left alone
])
def test_engine_commands_set_the_openmp_spin_count(argv: list[str], env: str | None, expected: str) -> None:
    import os
    import subprocess
    import sys

    code = ("import os, sys\nfrom tokenmill import cli\ntry:\n    cli.main(sys.argv[1:])\nexcept SystemExit:\n    pass\n"
            "print('SPIN=' + os.environ.get('GOMP_SPINCOUNT', 'unset'))")
    child_env = {k: v for k, v in os.environ.items() if k != "GOMP_SPINCOUNT"}
    if env is not None:
        child_env["GOMP_SPINCOUNT"] = env
    out = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, env=child_env,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == f"SPIN={expected}"


def test_sigterm_while_idle_exits_0(tiny_checkpoint: Path, tmp_path: Path) -> None:
    """The engine loop waits for work on the main thread; a signal must still reach uvicorn."""
    with ServiceProcess(["serve", "--model", str(tiny_checkpoint), "--kv-cache-tokens", "4096"],
                        log_path=tmp_path / "server.log") as proc:
        assert httpx.get(proc.base_url + "/health", timeout=10).status_code == 200
        assert proc.proc is not None
        proc.proc.send_signal(signal.SIGTERM)
        assert proc.proc.wait(timeout=30) == 0
