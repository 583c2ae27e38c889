"""Chained greedy decode steps behind the HTTP server: a streamed completion arrives in bursts of
several tokens and reads the same as the response sent whole and as the engine's output without
chains; a client that leaves mid-stream frees its pages."""
from __future__ import annotations

from pathlib import Path
from typing import Iterator

import httpx
import openai
import pytest

from conftest import check_pages_idle
from tokenmill import LLM, SamplingParams
from tokenmill._native import quant as native
from tokenmill.utils.proc import ServiceProcess

pytestmark = pytest.mark.skipif(not native.available(), reason=str(native.unavailable_reason()))

PROMPT = "Tell me about the sea and the"


@pytest.fixture(scope="module")
def int4_server(tiny_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServiceProcess]:
    argv = ["serve", "--model", str(tiny_checkpoint), "--served-model-name", "tiny-int4", "--quantization", "int4",
            "--kv-cache-tokens", "4096", "--debug-checks"]
    with ServiceProcess(argv, log_path=tmp_path_factory.mktemp("logs") / "int4.log") as proc:
        yield proc


def test_streamed_bursts_match_the_whole_and_unchained_outputs(int4_server, tiny_checkpoint):
    client = openai.OpenAI(base_url=int4_server.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)
    body = {"ignore_eos": True}
    whole = client.completions.create(model="tiny-int4", prompt=PROMPT, max_tokens=40, temperature=0.0,
                                      extra_body=body)
    texts = []
    for chunk in client.completions.create(model="tiny-int4", prompt=PROMPT, max_tokens=40, temperature=0.0,
                                           stream=True, extra_body=body):
        if chunk.choices and chunk.choices[0].text:
            texts.append(chunk.choices[0].text)
    assert "".join(texts) == whole.choices[0].text
    assert whole.usage.completion_tokens == 40
    # bursts of several tokens: the chains reached the stream (how long they are follows the
    # measured step time, so a loaded machine gives shorter ones: 30 chunks in one CI run)
    assert len(texts) < 40
    metrics = httpx.get(int4_server.base_url + "/metrics", timeout=30).text
    chains = [float(line.split()[-1]) for line in metrics.splitlines()
              if line.startswith(("tokenmill:decode_chains_total", "tokenmill:decode_chain_steps_total"))]
    assert len(chains) == 2 and 0 < chains[0] and 2 * chains[0] <= chains[1]
    offline = LLM(str(tiny_checkpoint), quantization="int4", num_continuous_decode_steps=1, kv_cache_tokens=1024)
    out = offline.generate(PROMPT, SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))[0]
    assert out.text == whole.choices[0].text


def test_a_client_leaving_mid_chain_frees_its_pages(int4_server):
    with httpx.Client(base_url=int4_server.base_url, timeout=60) as http:
        body = {"model": "tiny-int4", "prompt": PROMPT, "max_tokens": 400, "temperature": 0.0, "ignore_eos": True,
                "stream": True}
        with http.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            for n, _ in enumerate(r.iter_lines()):
                if n > 3:
                    break
        check_pages_idle(http)
        ok = http.post("/v1/completions", json={**body, "stream": False, "max_tokens": 5})
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 5
