"""The fleet simulator end to end: the seed's closed-loop dispersion and scale-up results, plus
scale-down, autoscaling, population changes, determinism and Mooncake trace replay."""
from __future__ import annotations

from pathlib import Path

import pytest

from tokenmill.workload import load_mooncake_trace, theoretical_hit_rate_hash_ids
from tokenmill.sim.config import AutoscaleRule, PopulationChange, ScaleEvent, SimConfig
from tokenmill.sim.fleet import FleetSimulator
from tokenmill.sim.profiles import get_preset

KIMI = get_preset("kimi-k2.6-b200-tp4")
TRACE = Path(__file__).resolve().parents[3] / "shared" / "data" / "mooncake" / "conversation_trace.jsonl"


def run(cfg: SimConfig) -> dict:
    sim = FleetSimulator(cfg)
    out = dict(sim.run())
    sim.check_invariants()          # page accounting of every replica at the end
    return out


def test_closed_loop_session_hash_overdisperses_agentic_does_not(agentic_workload):
    """Must reproduce 2: ~5 in flight per replica; session_hash var/mean >= ~1, agentic < 0.5,
    with cache hit rates within a few points of each other."""
    res = {}
    for policy in ("session_hash", "agentic"):
        res[policy] = run(SimConfig(replicas=20, profile=KIMI, policy=policy, duration_s=300, sessions=115,
                                    workload=agentic_workload(115), warmup_s=60, seed=1))
    sh, ag = res["session_hash"]["load"]["inflight"], res["agentic"]["load"]["inflight"]
    print(f"\nsession_hash in-flight mean {sh['mean']:.2f} var/mean {sh['var_over_mean']:.2f} "
          f"CHR {res['session_hash']['chr']:.3f}; agentic mean {ag['mean']:.2f} var/mean "
          f"{ag['var_over_mean']:.2f} CHR {res['agentic']['chr']:.3f}")
    assert 3.5 <= ag["mean"] <= 6.5 and 3.5 <= sh["mean"] <= 7.5     # target concurrency ~5
    assert sh["var_over_mean"] >= 0.9
    assert ag["var_over_mean"] < 0.5
    assert abs(res["agentic"]["chr"] - res["session_hash"]["chr"]) < 0.05
    assert res["agentic"]["chr"] > 0.7
    # the hot replicas of session_hash show up in the tail
    assert res["session_hash"]["ttft_s"]["p99"] > 2 * res["agentic"]["ttft_s"]["p99"]
    assert sh["frac_ge_12"] > ag["frac_ge_12"]


def test_scale_up_agentic_moves_fewer_live_sessions(agentic_workload):
    """Must reproduce 3: 50 -> 55 replicas; rendezvous hashing moves ~1/11 of the live sessions,
    agentic (new sessions prefer the new, empty replicas) moves fewer."""
    moved = {}
    for policy in ("session_hash", "agentic"):
        out = run(SimConfig(replicas=50, profile=KIMI, policy=policy, duration_s=200, sessions=288,
                            workload=agentic_workload(288), warmup_s=60, scale_events=(ScaleEvent(120, 5),),
                            seed=2))
        (ev,) = out["scale_events"]
        assert (ev["replicas_before"], ev["replicas_after"]) == (50, 55)
        assert ev["observed_sessions"] >= 0.8 * ev["live_sessions"] > 0
        moved[policy] = ev["moved_fraction"]
        assert out["replicas_final"] == 55
    print(f"\nmoved fraction at 50 -> 55: {moved}")
    assert 0.04 <= moved["session_hash"] <= 0.15        # 5/55 = 9.1% in expectation
    assert moved["agentic"] < moved["session_hash"]


def test_same_config_same_result(agentic_workload):
    cfg = SimConfig(replicas=4, profile=KIMI, policy="agentic", duration_s=120, sessions=20,
                    workload=agentic_workload(20), warmup_s=30, seed=5)
    a, b = run(cfg), run(cfg)
    a.pop("sim_wall_s"), b.pop("sim_wall_s")
    assert a == b
    assert a["requests_finished"] > 50


def test_scale_down_drains_and_moves_the_drained_sessions(agentic_workload):
    out = run(SimConfig(replicas=6, profile=KIMI, policy="session_hash", duration_s=240, sessions=30,
                        workload=agentic_workload(30), warmup_s=30, scale_events=(ScaleEvent(90, -2),)))
    (ev,) = out["scale_events"]
    assert (ev["replicas_before"], ev["replicas_after"], ev["delta"]) == (6, 4, -2)
    assert ev["moved_sessions"] > 0
    assert out["replicas_final"] == 4


def test_autoscaler_grows_the_fleet_toward_the_target(agentic_workload):
    rule = AutoscaleRule(target=5, interval_s=20, min_replicas=2, max_replicas=20, startup_s=30)
    out = run(SimConfig(replicas=2, profile=KIMI, policy="agentic", duration_s=300, sessions=40,
                        workload=agentic_workload(40), warmup_s=30, autoscale=rule))
    grow = [e for e in out["scale_events"] if e["source"] == "autoscale" and e["delta"] > 0]
    assert grow and grow[0]["time_s"] >= 30                       # first replicas after start-up
    assert out["replicas_final"] >= 5
    assert out["load"]["inflight"]["mean"] < 12


def test_population_change_adds_sessions(agentic_workload):
    out = run(SimConfig(replicas=4, profile=KIMI, policy="agentic", duration_s=200, sessions=8,
                        workload=agentic_workload(8), warmup_s=100,
                        population_changes=(PopulationChange(50, 32),)))
    assert out["load"]["assigned_sessions"]["mean"] == pytest.approx(8.0, abs=1.0)   # 32 sessions / 4


@pytest.mark.skipif(not TRACE.exists(), reason=f"Mooncake trace not present at {TRACE}")
def test_mooncake_trace_replay_hits_at_most_the_infinite_cache_rate():
    records = tuple(load_mooncake_trace(TRACE, limit=400))
    out = run(SimConfig(replicas=4, profile=get_preset("kimi-k2.6-b200-tp4-fp8kv"), policy="agentic",
                        duration_s=3600, trace=records, warmup_s=0.0))
    best = theoretical_hit_rate_hash_ids(records).token_hit_rate
    assert out["requests_finished"] > 300
    assert 0.0 < out["chr"] <= best + 1e-9
    assert out["chr"] > 0.5 * best


def test_config_errors_are_clear():
    wl_cfg = dict(replicas=2, profile=KIMI, duration_s=60, warmup_s=10)
    with pytest.raises(ValueError, match="exactly one of workload"):
        SimConfig(**wl_cfg)
    with pytest.raises(ValueError, match="warmup"):
        SimConfig(replicas=2, profile=KIMI, duration_s=60, warmup_s=60, trace=(object(),))   # type: ignore[arg-type]
    with pytest.raises(ValueError, match="outside the run"):
        SimConfig(replicas=2, profile=KIMI, duration_s=60, warmup_s=10, trace=(object(),),  # type: ignore[arg-type]
                  scale_events=(ScaleEvent(90, 1),))
    with pytest.raises(ValueError, match="unknown policy"):
        FleetSimulator(SimConfig(replicas=2, profile=KIMI, duration_s=60, warmup_s=10, policy="nope",
                                 trace=(object(),)))  # type: ignore[arg-type]


def test_a_fleet_short_of_kv_preempts_and_loses_cache_hits(agentic_workload):
    """The replicas' schedulers are the engine's: with pools too small for the sessions' contexts,
    running requests are preempted for pages and hit rates fall; with room, nobody is."""
    import dataclasses

    res = {}
    for cap in (450_000, 200_000):
        res[cap] = run(SimConfig(replicas=2, profile=dataclasses.replace(KIMI, kv_capacity_tokens=cap),
                                 policy="agentic", duration_s=120, sessions=16, workload=agentic_workload(16),
                                 warmup_s=20, seed=3))
    roomy, short = res[450_000], res[200_000]
    assert roomy["preemptions"] == 0 and short["preemptions"] > 0
    assert short["chr"] < roomy["chr"] - 0.2
    assert short["requests_finished"] > 0
    assert short["ttft_s"]["p50"] > roomy["ttft_s"]["p50"]
