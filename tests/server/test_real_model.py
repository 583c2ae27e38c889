"""Smoke check on the default model (SmolLM2-135M-Instruct from its GGUF): one short chat."""
from __future__ import annotations

from pathlib import Path

import openai

from tokenmill.loader.resolve import DEFAULT_MODEL
from tokenmill.utils.proc import ServiceProcess


def test_default_model_answers_a_chat(tmp_path: Path) -> None:
    argv = ["serve", "--model", DEFAULT_MODEL, "--max-model-len", "2048", "--kv-cache-tokens", "8192"]
    with ServiceProcess(argv, log_path=tmp_path / "server.log", start_timeout=300) as proc:
        client = openai.OpenAI(base_url=proc.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)
        assert [m.id for m in client.models.list().data] == [DEFAULT_MODEL]
        resp = client.chat.completions.create(
            model=DEFAULT_MODEL, messages=[{"role": "user", "content": "What is the capital of France?"}],
            max_tokens=24, temperature=0)
        text = resp.choices[0].message.content
        assert "Paris" in text, text
        assert resp.choices[0].finish_reason in ("stop", "length")
        assert resp.usage.completion_tokens <= 24
