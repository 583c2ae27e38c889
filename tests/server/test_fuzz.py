"""Property-based fuzzing of a real server from its own OpenAPI document (schemathesis).

Positive cases (bodies that fit the schema) and negative ones (bodies that break it) go to
every operation of ``GET /openapi.json``. Every answer must be below 500, every 4xx must carry
the OpenAI error shape, and afterwards the server must still serve with all KV pages back.
A case this finds becomes a regression test in tests/server/test_fuzz_regressions.py.

``TOKENMILL_FUZZ_EXAMPLES`` sets the examples per operation and mode (default 120, so a
generation endpoint gets 240 requests).
"""
from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode

from tests.server.conftest import check_pages_idle
from tokenmill.utils.proc import ServiceProcess

EXAMPLES = int(os.environ.get("TOKENMILL_FUZZ_EXAMPLES", "120"))
GENERATION = ("/v1/chat/completions", "/v1/completions")


@pytest.fixture(scope="module")
def fuzz_server(tiny_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServiceProcess]:
    # A short context and n <= 2 keep every generated request cheap; the deadline is a safety net.
    argv = ["serve", "--model", str(tiny_checkpoint), "--served-model-name", "tiny", "--kv-cache-tokens", "4096",
            "--max-model-len", "48", "--max-n", "2", "--request-deadline-s", "20", "--debug-checks",
            "--tool-call-parser", "hermes", "--log-level", "warning"]
    with ServiceProcess(argv, log_path=tmp_path_factory.mktemp("fuzz") / "server.log") as proc:
        yield proc
        assert proc.proc is not None and proc.proc.poll() is None, f"server died: {proc.log_tail()}"


def check_answer(method: str, path: str, status: int, content: bytes, sent: object) -> None:
    assert status < 500, f"{method} {path} -> {status}: {content[:500]!r}\nbody sent: {sent!r}"
    if status >= 400 and path.startswith("/v1/messages"):   # Anthropic API: its own error shape
        doc = json.loads(content)
        assert doc["type"] == "error" and isinstance(doc["error"]["message"], str), (path, doc)
    elif status >= 400:
        err = json.loads(content)["error"]
        assert set(err) == {"message", "type", "param", "code"}, (path, err)
        assert isinstance(err["message"], str) and err["message"] and isinstance(err["type"], str), err


def test_openapi_document_describes_the_endpoints(fuzz_server: ServiceProcess) -> None:
    doc = httpx.get(fuzz_server.base_url + "/openapi.json").json()
    for path in GENERATION:
        body = doc["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
        assert body["$ref"].startswith("#/components/schemas/")
    assert {"/v1/models", "/v1/loads", "/metrics", "/health", "/flush_cache"} <= set(doc["paths"])


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE], ids=["positive", "negative"])
def test_fuzz_every_operation(fuzz_server: ServiceProcess, mode: GenerationMode) -> None:
    base = fuzz_server.base_url
    schema = schemathesis.openapi.from_url(base + "/openapi.json")
    operations = [r.ok() for r in schema.get_all_operations()]
    assert {op.path for op in operations} >= set(GENERATION)
    baseline = check_pages_idle(httpx.Client(base_url=base))
    counts: dict[str, int] = {}
    with httpx.Client(base_url=base, timeout=60) as http:
        for op in operations:
            if op.path.startswith("/flush_cache"):
                continue   # state-changing, tested on its own; fuzzing it would empty the cache mid-run
            if op.path not in GENERATION and mode is GenerationMode.NEGATIVE:
                continue   # no parameters and no body: nothing to break
            examples = EXAMPLES if op.path in GENERATION else 5

            @settings(max_examples=examples, deadline=None, derandomize=True, database=None,
                      suppress_health_check=list(HealthCheck))
            @given(case=op.as_strategy(generation_mode=mode))
            def run(case: schemathesis.Case) -> None:
                kw = case.as_transport_kwargs(base_url=base)
                resp = http.request(kw["method"], kw["url"], headers=kw.get("headers"), params=kw.get("params"),
                                    content=_content(kw))
                counts[op.path] = counts.get(op.path, 0) + 1
                check_answer(kw["method"], op.path, resp.status_code, resp.content, kw.get("json", kw.get("data")))

            run()
        ok = http.post("/v1/completions", json={"model": "tiny", "prompt": "still there", "max_tokens": 3})
        assert ok.status_code == 200, ok.text
        after = check_pages_idle(http)
    assert after["kv_pages_total"] == baseline["kv_pages_total"] and after["kv_pages_in_use"] == 0
    assert all(counts.get(p, 0) >= EXAMPLES // 2 for p in GENERATION), counts
    print(f"fuzzed ({mode}): {counts}")


def _content(kw: dict) -> bytes | None:
    if "json" in kw:
        return json.dumps(kw["json"]).encode()
    data = kw.get("data")
    if isinstance(data, str):
        return data.encode()
    return data
