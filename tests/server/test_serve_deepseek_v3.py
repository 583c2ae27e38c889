"""A tiny DeepSeek-V3 (MLA + MoE) served with an fp8 latent cache: the OpenAI API works, and the
start-up log and /v1/loads give the KV bytes per token and capacity that `tokenmill plan` gives."""
from __future__ import annotations

import json
import re
import subprocess
import sys

import httpx
import openai

from tokenmill.loader.tiny import build_tiny_checkpoint
from tokenmill.utils.proc import ServiceProcess

CLI = "import sys; from tokenmill.cli import main; sys.exit(main(sys.argv[1:]))"


def test_serve_deepseek_v3_fp8_kv_matches_the_planner(tmp_path) -> None:
    ckpt = build_tiny_checkpoint(tmp_path / "dsv3", "DeepseekV3ForCausalLM", seed=0)
    argv = ["serve", "--model", str(ckpt), "--served-model-name", "tiny-dsv3", "--kv-cache-dtype", "fp8_e4m3",
            "--kv-cache-memory", "0.001", "--page-size", "16", "--max-model-len", "512", "--debug-checks"]
    with ServiceProcess(argv, log_path=tmp_path / "server.log") as proc:
        client = openai.OpenAI(base_url=proc.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)
        out = client.completions.create(model="tiny-dsv3", prompt="Latent attention caches", max_tokens=6,
                                        temperature=0)
        assert out.usage.completion_tokens == 6
        again = client.completions.create(model="tiny-dsv3", prompt="Latent attention caches", max_tokens=6,
                                          temperature=0)
        assert again.choices[0].text == out.choices[0].text
        loads = httpx.get(proc.base_url + "/v1/loads", timeout=30).json()
        metrics = httpx.get(proc.base_url + "/metrics", timeout=30).text
        log = proc.log_tail(100_000)
    assert loads["kv_cache_dtype"] == "float8_e4m3fn"
    assert loads["kv_cache_fp8_scales"] == "static"
    assert loads["kv_bytes_per_token"] == 2 * (32 + 8)   # 2 layers x (latent + rope key); static scales
    assert re.search(rf"kv_cache_capacity_tokens\S* {loads['kv_capacity_tokens']}\b", metrics)
    m = re.search(r"KV cache: float8_e4m3fn \(static scales\), (\d+) B/token \(4.00x .* = (\d+) tokens", log)
    assert m, log[-2000:]
    assert (int(m.group(1)), int(m.group(2))) == (loads["kv_bytes_per_token"], loads["kv_capacity_tokens"])
    plan = subprocess.run([sys.executable, "-c", CLI, "plan", "--model", str(ckpt / "config.json"), "--hardware",
                           "h100", "--kv-dtype", "fp8", "--kv-cache-memory", "0.001", "--page-size", "16", "--json"],
                          capture_output=True, text=True, check=True)
    data = json.loads(plan.stdout)
    assert data["kv"]["per_token_per_device_bytes"] == loads["kv_bytes_per_token"]
    assert data["capacity"]["kv_tokens_for_memory"] == loads["kv_capacity_tokens"] == loads["kv_pages_total"] * 16
