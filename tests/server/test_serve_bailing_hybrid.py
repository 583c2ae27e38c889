"""A tiny Ling (BailingHybrid: KDA state slots + an fp8 MLA latent cache) served for real through the
official OpenAI SDK: completions and streamed chat work, a repeated conversation turn is served
from the prefix cache with the same text, and /v1/loads gives the state bytes and KV bytes that
`tokenmill plan` computes for the checkpoint."""
from __future__ import annotations

import json
import subprocess
import sys

import httpx
import openai

from tokenmill.loader.tiny import build_tiny_checkpoint
from tokenmill.utils.proc import ServiceProcess

CLI = "import sys; from tokenmill.cli import main; sys.exit(main(sys.argv[1:]))"
SLOT_BYTES = 2 * (4 * 16 * 16 + 3 * 64 * 3) * 4   # 2 KDA layers x (recurrent 4x16x16 + conv 192 x 3) fp32


def test_serve_ling_fp8_latents_and_state_pool_match_the_planner(tmp_path) -> None:
    ckpt = build_tiny_checkpoint(tmp_path / "ling", "BailingHybridForCausalLM", seed=0)
    argv = ["serve", "--model", str(ckpt), "--served-model-name", "tiny-ling", "--kv-cache-dtype", "fp8_e4m3",
            "--kv-cache-memory", "0.001", "--page-size", "16", "--max-model-len", "512",
            "--max-running-requests", "4", "--debug-checks"]
    with ServiceProcess(argv, log_path=tmp_path / "server.log") as proc:
        client = openai.OpenAI(base_url=proc.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)
        out = client.completions.create(model="tiny-ling", prompt="Delta rule states", max_tokens=6, temperature=0)
        assert out.usage.completion_tokens == 6
        messages = [{"role": "user", "content": "Tell me about linear attention and recurrent states. " * 4}]
        first = client.chat.completions.create(model="tiny-ling", messages=messages, max_tokens=8, temperature=0)
        stream = client.chat.completions.create(model="tiny-ling", messages=messages, max_tokens=8, temperature=0,
                                                stream=True, stream_options={"include_usage": True})
        chunks = list(stream)
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text == first.choices[0].message.content
        usage = chunks[-1].usage
        assert usage.completion_tokens == 8
        assert usage.prompt_tokens_details.cached_tokens > 0   # restored from a state snapshot
        loads = httpx.get(proc.base_url + "/v1/loads", timeout=30).json()
    assert loads["state_bytes_per_request"] == SLOT_BYTES and loads["state_slots_total"] == 4
    assert loads["state_slots_free"] == 4
    assert loads["kv_bytes_per_token"] == 2 * (32 + 8)   # 2 MLA layers x (latent + rope key); static fp8 scales
    plan = subprocess.run([sys.executable, "-c", CLI, "plan", "--model", str(ckpt / "config.json"), "--hardware",
                           "h100", "--kv-dtype", "fp8", "--json"], capture_output=True, text=True, check=True)
    data = json.loads(plan.stdout)
    assert data["kv"]["state_per_request_per_device_bytes"] == SLOT_BYTES
    assert data["kv"]["per_token_per_device_bytes"] == loads["kv_bytes_per_token"]
