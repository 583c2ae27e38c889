"""The cache tiers in the simulator: L2 per replica and an L3 shared by the fleet.

The tiers plug into the engine's KVManager exactly as the engine's own tiers do, so these tests
check what the model adds: demoted pages come back as L2 hits, a session moved to another
replica finds its prefix in the shared L3, loads cost step time, and the agentic policy's
shared-cache rule evens the load.
"""
from __future__ import annotations

import dataclasses

import pytest

from tokenmill.sim.config import ScaleEvent, SimConfig
from tokenmill.sim.fleet import FleetSimulator
from tokenmill.sim.profiles import get_preset
from tokenmill.sim.tiers import SharedStore, TierProfile

KIMI = get_preset("kimi-k2.6-b200-tp4")
KIMI_L3 = get_preset("kimi-k2.6-b200-tp4-l3")


def run(cfg: SimConfig) -> dict:
    sim = FleetSimulator(cfg)
    out = dict(sim.run())
    sim.check_invariants()
    return out


def test_tier_profile_validation() -> None:
    with pytest.raises(ValueError):
        TierProfile(host_cache_tokens=-1)
    with pytest.raises(ValueError):
        TierProfile(storage_bandwidth_gb_s=0)
    with pytest.raises(ValueError):
        dataclasses.replace(KIMI, storage_latency_s=-1.0)
    s = SharedStore(2)
    s.put(["a", "b", "c"])
    assert "a" not in s and len(s) == 2 and s.pages_written == 3


def test_small_hbm_with_host_tier_keeps_the_hit_rate(agentic_workload) -> None:
    """HBM for ~1 session per replica: without L2 the hit rate collapses, with it it stays."""
    small = dataclasses.replace(KIMI, kv_capacity_tokens=120_000)
    res = {}
    for name, prof in (("l1", small), ("l2", dataclasses.replace(small, host_cache_tokens=3_000_000))):
        res[name] = run(SimConfig(replicas=4, profile=prof, policy="agentic", duration_s=240, sessions=20,
                                  workload=agentic_workload(20), warmup_s=30, seed=3))
    assert res["l2"]["chr"] > res["l1"]["chr"] + 0.1
    t = res["l2"]["tiers"]
    assert t["hit_tokens"]["l2"] > 0 and t["load_s"] > 0
    assert "tiers" not in res["l1"]


def test_moved_sessions_find_their_prefix_in_shared_storage(agentic_workload) -> None:
    """Draining half the fleet moves its sessions; with L3 their next turns are cache hits."""
    res = {}
    for name, prof in (("none", KIMI), ("l3", dataclasses.replace(KIMI, storage_tokens=50_000_000))):
        res[name] = run(SimConfig(replicas=6, profile=prof, policy="agentic", duration_s=300, sessions=30,
                                  workload=agentic_workload(30), warmup_s=30, seed=5,
                                  scale_events=(ScaleEvent(120.0, -3),)))
    assert res["l3"]["tiers"]["hit_tokens"]["l3"] > 0
    assert res["l3"]["chr"] > res["none"]["chr"]
    assert res["l3"]["tiers"]["storage_pages"] > 0


def test_agentic_shared_cache_rule_evens_load(agentic_workload) -> None:
    """With a shared L3 the agentic policy may move idle sessions to the shortest queue:
    in-flight var/mean drops below 0.5 and the hit rate stays within 2 points of session_hash."""
    res = {}
    for name, policy, opts in (("hash", "session_hash", {}), ("agentic", "agentic", {}),
                               ("shared", "agentic", {"shared_cache": True, "shared_move_margin": 2})):
        res[name] = run(SimConfig(replicas=10, profile=KIMI_L3, policy=policy, duration_s=240, sessions=57,
                                  workload=agentic_workload(57), warmup_s=60, seed=1, policy_options=opts))
    sh = res["shared"]["load"]["inflight"]["var_over_mean"]
    assert sh < 0.5
    assert sh < res["agentic"]["load"]["inflight"]["var_over_mean"]
    assert res["shared"]["chr"] >= res["hash"]["chr"] - 0.02
    assert res["shared"]["tiers"]["hit_tokens"]["l3"] > res["hash"]["tiers"]["hit_tokens"]["l3"]
