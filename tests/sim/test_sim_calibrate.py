"""Profile fitting: the fit must recover the coefficients of the formulas it fits, and
``tokenmill sim calibrate`` must measure a real tokenmill server and write a usable profile."""
from __future__ import annotations

import json
import random
import subprocess
import sys

import pytest

from tokenmill.sim.calibrate import DecodePoint, PrefillPoint, fit_decode, fit_prefill, prefill_features
from tokenmill.sim.profiles import DecodeModel, PrefillModel, ReplicaProfile


def test_prefill_features_follow_chunking():
    assert prefill_features(100, 512) == (1.0, 100.0, 100 * 50.0)
    k, n, ctx = prefill_features(1200, 512)
    assert (k, n) == (3.0, 1200.0)
    assert ctx == pytest.approx(512 * 256 + 512 * (512 + 256) + 176 * (1024 + 88))


def test_fit_recovers_known_coefficients_from_noisy_points():
    truth_p = PrefillModel(fixed_s=0.02, per_token_s=3e-4, per_token_context_s=2e-8)
    truth_d = DecodeModel(fixed_s=0.015, per_request_s=0.002, per_context_token_s=1e-6)
    rng = random.Random(0)
    pre = [PrefillPoint(n, truth_p.total_s(n, 0, 512) * (1 + rng.uniform(-0.01, 0.01)))
           for n in (16, 64, 256, 512, 1024, 1536, 2048, 3000)]
    dec = [DecodePoint(b, b * (ctx + 16), truth_d.step_s(b, b * (ctx + 16)) * (1 + rng.uniform(-0.01, 0.01)))
           for b in (1, 2, 4, 8) for ctx in (32, 512, 2048)]
    p, d = fit_prefill(pre, 512), fit_decode(dec)
    assert p.fixed_s == pytest.approx(0.02, rel=0.15)
    assert p.per_token_s == pytest.approx(3e-4, rel=0.05)
    assert p.per_token_context_s == pytest.approx(2e-8, rel=0.25)
    assert d.fixed_s == pytest.approx(0.015, rel=0.05)
    assert d.per_request_s == pytest.approx(0.002, rel=0.1)
    assert d.per_context_token_s == pytest.approx(1e-6, rel=0.1)


def test_fit_keeps_coefficients_non_negative_and_rejects_too_few_points():
    # times that shrink with the prompt cannot give a negative per-token cost
    p = fit_prefill([PrefillPoint(10, 0.05), PrefillPoint(100, 0.049), PrefillPoint(1000, 0.048)], 512)
    assert p.per_token_s >= 0 and p.per_token_context_s >= 0 and p.fixed_s > 0
    with pytest.raises(ValueError, match="at least 3"):
        fit_prefill([PrefillPoint(10, 0.1)], 512)
    with pytest.raises(ValueError, match="at least 3"):
        fit_decode([DecodePoint(1, 10, 0.1)])


def test_calibrate_against_a_real_server(tiny_server, tmp_path):
    """Measures a real ``tokenmill serve`` on the tiny model; the profile must load and be sane."""
    out = tmp_path / "profile.json"
    p = subprocess.run([sys.executable, "-m", "tokenmill.cli", "sim", "calibrate", "--base-url", tiny_server.base_url,
                        "--out", str(out), "--prefill-sizes", "16,256,768", "--batch-sizes", "1,3",
                        "--decode-contexts", "16,256", "--decode-tokens", "10", "--repeats", "1"],
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    prof = ReplicaProfile.load(out)
    assert prof.source == "calibrated"
    assert prof.kv_capacity_tokens >= 16 * 16
    assert prof.prefill.total_s(768, 0, prof.max_prefill_tokens) > prof.prefill.total_s(16, 0, prof.max_prefill_tokens)
    assert 0 < prof.decode.step_s(1, 16) < 5.0
    assert len(prof.measurements["prefill"]) == 3 and len(prof.measurements["decode"]) == 4
    assert json.loads(p.stdout)["kv_capacity_tokens"] == prof.kv_capacity_tokens


def test_calibrate_reports_an_unreachable_server(tmp_path):
    from tokenmill.utils.proc import free_port

    p = subprocess.run([sys.executable, "-m", "tokenmill.cli", "sim", "calibrate", "--base-url",
                        f"http://127.0.0.1:{free_port()}", "--out", str(tmp_path / "p.json")],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2
    assert "cannot measure" in p.stderr and "Traceback" not in p.stderr


def test_calibrate_rejects_a_bad_decode_slowdown_before_measuring(tmp_path):
    from tokenmill.utils.proc import free_port

    p = subprocess.run([sys.executable, "-m", "tokenmill.cli", "sim", "calibrate", "--base-url",
                        f"http://127.0.0.1:{free_port()}", "--decode-slowdown", "0.5", "--out", str(tmp_path / "p.json")],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2
    assert "--decode-slowdown must be > 1" in p.stderr and "cannot measure" not in p.stderr
