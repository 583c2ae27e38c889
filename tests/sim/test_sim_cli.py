"""``tokenmill sim`` as users run it: a real subprocess, files on disk, clear errors."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest


def tm(*args: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "tokenmill.cli", "sim", *args], capture_output=True, text=True,
                          timeout=timeout)


def test_sim_writes_outputs_and_prints_json(tmp_path):
    out = tmp_path / "run"
    p = tm("--replicas", "4", "--sessions", "20", "--duration", "2m", "--warmup", "30s", "--policy", "session_hash",
           "--scale-at", "60:+1", "--thick-fraction", "0.2", "--thick-parallel", "3", "--user-turn-prob", "0.02",
           "--out", str(out), "--json")
    assert p.returncode == 0, p.stderr
    summary = json.loads(p.stdout)
    for key in ("load", "ttft_s", "chr", "throughput", "scale_events", "decisions", "config"):
        assert key in summary
    st = summary["load"]["inflight"]
    assert set(st) >= {"mean", "variance", "var_over_mean", "frac_le_1", "frac_ge_12"}
    assert summary["config"]["workload"]["thick_session_fraction"] == 0.2
    (ev,) = summary["scale_events"]
    assert (ev["replicas_before"], ev["replicas_after"]) == (4, 5) and "moved_fraction" in ev
    assert json.loads((out / "summary.json").read_text())["requests_finished"] == summary["requests_finished"] > 0
    rows = (out / "load.csv").read_text().splitlines()
    assert rows[0] == "t_s,replica,inflight,active_sessions,assigned_sessions"
    assert len(rows) > 4 * 80                         # every replica about once a second after warm-up
    assert (out / "load_hist.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (out / "requests.csv").read_text().count("\n") == summary["requests_finished"] + 1


def test_sim_static_and_list_profiles():
    p = tm("static", "--sessions", "250", "--replicas", "50", "--seeds", "4", "--json")
    assert p.returncode == 0, p.stderr
    res = json.loads(p.stdout)
    assert res["seeds"] == 4 and res["mean"] == 5.0 and abs(res["poisson_le_1"] - 0.0404) < 1e-3
    p = tm("--list-profiles")
    assert p.returncode == 0 and "kimi-k2.6-b200-tp4" in p.stdout and "assumptions" in p.stdout


@pytest.mark.parametrize("args, message", [
    (["--scale-at", "60:5"], "must be signed"),
    (["--duration", "ten minutes"], "not a duration"),
    (["--profile", "no-such"], "neither a profile preset"),
    (["--policy", "nope"], "unknown policy"),
    (["--policy-opt", "epsilon"], "KEY=VALUE"),
    (["--policy", "agentic", "--policy-opt", "colour=1"], "does not take option"),
    (["--warmup", "20m", "--duration", "10m"], "warmup"),
    (["--replicas", "0"], "at least one replica"),
    (["--trace", "/no/such/trace.jsonl"], "trace"),
])
def test_bad_input_exits_2_with_a_message(args, message):
    p = tm(*args, "--duration", "1m", "--warmup", "10s", "--no-progress") if "--duration" not in args else tm(*args)
    assert p.returncode == 2, (p.returncode, p.stderr)
    assert message in p.stderr
    assert "Traceback" not in p.stderr
