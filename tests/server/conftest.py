"""Fixtures for the server tests: one tiny random Llama checkpoint and one shared server on it.

The shared server runs as a real subprocess (``python -m tokenmill.cli serve``) on a free loopback
port; tests talk to it with the official ``openai`` client and ``httpx``. Tests that need other
flags (API key, custom chat template, shutdown) start their own server in their module.
"""
from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from tokenmill.utils.proc import ServiceProcess

MODEL_NAME = "tiny-llama"
PAGE_SIZE = 16
MAX_MODEL_LEN = 1024
MAX_N = 4
MAX_REQUEST_BYTES = 256 * 1024


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tokenmill.loader.tiny import build_tiny_checkpoint

    return build_tiny_checkpoint(tmp_path_factory.mktemp("tiny-llama"), arch="LlamaForCausalLM", seed=0)


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_checkpoint: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_checkpoint))


@pytest.fixture(scope="session")
def server(tiny_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServiceProcess]:
    log = tmp_path_factory.mktemp("logs") / "server.log"
    argv = ["serve", "--model", str(tiny_checkpoint), "--served-model-name", MODEL_NAME,
            "--page-size", str(PAGE_SIZE), "--kv-cache-tokens", "16384", "--max-model-len", str(MAX_MODEL_LEN),
            "--max-n", str(MAX_N), "--max-request-bytes", str(MAX_REQUEST_BYTES), "--tool-call-parser", "hermes",
            "--debug-checks"]
    with ServiceProcess(argv, log_path=log) as proc:
        yield proc
        assert proc.proc is not None and proc.proc.poll() is None, f"server died: {proc.log_tail()}"


@pytest.fixture(scope="session")
def client(server: ServiceProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture   # per test: its connection pool belongs to the event loop of the test's asyncio.run
def async_client(server: ServiceProcess) -> openai.AsyncOpenAI:
    # one per test: each test runs its own event loop (asyncio.run), and a client's connection
    # pool belongs to the loop that first used it
    return openai.AsyncOpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="session")
def http(server: ServiceProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.base_url, timeout=120) as c:
        yield c


def loads(http: httpx.Client) -> dict:
    r = http.get("/v1/loads")
    assert r.status_code == 200, r.text
    return r.json()


def check_pages_idle(http: httpx.Client, timeout: float = 60.0) -> dict:
    """Wait until the engine is idle, then check page accounting: free + cached + in use == total,
    with nothing in use. Returns the last /v1/loads."""
    import time

    deadline = time.monotonic() + timeout
    while True:
        s = loads(http)
        assert s["kv_pages_free"] + s["kv_pages_cached"] + s["kv_pages_in_use"] == s["kv_pages_total"], s
        if s["num_running"] == 0 and s["num_waiting"] == 0:
            assert s["kv_pages_in_use"] == 0, f"pages still held by finished requests: {s}"
            return s
        if time.monotonic() > deadline:
            raise AssertionError(f"engine still busy {timeout}s after the test: {s}")
        time.sleep(0.05)


@pytest.fixture(autouse=True)
def _page_accounting(request: pytest.FixtureRequest) -> Iterator[None]:
    """After every test that used the shared server: its KV pages all came back."""
    yield
    if "server" in request.fixturenames:
        with httpx.Client(base_url=request.getfixturevalue("server").base_url, timeout=30) as c:
            check_pages_idle(c)
