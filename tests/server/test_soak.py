"""The soak benchmark, twenty seconds of it, as part of the suite (the one long test here).

benchmarks/soak.py starts its own server on a tiny random model and drives the full mix
(streams, n > 1, long prompts, disconnects, cancellations, bad requests, deadlines); it exits
non-zero when any pass criterion fails. Long runs are recorded in docs/benchmarks.md.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_twenty_second_soak_passes(tmp_path: Path) -> None:
    out = tmp_path / "soak"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "soak.py"), "--minutes", "0.34",
                           "--sample-s", "1.5", "--workers", "4", "--out", str(out)],
                          capture_output=True, text=True, timeout=420)
    print(proc.stdout[-4000:])
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    result = json.loads((out / "soak.json").read_text())
    assert result["passed"] and all(result["checks"].values()), result["checks"]
    assert len(result["samples"]) >= 10
    assert set(result["actions"]) >= {"disconnect", "cancel", "bad_json", "deadline", "n2", "long_prompt"}
    assert result["statuses"].get("400", 0) > 0 and result["statuses"].get("cancelled", 0) > 0
    assert (out / "soak.png").stat().st_size > 10_000
    assert "soak PASSED" in proc.stdout
