"""A tiny Qwen3-Next (hybrid: state slots + paged attention) served for real: the start-up log,
/v1/loads and /metrics give both capacities and their usage, the state bytes equal `tokenmill
plan`'s, and a client that goes away mid-stream gets its state slot and pages freed."""
from __future__ import annotations

import json
import re
import subprocess
import sys
import time

import httpx

from tokenmill.loader.tiny import build_tiny_checkpoint
from tokenmill.utils.proc import ServiceProcess

CLI = "import sys; from tokenmill.cli import main; sys.exit(main(sys.argv[1:]))"
SLOT_BYTES = 3 * (4 * 16 * 16 + 128 * 3) * 4   # 3 GDN layers x (recurrent + conv) fp32


def _idle(http: httpx.Client, timeout: float = 60.0) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        state = http.get("/v1/loads").json()
        if state["num_running"] == 0 and state["num_waiting"] == 0:
            return state
        time.sleep(0.05)
    raise AssertionError(f"engine still busy: {http.get('/v1/loads').json()}")


def test_serve_qwen3_next_reports_both_pools_and_frees_them_on_disconnect(tmp_path) -> None:
    ckpt = build_tiny_checkpoint(tmp_path / "q3n", "Qwen3NextForCausalLM", seed=0,
                                 max_position_embeddings=65536)
    argv = ["serve", "--model", str(ckpt), "--served-model-name", "tiny-q3n", "--kv-cache-tokens", "32768",
            "--max-running-requests", "3", "--state-snapshot-memory", str(2 * SLOT_BYTES / 2**30),
            "--max-model-len", "32768", "--debug-checks"]
    with ServiceProcess(argv, log_path=tmp_path / "server.log") as proc, \
            httpx.Client(base_url=proc.base_url, timeout=60) as http:
        idle = _idle(http)
        assert (idle["state_slots_total"], idle["state_slots_free"], idle["state_snapshot_slots"]) == (3, 3, 2)
        assert idle["state_bytes_per_request"] == SLOT_BYTES and idle["state_pool_usage"] == 0.0
        body = {"model": "tiny-q3n", "prompt": "hybrid " * 30, "max_tokens": 32000, "stream": True,
                "ignore_eos": True}
        # a long request (32k tokens: many seconds even for this tiny model), so that it still runs
        # while /v1/loads and /metrics are read
        with httpx.Client(base_url=proc.base_url, timeout=60) as own:
            with own.stream("POST", "/v1/completions", json=body) as resp:
                assert resp.status_code == 200
                # read 4 events without closing the line iterator (closing it drops the
                # connection, and the server would abort the request before the reads below)
                lines, seen = resp.iter_lines(), 0
                while seen < 4:
                    seen += next(lines).startswith("data: ")
                busy = http.get("/v1/loads").json()
                metrics = http.get("/metrics").text
                lines.close()
        assert busy["num_running"] == 1 and busy["state_slots_free"] == 2
        assert busy["state_pool_usage"] == 1 / 3 and busy["kv_pages_free"] < idle["kv_pages_free"]
        state_lines = [line for line in metrics.splitlines() if line.startswith(("tokenmill:state_", "tokenmill:num_", "tokenmill:kv_cache_usage", "tokenmill:generation", "tokenmill:request_success"))]
        assert re.search(r'^tokenmill:state_pool_usage_perc\{model_name="tiny-q3n"\} 0\.333', metrics, re.M), \
            state_lines
        assert re.search(r'^tokenmill:state_slots_total\{model_name="tiny-q3n"\} 3\.0$', metrics, re.M)
        kv_usage = re.search(r'^tokenmill:kv_cache_usage_perc\{model_name="tiny-q3n"\} (\S+)$', metrics, re.M)
        assert kv_usage and 0 < float(kv_usage.group(1)) < 1
        after = _idle(http, timeout=30)   # the client went away: aborted, slot and pages back
        assert after["state_slots_free"] == 3 and after["state_pool_usage"] == 0.0
        assert after["kv_pages_free"] + after["kv_pages_cached"] == after["kv_pages_total"]
        assert after["generation_tokens"] < 32000
        log = proc.log_tail(100_000)
    assert re.search(r"state pool: 3 linear-attention layers, (\d+) B/request .* 3 request slots .* \+ 2 snapshot "
                     r"slots = 5 slots", log), log[-2000:]
    assert re.search(r"KV cache: float32, 256 B/token .* = 32768 tokens", log), log[-2000:]
    plan = subprocess.run([sys.executable, "-c", CLI, "plan", "--model", str(ckpt / "config.json"), "--hardware",
                           "h100", "--json"], capture_output=True, text=True, check=True)
    data = json.loads(plan.stdout)
    assert data["kv"]["state_per_request_per_device_bytes"] == SLOT_BYTES == after["state_bytes_per_request"]
    assert data["kv"]["per_token_per_device_bytes"] == 2 * 2 * 16 * 2   # bf16 by default in the planner
