"""``tokenmill plan`` as users run it: a subprocess, text and --json output, and its errors."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tokenmill.cli import main

KIMI_TP8 = ["--model", "kimi-k2.6", "--hardware", "b200", "--tp", "8", "--gpu-mem-gb", "180",
            "--weights-gb", "595", "--mem-fraction", "1", "--context", "100000"]
LING_MOE = ["--model", "ling-2.6-1t", "--hardware", "tpu-v7x", "--tp", "32", "--ep", "32", "--context", "16384",
            "--moe-bounds", "--moe-tile-rows", "160"]


def tokenmill_plan(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "tokenmill.cli", "plan", *args], capture_output=True,
                          text=True, timeout=60)


@pytest.fixture(scope="module")
def kimi_json() -> dict:
    out = tokenmill_plan(*KIMI_TP8, "--json")
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_kimi_tp8_json(kimi_json: dict) -> None:
    assert kimi_json["kv"]["per_token_per_device_bytes"] == 70_272
    assert kimi_json["weights"]["per_device_bytes"] == pytest.approx(595e9 / 8)
    cap = kimi_json["capacity"]
    assert cap["free_per_replica"] == pytest.approx(845e9)
    assert cap["kv_tokens_per_replica"] == 1_503_088
    assert cap["sessions_per_replica"] == 15
    assert any("3.0 M" in n for n in kimi_json["notes"])
    assert kimi_json["hardware"]["sources"]["hbm_bytes"] == "given on the command line"
    steps = {s["key"]: s for s in kimi_json["steps"]}
    assert "(512 + 64)" in steps["kv.per_token_per_device"]["formula"]
    assert kimi_json["decode"]["tokens_per_s_per_user"] > 0 and kimi_json["prefill"]["tokens_per_s"] > 0


def test_ling_moe_bounds_json() -> None:
    out = tokenmill_plan(*LING_MOE, "--json")
    assert out.returncode == 0, out.stderr
    moe = json.loads(out.stdout)["moe"]
    assert moe["routed_rows"] == 4096
    assert round(moe["total_flops"] / 1e9, 1) == 824.6
    assert round(moe["compute_time_s"] * 1e3, 2) == 0.36
    assert moe["payload_bytes"] == {"bf16": 67_108_864, "fp8": 33_554_432}
    assert moe["passes"] == 4 and round(moe["weight_read_s"] * 1e3, 2) == 0.44


def test_text_output_shows_the_working() -> None:
    out = tokenmill_plan(*KIMI_TP8)
    assert out.returncode == 0, out.stderr
    text = out.stdout
    assert "(512 + 64) elements x 2 B (bf16) x 61 layers" in text and "= 70,272 B" in text
    assert "845.00 GB" in text and "105.62 GB" in text and "1,503,088 tokens" in text
    assert "seed 000 table, TP8 row says 3.0 M tokens" in text
    ling = tokenmill_plan(*LING_MOE).stdout
    assert "16,384 x 8 / 32 = 4,096 rows" in ling
    assert "ceil(512 / 160) = 4 passes" in ling


def test_hf_config_path_and_weight_bits(tmp_path) -> None:
    cfg = {"hidden_size": 2048, "num_hidden_layers": 16, "num_attention_heads": 32, "num_key_value_heads": 8,
           "intermediate_size": 8192, "vocab_size": 128256, "tie_word_embeddings": True}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    out = tokenmill_plan("--model", str(tmp_path / "config.json"), "--hardware", "h100", "--tp", "2",
                         "--kv-dtype", "fp8", "--weight-bits", "all=8,embeddings=16", "--json")
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert data["kv"]["per_token_per_device_bytes"] == 2 * 4 * 64 * 1 * 16  # fp8, static scales: nothing per token
    out = tokenmill_plan("--model", str(tmp_path / "config.json"), "--hardware", "h100", "--tp", "2",
                         "--kv-dtype", "fp8", "--kv-fp8-scales", "token", "--json")
    per_token = json.loads(out.stdout)["kv"]["per_token_per_device_bytes"]
    assert per_token == (2 * 4 * 64 * 1 + 2 * 4 * 4) * 16  # fp8 + a 4 B scale per token and KV head
    assert data["deployment"]["weight_bits"]["attention"] == 8
    emb = next(g for g in data["weights"]["groups"] if g["name"] == "embedding table")
    assert emb["bytes_total"] == 128256 * 2048 * 2


def test_list_presets() -> None:
    out = tokenmill_plan("--list")
    assert out.returncode == 0
    for name in ("kimi-k2.6", "deepseek-v3", "ling-2.6-1t", "llama-3.1-70b", "qwen3-235b-a22b", "smollm2-135m",
                 "b200", "b300", "h100", "h200", "tpu-v7x", "cpu-local"):
        assert name in out.stdout


@pytest.mark.parametrize("args, message", [
    (["--model", "gpt-9", "--hardware", "b200"], "unknown model 'gpt-9'"),
    (["--model", "kimi-k2.6", "--hardware", "a100"], "unknown hardware 'a100'"),
    (["--model", "kimi-k2.6"], "--model and --hardware are required"),
    (["--model", "kimi-k2.6", "--hardware", "b200", "--tp", "0"], "--tp must be a positive integer"),
    (["--model", "kimi-k2.6", "--hardware", "b200", "--tp", "4", "--ep", "3"], "must divide --tp"),
    (["--model", "kimi-k2.6", "--hardware", "b200", "--mem-fraction", "1.5"], "--mem-fraction"),
    (["--model", "kimi-k2.6", "--hardware", "b200", "--weight-bits", "experts=four"], "--weight-bits"),
    (["--model", "kimi-k2.6", "--hardware", "h100", "--compute-dtype", "fp4"], "no fp4 peak"),
    (["--model", "llama-3.1-70b", "--hardware", "h100", "--moe-bounds"], "has no MoE layers"),
    (["--model", "kimi-k2.6", "--hardware", "b200", "--torus", "2x2"], "need --moe-bounds"),
])
def test_bad_input_exits_2_with_a_message(args: list[str], message: str, capsys) -> None:
    assert main(["plan", *args]) == 2  # the CLI entry point, in-process to keep the suite fast
    err = capsys.readouterr().err
    assert err.startswith("tokenmill plan: error: ") and message in err


def test_bad_input_from_a_real_process() -> None:
    out = tokenmill_plan("--model", "gpt-9", "--hardware", "b200")
    assert out.returncode == 2
    assert "unknown model 'gpt-9'" in out.stderr and "Traceback" not in out.stderr


def test_argparse_rejects_bad_flags(capsys) -> None:
    for args, message in ((["--kv-dtype", "int2"], "invalid choice"), (["--tp", "four"], "invalid int value")):
        with pytest.raises(SystemExit) as exc:
            main(["plan", "--model", "kimi-k2.6", "--hardware", "b200", *args])
        assert exc.value.code == 2 and message in capsys.readouterr().err


def test_plan_does_not_import_torch() -> None:
    code = ("import sys, io, contextlib; from tokenmill.cli import main; "
            "buf = io.StringIO()\nwith contextlib.redirect_stdout(buf): "
            "rc = main(['plan', '--model', 'deepseek-v3', '--hardware', 'h200', '--tp', '8'])\n"
            "assert rc == 0 and 'torch' not in sys.modules, sorted(m for m in sys.modules if 'torch' in m)[:3]")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
