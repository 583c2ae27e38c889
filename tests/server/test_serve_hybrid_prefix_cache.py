"""A tiny Qwen3-Next served for real: turn 2 of a session hits turn 1's prompt + output through
state snapshots, ``usage.prompt_tokens_details.cached_tokens`` reports it as for a dense model
(official ``openai`` client), the output equals an uncached server's, and /v1/loads and
/metrics count the snapshots."""
from __future__ import annotations

import re

import httpx
import openai

from tokenmill.loader.tiny import build_tiny_checkpoint
from tokenmill.utils.proc import ServiceProcess

P = 16


def test_session_turn_two_hits_turn_one_over_http(tmp_path) -> None:
    ckpt = build_tiny_checkpoint(tmp_path / "q3n", "Qwen3NextForCausalLM", seed=1)
    common = ["serve", "--model", str(ckpt), "--served-model-name", "tiny", "--page-size", str(P),
              "--kv-cache-tokens", "4096", "--max-model-len", "1024", "--debug-checks"]
    turn1 = [100 + i for i in range(45)]
    k = 20   # decoding crosses a page boundary: the snapshot is at the end of the output's last page
    with ServiceProcess(common + ["--state-snapshot-slots", "8"], log_path=tmp_path / "on.log") as on, \
            ServiceProcess(common + ["--no-prefix-cache"], log_path=tmp_path / "off.log") as off:
        clients = [openai.OpenAI(base_url=s.base_url + "/v1", api_key="x", max_retries=0, timeout=60) for s in (on, off)]
        args = dict(model="tiny", max_tokens=k, temperature=0.0, extra_body={"ignore_eos": True, "return_token_ids": True},
                    extra_headers={"X-Session-ID": "s1"})
        first = [c.completions.create(prompt=turn1, **args) for c in clients]
        out1 = first[0].choices[0].model_extra["token_ids"]
        assert out1 == first[1].choices[0].model_extra["token_ids"] and len(out1) == k
        assert first[0].usage.prompt_tokens_details.cached_tokens == 0
        turn2 = turn1 + out1 + [300 + i for i in range(10)]
        second = [c.completions.create(prompt=turn2, **args) for c in clients]
        assert second[0].choices[0].text == second[1].choices[0].text
        # the whole pages of turn 1's computed tokens (its last sampled token has no state yet)
        assert second[0].usage.prompt_tokens_details.cached_tokens == (len(turn1) + k - 1) // P * P == 64
        assert second[1].usage.prompt_tokens_details.cached_tokens == 0
        loads = httpx.get(on.base_url + "/v1/loads").json()
        assert loads["state_snapshot_slots"] == 8 and 0 < loads["state_snapshots_cached"] <= 8
        assert loads["cached_tokens"] == 64
        metrics = httpx.get(on.base_url + "/metrics").text
        assert re.search(r'^tokenmill:state_snapshots_cached\{model_name="tiny"\} [1-8]\.0$', metrics, re.M)
        log = on.log_tail(100_000)
    assert re.search(r"\+ 8 snapshot slots = \d+ slots .*every 512 prefill tokens", log), log[-2000:]
