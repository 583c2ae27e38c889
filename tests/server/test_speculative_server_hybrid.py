"""A hybrid model (tiny Qwen3-Next) served with speculation: the same tokens with the
per-request switch on and off, accepted drafts in usage and /metrics, and both pools free after."""
from __future__ import annotations

import time

import httpx
import openai

from tokenmill.loader.tiny import build_tiny_checkpoint
from tokenmill.utils.proc import ServiceProcess


def test_serve_hybrid_with_suffix_speculation(tmp_path) -> None:
    ckpt = build_tiny_checkpoint(tmp_path / "q3n", "Qwen3NextForCausalLM", seed=0)
    argv = ["serve", "--model", str(ckpt), "--served-model-name", "tiny-q3n", "--kv-cache-tokens", "4096",
            "--max-model-len", "512", "--max-running-requests", "4", "--debug-checks",
            "--speculative-method", "suffix", "--num-speculative-tokens", "4",
            "--no-speculative-adaptive"]   # drafts go out whatever this machine's step times read
    with ServiceProcess(argv, log_path=tmp_path / "server.log") as proc:
        client = openai.OpenAI(base_url=proc.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)
        kw = dict(model="tiny-q3n", prompt=[11, 22, 33, 44, 55, 66, 77, 88] * 3, max_tokens=40, temperature=0.0)
        extra = {"ignore_eos": True, "return_token_ids": True}
        plain = client.completions.create(**kw, extra_body={**extra, "speculative": False})
        spec = client.completions.create(**kw, extra_body=extra)
        again = client.completions.create(**kw, extra_body=extra)   # its answer is in the global index
        ids = [r.choices[0].model_extra["token_ids"] for r in (plain, spec, again)]
        assert ids[0] == ids[1] == ids[2] and len(ids[0]) == 40
        assert plain.usage.model_extra["accepted_draft_tokens"] == 0
        assert again.usage.model_extra["accepted_draft_tokens"] > 0
        metrics = httpx.get(proc.base_url + "/metrics", timeout=30).text
        accepted = [ln for ln in metrics.splitlines() if ln.startswith("tokenmill:spec_decode_num_accepted_tokens_total")]
        assert accepted and float(accepted[0].split()[-1]) > 0
        deadline = time.monotonic() + 30
        while (loads := httpx.get(proc.base_url + "/v1/loads", timeout=30).json())["num_running"] and \
                time.monotonic() < deadline:
            time.sleep(0.05)
        assert loads["state_slots_free"] == loads["state_slots_total"] == 4
