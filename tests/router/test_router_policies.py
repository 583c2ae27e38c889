"""Unit tests of the routing policies over in-memory replica views (no I/O, simulated time)."""
from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenmill.router.policies import (
    AgenticConfig, AgenticPolicy, NoReplicaAvailable, ReplicaView, RequestMeta, make_policy,
    policy_options, rendezvous_order, stable_hash,
)


def views(n: int, **overrides: dict[str, object]) -> list[ReplicaView]:
    """n idle healthy replicas r0..r{n-1}; overrides maps id -> field values."""
    out = []
    for i in range(n):
        v = ReplicaView(id=f"r{i}", healthy=True, inflight=0)
        for k, val in overrides.get(v.id, {}).items():  # type: ignore[union-attr]
            setattr(v, k, val)
        out.append(v)
    return out


def meta(sid: str | None, now: float = 0.0, prompt: int = 100, key: str | None = None) -> RequestMeta:
    return RequestMeta(session_id=sid, prompt_tokens=prompt, prefix_key=key, now=now)


def one_turn(policy, sid: str, replicas, now: float = 0.0, prompt: int = 100, output: int = 10):
    m = meta(sid, now, prompt)
    d = policy.choose(m, replicas)
    policy.on_finish(m, d.replica_id, output_tokens=output, now=now)
    return d


# ----------------------------------------------------------------------------- rendezvous


def test_stable_hash_is_stable_across_calls_and_parts():
    assert stable_hash("a", "b") == stable_hash("a", "b")
    assert stable_hash("ab", "") != stable_hash("a", "b")


def test_rendezvous_removal_moves_only_the_removed_replicas_keys():
    ids = [f"replica-{i}" for i in range(8)]
    keys = [f"session-{k}" for k in range(4000)]
    before = {k: rendezvous_order(k, ids)[0] for k in keys}
    removed = "replica-3"
    after = {k: rendezvous_order(k, [i for i in ids if i != removed])[0] for k in keys}
    moved = [k for k in keys if before[k] != after[k]]
    assert moved and all(before[k] == removed for k in moved)
    assert len(moved) == sum(1 for k in keys if before[k] == removed)
    # and the removed replica's keys go to their second choice
    assert all(after[k] == rendezvous_order(k, ids)[1] for k in moved)


def test_rendezvous_addition_moves_about_one_over_n_plus_one():
    ids = [f"replica-{i}" for i in range(5)]
    keys = [f"session-{k}" for k in range(6000)]
    before = {k: rendezvous_order(k, ids)[0] for k in keys}
    after = {k: rendezvous_order(k, ids + ["replica-new"])[0] for k in keys}
    moved = [k for k in keys if before[k] != after[k]]
    assert all(after[k] == "replica-new" for k in moved)
    expected = len(keys) / 6  # 1000; binomial sd ~ 29, allow 5 sd
    assert abs(len(moved) - expected) < 150
    # spread over replicas: each holds about 1/5 before the change
    counts = {i: sum(1 for k in keys if before[k] == i) for i in ids}
    assert max(counts.values()) - min(counts.values()) < 200


# ----------------------------------------------------------------------------- simple policies


def test_random_is_reproducible_with_a_seed_and_uses_only_eligible_replicas():
    rs = views(4, r2={"healthy": False}, r3={"draining": True})
    a = [make_policy("random", seed=7).choose(meta(None), rs).replica_id for _ in range(1)]
    p1, p2 = make_policy("random", seed=7), make_policy("random", seed=7)
    seq1 = [p1.choose(meta(None), rs).replica_id for _ in range(50)]
    seq2 = [p2.choose(meta(None), rs).replica_id for _ in range(50)]
    assert seq1 == seq2 and a[0] == seq1[0]
    assert set(seq1) == {"r0", "r1"}


def test_round_robin_cycles_and_least_load_picks_the_least_active():
    rr = make_policy("round_robin")
    rs = views(3)
    assert [rr.choose(meta(None), rs).replica_id for _ in range(6)] == ["r0", "r1", "r2"] * 2
    ll = make_policy("least_load")
    rs = views(3, r0={"inflight": 3}, r1={"num_running": 1, "num_waiting": 1}, r2={"inflight": 1})
    assert ll.choose(meta(None), rs).replica_id == "r2"
    # the replica's own report counts when it exceeds the router's count
    rs = views(2, r0={"inflight": 1}, r1={"num_running": 4})
    assert ll.choose(meta(None), rs).replica_id == "r0"


def test_session_hash_sticks_and_follows_rendezvous():
    p = make_policy("session_hash")
    rs = views(4)
    for k in range(50):
        sid = f"s{k}"
        first = p.choose(meta(sid), rs).replica_id
        assert first == rendezvous_order(sid, [r.id for r in rs])[0]
        assert p.choose(meta(sid), rs).replica_id == first


def test_no_eligible_replica_raises_and_excluded_are_skipped():
    for name in ("random", "round_robin", "least_load", "session_hash", "agentic"):
        p = make_policy(name)
        with pytest.raises(NoReplicaAvailable):
            p.choose(meta("s"), views(2, r0={"healthy": False}, r1={"draining": True}))
        with pytest.raises(NoReplicaAvailable):
            p.choose(meta("s"), [])
        for _ in range(5):
            assert p.choose(meta("s"), views(3), exclude={"r0", "r2"}).replica_id == "r1"


def test_make_policy_validates_names_and_options():
    with pytest.raises(ValueError, match="unknown policy"):
        make_policy("fastest")
    with pytest.raises(ValueError, match="does not take"):
        make_policy("round_robin", seed=1)
    with pytest.raises(ValueError, match="epsilon"):
        make_policy("agentic", epsilon=-1)
    with pytest.raises(ValueError, match="chunk_chars"):
        make_policy("agentic", chunk_chars=0)
    p = make_policy("agentic", session_max_inflight=3, epsilon=None, chunk_chars=32)
    assert isinstance(p, AgenticPolicy) and p.config.session_max_inflight == 3
    assert p.index.config.chunk_chars == 32 and p.config.epsilon == AgenticConfig().epsilon
    assert "session_ttl_s" in policy_options("agentic")


# ----------------------------------------------------------------------------- agentic


def test_placement_goes_to_lowest_score_and_sticks():
    p = AgenticPolicy()
    rs = views(3, r0={"inflight": 2}, r1={"kv_cache_usage": 0.9}, r2={"num_running": 1})
    # scores: r0 = 2, r1 = 0.9, r2 = 1 -> r1
    d = p.choose(meta("a"), rs)
    assert d == type(d)("r1", "placed")
    p.on_finish(meta("a"), "r1")
    # later r1 is the busiest, but a's cache is there: it sticks
    rs = views(3, r1={"inflight": 3})
    assert p.choose(meta("a", now=1), rs).kind == "sticky"
    assert p.session_home("a") == "r1"


def test_placement_ties_follow_rendezvous_rank_and_sessions_count():
    p = AgenticPolicy()
    rs = views(4)
    d = p.choose(meta("x"), rs)
    assert d.replica_id == rendezvous_order("x", [r.id for r in rs])[0]
    # idle sessions count (session_weight): 8 sessions spread 2 per replica
    p2 = AgenticPolicy()
    for k in range(8):
        one_turn(p2, f"s{k}", rs)
    assert sorted(p2.sessions_per_replica().values()) == [2, 2, 2, 2]


def test_load_bound_splits_a_request_off_an_overloaded_home():
    cfg = AgenticConfig(load_floor=0, epsilon=0.25, session_max_inflight=8)
    p = AgenticPolicy(cfg)
    rs = views(3)
    home = p.choose(meta("s"), rs).replica_id
    p.on_finish(meta("s"), home)
    order = rendezvous_order("s", [r.id for r in rs])
    # home has 4 active, the others 1: total 6, bound = ceil(1.25 * 7 / 3) = 3, home + 1 > 3
    busy = {r.id: {"inflight": 4 if r.id == home else 1} for r in rs}
    d = p.choose(meta("s", 1), views(3, **busy))
    assert d.kind == "split"
    assert d.replica_id == [r for r in order if r != home][0]
    assert p.session_home("s") == home
    # home at exactly the bound - 1 (2 active, total 4, bound ceil(1.25*5/3)=3): sticky
    busy = {r.id: {"inflight": 2 if r.id == home else 1} for r in rs}
    assert p.choose(meta("s", 2), views(3, **busy)) == type(d)(home, "sticky")


def test_load_floor_keeps_small_imbalances_sticky():
    p = AgenticPolicy(AgenticConfig(load_floor=4))
    rs = views(3)
    home = one_turn(p, "s", rs).replica_id
    busy = {home: {"inflight": 3}}
    assert p.choose(meta("s", 1), views(3, **busy)).kind == "sticky"
    busy = {home: {"inflight": 4}}
    assert p.choose(meta("s", 2), views(3, **busy)).kind == "split"


def test_split_rule_spreads_a_hot_session_and_returns_home_after():
    p = AgenticPolicy(AgenticConfig(session_max_inflight=2))
    rs = views(3)
    inflight = {r.id: 0 for r in rs}
    metas, chosen = [], []
    for _ in range(8):       # 8 concurrent requests of one session
        current = [ReplicaView(r, True, inflight[r]) for r in sorted(inflight)]
        m = meta("hot")
        d = p.choose(m, current)
        inflight[d.replica_id] += 1
        metas.append(m)
        chosen.append(d)
    home = p.session_home("hot")
    order = rendezvous_order("hot", sorted(inflight))
    second = [r for r in order if r != home][0]
    assert [d.kind for d in chosen[:4]] == ["placed", "sticky", "split", "split"]
    assert [d.replica_id for d in chosen[:4]] == [home, home, second, second]
    assert len({d.replica_id for d in chosen}) == 3
    assert max(inflight.values()) - min(inflight.values()) <= 1
    assert p.counters["split"] == sum(1 for d in chosen if d.replica_id != home) == 5
    assert inflight[home] == 3      # once all hold 2, ties go home first
    for m, d in zip(metas, chosen):
        p.on_finish(m, d.replica_id)
    assert p.session_state("hot").total_inflight == 0
    assert p.choose(meta("hot", 1), views(3)) == type(chosen[0])(home, "sticky")


def test_rebalance_moves_the_smallest_idle_session_after_sustained_overload():
    cfg = AgenticConfig(load_floor=1, rebalance_after_s=10, session_weight=0)
    p = AgenticPolicy(cfg)
    rs = views(2, r1={"inflight": 5})          # r1 busy -> all sessions placed on r0
    sizes = {"big": 5000, "small": 300, "mid": 1000, "busy": 100}
    for sid, size in sizes.items():
        one_turn(p, sid, rs, prompt=size)
    assert set(p.sessions_per_replica()) == {"r0"}
    busy_meta = meta("busy", 0, 100)
    assert p.choose(busy_meta, rs).replica_id == "r0"   # "busy" now has a request in flight
    # r0 turns hot (6 active vs r1's 0) and stays so
    hot = views(2, r0={"inflight": 6})
    for t in (1, 5, 10):
        p.choose(meta("big", t, 5000), hot)   # sticky; big is in flight from now on
    assert p.counters["moved"] == 0 and p.session_home("small") == "r0"
    p.choose(meta(None, 11.5), hot)            # 10.5 s above the bound -> one move
    assert p.session_home("small") == "r1"      # smallest idle session; "busy" is smaller but in flight
    assert p.session_home("mid") == "r0" and p.session_home("busy") == "r0"
    d = p.choose(meta("small", 12, 300), hot)
    assert d == type(d)("r1", "moved")
    p.choose(meta(None, 13), hot)
    assert p.session_home("mid") == "r0"       # the timer restarted: no second move yet
    p.choose(meta(None, 22), hot)
    assert p.session_home("mid") == "r1"        # next smallest idle one, a period later
    p.choose(meta(None, 40), hot)
    assert p.sessions_per_replica() == {"r0": 2, "r1": 2}   # only in-flight sessions left: no move


def test_no_move_when_load_drops_before_the_period_ends():
    p = AgenticPolicy(AgenticConfig(load_floor=1, rebalance_after_s=10))
    for sid in ("a", "b", "c"):
        one_turn(p, sid, views(2, r1={"inflight": 9}))
    hot = views(2, r0={"inflight": 6})
    p.choose(meta(None, 0), hot)
    p.choose(meta(None, 5), views(2))           # load fell: the timer resets
    p.choose(meta(None, 12), hot)
    assert p.sessions_per_replica() == {"r0": 3}


def test_scale_up_keeps_sessions_and_sends_new_sessions_to_the_new_replica():
    p = AgenticPolicy()
    three = views(3)
    for k in range(12):
        one_turn(p, f"old{k}", three)
    homes = {f"old{k}": p.session_home(f"old{k}") for k in range(12)}
    four = views(4)
    for k in range(12):
        assert one_turn(p, f"old{k}", four, now=1).replica_id == homes[f"old{k}"]
    new = [one_turn(p, f"new{k}", four, now=2).replica_id for k in range(4)]
    assert new == ["r3"] * 4


def test_failover_rehomes_only_the_lost_replicas_sessions_and_recovery_takes_new_ones():
    p = AgenticPolicy()
    rs = views(3)
    for k in range(30):
        one_turn(p, f"s{k}", rs)
    homes = {f"s{k}": p.session_home(f"s{k}") for k in range(30)}
    lost = [s for s, h in homes.items() if h == "r1"]
    assert lost
    down = views(3, r1={"healthy": False})
    for k in range(30):
        sid = f"s{k}"
        d = one_turn(p, sid, down, now=1)
        if sid in lost:
            assert d.kind == "failover"
            assert d.replica_id == rendezvous_order(sid, ["r0", "r2"])[0]
        else:
            assert d == type(d)(homes[sid], "sticky")
    assert p.counters["failover"] == len(lost)
    # recovery: moved sessions stay, new sessions prefer the empty replica
    for k in range(30):
        assert one_turn(p, f"s{k}", rs, now=2).replica_id != "r1"
    assert one_turn(p, "fresh", rs, now=3).replica_id == "r1"


def test_draining_replica_gets_no_new_sessions_and_loses_its_own():
    p = AgenticPolicy()
    for k in range(9):
        one_turn(p, f"s{k}", views(3))
    draining = views(3, r2={"draining": True})
    for k in range(9):
        assert one_turn(p, f"s{k}", draining, now=1).replica_id != "r2"
    for k in range(5):
        assert one_turn(p, f"n{k}", draining, now=1).replica_id != "r2"


def test_retry_excludes_the_failed_replica_without_rehoming():
    p = AgenticPolicy()
    rs = views(3)
    home = one_turn(p, "s", rs).replica_id
    m = meta("s", 1)
    d = p.choose(m, rs, exclude={home})
    assert d.kind == "retry" and d.replica_id != home
    p.on_finish(m, d.replica_id)
    assert p.session_home("s") == home
    assert one_turn(p, "s", rs, now=2) == type(d)(home, "sticky")


def test_sessions_expire_after_the_ttl_unless_in_flight():
    p = AgenticPolicy(AgenticConfig(session_ttl_s=100))
    rs = views(3)
    one_turn(p, "idle", rs, now=0)
    long_meta = meta("long", 0)
    p.choose(long_meta, rs)                       # never finishes within the TTL
    assert one_turn(p, "idle", rs, now=90).kind == "sticky"
    assert one_turn(p, "idle", rs, now=189).kind == "sticky"   # TTL counts from last activity
    assert one_turn(p, "idle", rs, now=290).kind == "placed"   # expired, placed anew
    assert p.session_home("long") is not None
    p.on_finish(long_meta, p.session_home("long"), now=300)
    p.choose(meta("other", 500), rs)              # sweep
    assert p.session_home("long") is None and p.session_home("idle") is None
    assert p.num_sessions == 1


def test_prefix_index_routes_anonymous_requests_to_the_replica_that_saw_the_prefix():
    p = AgenticPolicy(AgenticConfig(prefix_min_chunks=4), None)
    rs = views(3)
    system = "You are a coding agent. " * 40          # ~960 chars = 15 chunks of 64
    first = p.choose(meta(None, key=system + "task one"), rs)
    assert first.kind == "least_load"
    # make another replica the least loaded: the prefix still wins
    rs2 = views(3, **{first.replica_id: {"inflight": 1}})
    again = p.choose(meta(None, 1, key=system + "task two, a different ending"), rs2)
    assert again == type(again)(first.replica_id, "prefix")
    # a short common prefix (< 4 chunks) does not count
    short = p.choose(meta(None, 2, key=system[:200] + "x" * 500), rs2)
    assert short.kind == "least_load" and short.replica_id != first.replica_id
    # nor does it when that replica is above the bound
    hot = views(3, **{first.replica_id: {"inflight": 9}})
    assert p.choose(meta(None, 3, key=system), hot).kind == "least_load"
    # token-id keys work the same way (chunks of 16 tokens)
    toks = list(range(1000, 1200))
    d = p.choose(meta(None, 4, key=toks), rs)
    assert p.choose(meta(None, 5, key=toks[:100] + [7] * 50), views(3, **{d.replica_id: {"inflight": 1}})).replica_id == d.replica_id


def test_dead_replica_loses_its_prefix_index():
    p = AgenticPolicy()
    key = "shared prefix " * 100
    d = p.choose(meta(None, key=key), views(2))
    down = views(2, **{d.replica_id: {"healthy": False}})
    p.choose(meta(None, 1), down)
    assert p.index.num_entries(d.replica_id) == 0
    up = views(2, **{[r for r in ("r0", "r1") if r != d.replica_id][0]: {"inflight": 1}})
    assert p.choose(meta(None, 2, key=key), up).kind == "least_load"


def test_same_calls_give_same_decisions():
    def run() -> list[tuple[str, str]]:
        rng = random.Random(3)
        p = make_policy("agentic")
        inflight: dict[str, int] = {f"r{i}": 0 for i in range(4)}
        pending: list[tuple[RequestMeta, str]] = []
        out = []
        for step in range(400):
            if pending and rng.random() < 0.5:
                m, rid = pending.pop(rng.randrange(len(pending)))
                p.on_finish(m, rid, output_tokens=20, now=step)
                inflight[rid] -= 1
                continue
            healthy = not (100 < step < 200)
            rs = [ReplicaView(r, healthy or r != "r2", n) for r, n in inflight.items()]
            m = meta(f"s{rng.randrange(20)}" if rng.random() < 0.9 else None, step,
                     rng.randrange(100, 5000), key="p" * rng.randrange(0, 900))
            d = p.choose(m, rs)
            inflight[d.replica_id] += 1
            pending.append((m, d.replica_id))
            out.append((d.replica_id, d.kind))
        return out

    a, b = run(), run()
    assert a == b
    assert {"placed", "sticky", "failover"} <= {k for _, k in a}


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 5), st.integers(0, 3), st.booleans(), st.integers(0, 6)),
                min_size=1, max_size=60))
def test_agentic_always_picks_an_eligible_replica_and_balances_bookkeeping(ops):
    p = AgenticPolicy(AgenticConfig(session_max_inflight=1, load_floor=0))
    inflight = {f"r{i}": 0 for i in range(4)}
    pending = []
    for t, (session, down, finish_first, load) in enumerate(ops):
        if finish_first and pending:
            m, rid = pending.pop(0)
            p.on_finish(m, rid, now=t)
            inflight[rid] -= 1
        rs = [ReplicaView(r, r != f"r{down}", n + (load if r == "r0" else 0)) for r, n in inflight.items()]
        m = meta(f"s{session}", t)
        d = p.choose(m, rs)
        assert d.replica_id != f"r{down}"
        inflight[d.replica_id] += 1
        pending.append((m, d.replica_id))
        state = p.session_state(f"s{session}")
        assert state is not None and state.home != f"r{down}"
    for m, rid in pending:
        p.on_finish(m, rid, now=len(ops))
    for s in range(6):
        state = p.session_state(f"s{s}")
        assert state is None or state.total_inflight == 0


def test_prefix_index_is_bounded_and_evicts_deep_chunks_first():
    from tokenmill.router.prefix_index import PrefixIndex, PrefixIndexConfig

    idx = PrefixIndex(PrefixIndexConfig(chunk_chars=4, max_entries_per_replica=10))
    a = idx.hashes("aaaabbbbccccdddd")          # 4 chunks
    assert len(a) == 4 and idx.hashes("abc") == [] and idx.hashes(None) == []
    idx.insert("r", a)
    assert idx.match_length("r", a) == 4
    assert idx.match_length("r", idx.hashes("aaaabbbbXXXXdddd")) == 2
    assert idx.match_length("other", a) == 0
    b = idx.hashes("zzzzyyyyxxxxwwwwvvvvuuuu")   # 6 more chunks -> 10 entries, at the limit
    idx.insert("r", b)
    assert idx.num_entries("r") == 10
    idx.insert("r", idx.hashes("qqqqrrrr"))     # 2 more: the 2 oldest go, which are a's deepest
    assert idx.num_entries("r") == 10
    assert idx.match_length("r", a) == 2 and idx.match_length("r", b) == 6
    assert idx.best_match(["x", "r"], b) == ("r", 6)
    idx.remove_replica("r")
    assert idx.best_match(["r"], b) == (None, 0)
