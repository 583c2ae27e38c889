"""A speculating server: same tokens with the per-request switch on or off, accepted drafts in
usage, speculative metrics, and the token-id log for drafter training."""
from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from tokenmill.utils.proc import ServiceProcess


@pytest.fixture(scope="module")
def spec_server(tiny_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServiceProcess, Path]]:
    # --no-speculative-adaptive: every step drafts K tokens, so whether the third request's drafts
    # go out does not hang on the draft gate's reading of this machine's step times
    tmp = tmp_path_factory.mktemp("spec-server")
    argv = ["serve", "--model", str(tiny_checkpoint), "--served-model-name", "tiny", "--kv-cache-tokens", "4096",
            "--max-model-len", "512", "--debug-checks", "--speculative-method", "suffix",
            "--num-speculative-tokens", "4", "--no-speculative-adaptive", "--log-token-ids", str(tmp / "tokens")]
    with ServiceProcess(argv, log_path=tmp / "server.log") as proc:
        yield proc, tmp / "tokens"


def test_speculative_server(spec_server) -> None:
    proc, log_dir = spec_server
    client = openai.OpenAI(base_url=proc.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)
    prompt = [11, 22, 33, 44, 55, 66, 77, 88] * 3
    kw = dict(model="tiny", prompt=prompt, max_tokens=24, temperature=0.0)
    plain = client.completions.create(**kw, extra_body={"speculative": False, "ignore_eos": True,
                                                       "return_token_ids": True})
    spec = client.completions.create(**kw, extra_body={"ignore_eos": True, "return_token_ids": True})
    again = client.completions.create(**kw, extra_body={"ignore_eos": True, "return_token_ids": True})
    ids = [r.choices[0].model_extra["token_ids"] for r in (plain, spec, again)]
    assert ids[0] == ids[1] == ids[2]
    assert plain.usage.model_extra["accepted_draft_tokens"] == 0
    # the third request's answer is in the global index of finished outputs
    assert again.usage.model_extra["accepted_draft_tokens"] > 0
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                          max_tokens=8, temperature=0.0)
    assert "accepted_draft_tokens" in chat.usage.model_extra
    bad = httpx.post(proc.base_url + "/v1/completions",
                     json={"model": "tiny", "prompt": "x", "speculative": "maybe"}, timeout=30)
    assert bad.status_code == 400 and "speculative" in bad.text

    metrics = httpx.get(proc.base_url + "/metrics", timeout=30).text
    accepted = [ln for ln in metrics.splitlines()
                if ln.startswith("tokenmill:spec_decode_num_accepted_tokens_total")]
    assert accepted and 'method="suffix"' in accepted[0] and float(accepted[0].split()[-1]) > 0
    assert "tokenmill:spec_decode_acceptance_length_bucket" in metrics
    assert 'position="0"' in metrics

    records = [json.loads(ln) for f in sorted(log_dir.glob("*.jsonl")) for ln in f.read_text().splitlines()]
    assert len(records) >= 4
    first = records[0]
    assert first["prompt_token_ids"] == prompt and first["output_token_ids"] == ids[0]
    assert first["model"] == "tiny" and first["sampling"]["temperature"] == 0.0
    assert first["sampling"]["speculative"] is False
