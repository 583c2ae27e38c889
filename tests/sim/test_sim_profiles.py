"""Replica profiles: presets, JSON round trip, validation, and the seed's Kimi K2.6 TP4 figures."""
from __future__ import annotations

import json
import math

import pytest

from tokenmill.sim.profiles import (
    DecodeModel, PrefillModel, ReplicaProfile, get_preset, load_profile, preset_names,
)


def test_every_preset_loads_round_trips_and_states_assumptions(tmp_path):
    names = preset_names()
    assert {"kimi-k2.6-b200-tp4", "kimi-k2.6-b200-tp4-fp8kv", "tiny-random-cpu", "smollm2-135m-cpu2"} <= set(names)
    for name in names:
        p = get_preset(name)
        assert p.assumptions, f"{name} states no assumptions"
        path = tmp_path / f"{name}.json"
        p.save(path)
        q = load_profile(str(path))
        assert q == p
        assert json.loads(path.read_text())["assumptions"] == list(p.assumptions)


def test_kimi_tp4_sustains_about_four_to_six_100k_sessions():
    """Seed: at ~100k-token inputs on TP4 only about 4 users fit; past ~6 everything collapses."""
    p = get_preset("kimi-k2.6-b200-tp4")
    lim = p.concurrency_limits(100_000, new_tokens=2930)
    # 0.45M tokens of BF16 KV (31.3 GB per GPU / 72 KB per token) hold 4.5 such contexts
    assert lim.kv_sessions == pytest.approx(4.5, rel=0.01)
    assert 5.5 <= lim.interactivity_sessions <= 7.0
    assert 4.0 <= lim.sessions <= 6.0
    # a cold 100k prefill costs seconds, a warm turn a fraction of a second
    assert 2.0 <= lim.cold_prefill_s <= 6.0
    assert lim.warm_prefill_s < 0.5
    fp8 = get_preset("kimi-k2.6-b200-tp4-fp8kv")
    assert fp8.kv_capacity_tokens == 2 * p.kv_capacity_tokens     # seed: FP8 KV doubles capacity
    assert fp8.concurrency_limits(100_000).sessions > lim.sessions


def test_formulas():
    pre = PrefillModel(fixed_s=0.01, per_token_s=1e-3, per_token_context_s=1e-6)
    assert pre.chunk_s(100, 0) == pytest.approx(0.01 + 100 * (1e-3 + 1e-6 * 50))
    # two chunks of 100: the second one attends over the first
    assert pre.total_s(200, 0, 100) == pytest.approx(pre.chunk_s(100, 0) + pre.chunk_s(100, 100))
    assert pre.total_s(0, 500, 100) == 0.0
    dec = DecodeModel(fixed_s=0.02, per_request_s=0.001, per_context_token_s=1e-7, tokens_per_step=2.0)
    assert dec.step_s(4, 10_000) == pytest.approx(0.02 + 0.004 + 0.001)
    assert dec.tokens_per_s_per_request(4, 10_000) == pytest.approx(2.0 / 0.025)


@pytest.mark.parametrize("bad, match", [
    ({"kv_capacity_tokens": 0}, "kv_capacity_tokens"),
    ({"max_running_requests": -1}, "max_running_requests"),
    ({"page_size": 1.5}, "page_size"),
    ({"decode": {"fixed_s": 0.0, "per_request_s": 0.0}}, "a step must take time"),
    ({"decode": {"fixed_s": 0.01, "tokens_per_step": 0.5}}, "tokens_per_step"),
    ({"prefill": {"fixed_s": -1.0}}, "prefill.fixed_s"),
    ({"prefill": {"per_token": 1.0}}, "bad prefill/decode section"),
    ({"colour": "blue"}, "unknown profile fields"),
    ({"decode_slowdown": 1.0}, "decode_slowdown must be > 1"),
    ({"decode_slowdown": "2"}, "decode_slowdown must be > 1"),
    ({"decode_slowdown_lone": 1.0}, "decode_slowdown_lone must be > 1"),
    ({"prefill_hold_below": -1}, "prefill_hold_below must be an integer >= 0"),
    ({"prefill_hold_steps": 2.5}, "prefill_hold_steps must be an integer >= 0"),
])
def test_bad_profiles_are_rejected_with_a_clear_error(bad, match):
    d = get_preset("tiny-random-cpu").to_dict()
    d.update(bad)
    with pytest.raises(ValueError, match=match):
        ReplicaProfile.from_dict(d)


def test_load_profile_errors(tmp_path):
    with pytest.raises(ValueError, match="neither a profile preset"):
        load_profile("no-such-preset")
    with pytest.raises(ValueError, match="does not exist"):
        load_profile(str(tmp_path / "missing.json"))
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="cannot read profile"):
        load_profile(str(bad))
    missing = tmp_path / "missing_field.json"
    d = get_preset("tiny-random-cpu").to_dict()
    del d["decode"]
    missing.write_text(json.dumps(d))
    with pytest.raises(ValueError, match="missing 'decode'"):
        load_profile(str(missing))


def test_concurrency_limits_without_target_is_kv_bound():
    p = get_preset("tiny-random-cpu")
    lim = p.concurrency_limits(1024)
    assert math.isinf(lim.interactivity_sessions)
    assert lim.sessions == lim.kv_sessions == p.kv_capacity_tokens / 1024
