"""One simulated replica: step-model timings against hand-computed values, the engine's scheduler
and the real RadixCache (prefix hits, LRU eviction, preemption), page accounting, and runs of
decode steps against the same steps one by one."""
from __future__ import annotations

import random

import pytest

from tokenmill.sim.profiles import DecodeModel, PrefillModel, ReplicaProfile
from tokenmill.sim.replica import SimReplica, SimRequest

B = 16  # block tokens


def profile(kv_tokens: int = 1 << 16, max_running: int = 64, chunk: int = 512,
            decode_ctx: float = 0.0, slowdown: float | None = None) -> ReplicaProfile:
    return ReplicaProfile(
        name="test", kv_capacity_tokens=kv_tokens, max_running_requests=max_running, page_size=B,
        max_prefill_tokens=chunk, decode_slowdown=slowdown,
        prefill=PrefillModel(fixed_s=0.004, per_token_s=1e-4, per_token_context_s=1e-8),
        decode=DecodeModel(fixed_s=0.010, per_request_s=0.002, per_context_token_s=decode_ctx))


class Driver:
    """Feeds requests to one replica at their arrival times and runs its events."""

    def __init__(self, rep: SimReplica) -> None:
        self.rep = rep
        self.now = 0.0
        self.done: list[SimRequest] = []
        self.events = 0

    def clock(self) -> float:
        return self.now

    def run(self, arrivals: list[tuple[float, SimRequest]], check: bool = True) -> list[SimRequest]:
        arrivals = sorted(arrivals, key=lambda x: x[0])
        i = 0
        while True:
            t_ev = self.rep.next_event_time()
            t_arr = arrivals[i][0] if i < len(arrivals) else None
            if t_ev is None and t_arr is None:
                break
            if t_arr is not None and (t_ev is None or t_arr <= t_ev):
                self.now = t_arr
                arrivals[i][1].arrival = t_arr
                self.done += self.rep.submit(arrivals[i][1], t_arr)
                i += 1
            else:
                assert t_ev is not None
                self.now = t_ev
                self.events += 1
                self.done += self.rep.on_event(t_ev)
            if check:
                self.rep.check_invariants()
        return self.done


def make(prof: ReplicaProfile, retention: float = 0.0) -> tuple[SimReplica, Driver]:
    holder: list[Driver] = []
    rep = SimReplica("r0", prof, B, lambda: holder[0].now, session_retention_s=retention)
    d = Driver(rep)
    holder.append(d)
    return rep, d


_rid = iter(range(1 << 30))


def req(base: int, prompt: int, out: int, session: str | None = None, prefix: list[int] | None = None) -> SimRequest:
    """A request whose blocks are ``prefix`` then ids base, base+1, ..."""
    n = (prompt + out) // B
    head = list(prefix or [])[:n]
    key = head + [base + j for j in range(len(head), n)]
    return SimRequest(next(_rid), session, key, prompt, out, 0.0)


def test_single_request_timing_is_the_formula():
    prof = profile()
    rep, d = make(prof)
    r = req(1000, 1000, 11)
    d.run([(0.0, r)])
    assert r.cached_tokens == 0
    assert r.ttft == pytest.approx(prof.prefill.total_s(1000, 0, 512))
    assert r.t_finish - r.t_first_token == pytest.approx(10 * prof.decode.step_s(1, 0))
    assert rep.idle and rep.num_finished == 1


def test_second_turn_prefills_only_uncached_tokens():
    prof = profile()
    rep, d = make(prof)
    first = req(1000, 1000, 11)
    d.run([(0.0, first)])
    # turn 2 = turn 1's prompt + output + 100 new tokens; same block ids for the shared history
    second = req(5000, 1111, 11, prefix=first.key)
    d.run([(10.0, second)])
    cached = (1011 // B) * B                     # turn 1's whole blocks (prompt + output) were inserted
    assert second.cached_tokens == cached == 1008
    assert second.ttft == pytest.approx(prof.prefill.total_s(1111 - cached, cached, 512))
    assert second.ttft < first.ttft / 5
    assert rep.cached_tokens == cached and rep.prompt_tokens == 2111


def test_simultaneous_arrivals_share_one_prefill_step():
    prof = profile()
    rep, d = make(prof)
    a, b = req(1000, 64, 6), req(2000, 64, 6)
    d.run([(0.0, a), (0.0, b)])
    pre = prof.prefill
    step1 = pre.fixed_s + 2 * 64 * (pre.per_token_s + pre.per_token_context_s * 32)
    assert a.t_first_token == b.t_first_token == pytest.approx(step1)
    assert a.t_finish == b.t_finish == pytest.approx(step1 + 5 * prof.decode.step_s(2, 0))


def test_mixed_step_then_batched_decode():
    prof = profile()
    rep, d = make(prof)
    a, b = req(1000, 64, 6), req(2000, 64, 6)
    pa = prof.prefill.chunk_s(64, 0)
    d1, d2 = prof.decode.step_s(1, 0), prof.decode.step_s(2, 0)
    d.run([(0.0, a), (pa / 2, b)])          # b arrives during a's prefill step: it waits for the next
    assert a.t_first_token == pytest.approx(pa)
    # b's prefill rides in one step with a's first decode
    assert b.t_admit == pytest.approx(pa)
    assert b.t_first_token == pytest.approx(pa + d1 + pa)
    # a had 5 tokens to decode, 1 done in the mixed step, 4 at batch 2
    assert a.t_finish == pytest.approx(b.t_first_token + 4 * d2)
    # b: 4 of its 5 at batch 2, the last alone
    assert b.t_finish == pytest.approx(a.t_finish + d1)


def test_decode_steps_read_a_growing_context():
    prof = profile(decode_ctx=1e-5)
    rep, d = make(prof)
    r = req(1000, 100, 5)
    d.run([(0.0, r)])
    # decode j (1..4) computes the token at position 100 + j - 1 and reads 100 + j tokens
    expect = sum(prof.decode.step_s(1, 100 + j) for j in range(1, 5))
    assert r.t_finish - r.t_first_token == pytest.approx(expect)


def test_speculative_tokens_per_step_scale_the_decode_cost():
    base = profile()
    spec = ReplicaProfile(name="spec", kv_capacity_tokens=base.kv_capacity_tokens, max_running_requests=64,
                          page_size=B, max_prefill_tokens=512, prefill=base.prefill,
                          decode=DecodeModel(fixed_s=0.010, per_request_s=0.002, tokens_per_step=4.0))
    rep, d = make(spec)
    r = req(1000, 100, 41)
    d.run([(0.0, r)])
    assert r.t_finish - r.t_first_token == pytest.approx(40 * base.decode.step_s(1, 0) / 4)


def test_lru_eviction_uses_the_real_cache():
    prof = profile(kv_tokens=8 * B)          # 8 pages
    rep, d = make(prof)
    a, b, c = req(100, 48, 16), req(200, 48, 16), req(300, 48, 16)   # 4 pages each
    d.run([(0.0, a)])
    d.run([(1.0, b)])
    # each cached its whole computed pages: 48 + 15 tokens = 3 pages; the partial 4th went back
    assert rep.cache.num_cached_pages == 6 and rep.pool.num_free() == 2
    d.run([(2.0, c)])                        # needs 4 pages, 2 free: evicts the least recently
    assert rep.cache.num_cached_pages == 7   # used, from the tail of a's leaf inwards: a keeps 1
    a2, b2 = req(900, 48, 16, prefix=a.key), req(901, 48, 16, prefix=b.key)
    d.run([(3.0, b2)])
    assert b2.cached_tokens == 32            # (48 - 1) // 16 whole blocks of b's prompt
    d.run([(4.0, a2)])
    assert a2.cached_tokens == 16            # what is left of a


def test_out_of_pages_preempts_the_last_admitted_and_recomputes_it():
    prof = profile(kv_tokens=8 * B)
    rep, d = make(prof)
    a, b = req(100, 64, 16), req(200, 64, 16)           # 5 pages each at the end, 8 in the pool
    d.run([(0.0, a), (0.0, b)])
    assert rep.num_preemptions >= 1                     # b gave its pages to a
    assert b.t_finish > a.t_finish
    assert a.cached_tokens == b.cached_tokens == 0      # first admission: nothing cached
    assert rep.prompt_tokens == 128                     # a recompute is not a new prompt
    assert rep.idle and rep.pool.num_free() + rep.cache.num_cached_pages == rep.pool.num_pages


def test_max_running_requests_queues_the_rest():
    prof = profile(max_running=1)
    rep, d = make(prof)
    a, b = req(100, 32, 4), req(200, 32, 4)
    rep.submit(a, 0.0)
    rep.submit(b, 0.0)
    assert (rep.num_running, rep.num_waiting, rep.inflight) == (0, 2, 2)   # joins the next step
    rep.on_event(0.0)
    assert (rep.num_running, rep.num_waiting, rep.inflight) == (1, 1, 2)
    d.run([])
    assert b.t_admit == pytest.approx(a.t_finish)


def test_kv_cache_usage_counts_only_pinned_and_held_pages():
    prof = profile(kv_tokens=10 * B)
    rep, d = make(prof)
    a = req(100, 64, 16)
    rep.submit(a, 0.0)
    rep.on_event(0.0)
    assert rep.kv_cache_usage == pytest.approx(4 / 10)  # pages for the prompt, allocated per step
    d.run([])
    assert rep.cache.num_cached_pages == 4              # 79 computed tokens: 4 whole pages
    assert rep.kv_cache_usage == 0.0                    # cached but evictable


def test_a_request_larger_than_the_pool_does_not_fit():
    rep, _ = make(profile(kv_tokens=8 * B))
    assert not rep.fits(req(1, 200, 16))
    assert rep.fits(req(2, 100, 16))


def test_page_accounting_holds_under_a_random_mix():
    prof = profile(kv_tokens=64 * B, max_running=6, chunk=64, decode_ctx=1e-6)
    rep, d = make(prof, retention=5.0)
    rng = random.Random(7)
    prefixes = [[-(k * 1000 + j) for j in range(40)] for k in range(5)]
    arrivals = []
    for i in range(150):
        prompt, out = rng.randint(20, 500), rng.randint(1, 40)
        r = req(10_000 * (i + 1), prompt, out, session=f"s{i % 9}", prefix=rng.choice(prefixes)[:rng.randint(0, 40)])
        arrivals.append((rng.uniform(0, 30), r))
    done = d.run(arrivals)                              # check_invariants after every event
    assert len(done) == 150 and rep.idle
    assert all(r.t_admit >= r.arrival and r.t_first_token >= r.t_admit and r.t_finish >= r.t_first_token for r in done)
    assert rep.pool.num_free() + rep.cache.num_cached_pages == rep.pool.num_pages
    assert rep.cached_tokens > 0


def _random_trace(seed: int, n: int) -> list[tuple[float, SimRequest]]:
    rng = random.Random(seed)
    prefixes = [[-(k * 1000 + j) for j in range(40)] for k in range(4)]
    out = []
    for i in range(n):
        prompt, gen = rng.randint(20, 400), rng.randint(1, 60)
        r = req(10_000 * (i + 1), prompt, gen, session=f"s{i % 7}", prefix=rng.choice(prefixes)[:rng.randint(0, 40)])
        out.append((rng.uniform(0, 20), r))
    return out


@pytest.mark.parametrize("kv_pages,slowdown", [(48, None), (400, None), (48, 2.0), (400, 1.5)])
def test_runs_of_decode_steps_equal_the_steps_one_by_one(kv_pages, slowdown):
    """The fast path (many decode steps planned at once, cut by arrivals) changes nothing:
    same admissions, hits, preemptions and timings as planning every step (also with the
    engine's prefill bound, whose step-time fit sees every step of a run)."""
    prof = profile(kv_tokens=kv_pages * B, max_running=8, chunk=96, decode_ctx=2e-6, slowdown=slowdown)
    results = []
    for fast in (True, False):
        holder: list[Driver] = []
        rep = SimReplica("r0", prof, B, lambda: holder[0].now, session_retention_s=3.0, fast_forward=fast)
        d = Driver(rep)
        holder.append(d)
        trace = _random_trace(11, 120)
        done = d.run(list(trace))
        assert len(done) == 120 and rep.idle
        results.append((rep, d.events, [(r.t_admit, r.t_first_token, r.t_finish, r.cached_tokens) for _, r in trace]))
    (fast_rep, fast_events, fast), (slow_rep, slow_events, slow) = results
    for f, s in zip(fast, slow):
        assert f[3] == s[3]
        assert f[:3] == pytest.approx(s[:3], rel=1e-9, abs=1e-9)
    assert fast_rep.num_steps == slow_rep.num_steps
    assert fast_events < slow_events * (0.5 if kv_pages > 48 else 0.95 if slowdown else 0.8)   # runs stood in for steps
    assert fast_rep.num_preemptions == slow_rep.num_preemptions
    assert fast_rep.busy_s == pytest.approx(slow_rep.busy_s, rel=1e-9)
    assert (fast_rep.prompt_tokens, fast_rep.cached_tokens) == (slow_rep.prompt_tokens, slow_rep.cached_tokens)
    assert fast_rep.cached_tokens > 0
    if kv_pages == 48:
        assert slow_rep.num_preemptions > 0     # the small pool exercises preemption and eviction


def test_simulator_imports_no_torch():
    """The simulator and the engine modules it reuses stay torch-free (a fresh interpreter)."""
    import subprocess
    import sys

    code = ("import sys; import tokenmill.sim.fleet, tokenmill.sim.replica, tokenmill.sim.cli, "
            "tokenmill.engine.scheduler, tokenmill.engine.kv_manager, tokenmill.engine.request; "
            "bad = sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')); "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_the_lone_cap_reaches_the_replicas_scheduler():
    """``decode_slowdown_lone`` is the engine's ``--decode-slowdown-lone``: the replica's own
    step-cost model gets it, so a simulated fleet schedules as the engine would."""
    import dataclasses

    prof = dataclasses.replace(profile(slowdown=1.75), decode_slowdown_lone=2.0)
    rep = SimReplica("r0", prof, B, lambda: 0.0)
    assert rep.scheduler.step_cost.lone_slowdown == 2.0
    assert SimReplica("r1", profile(slowdown=1.75), B, lambda: 0.0).scheduler.step_cost.lone_slowdown is None


def test_the_prefill_hold_reaches_the_replicas_scheduler():
    """``prefill_hold_below`` / ``prefill_hold_steps`` are the engine's ``--prefill-hold-below`` /
    ``--prefill-hold-steps``: the replica's step-cost model gets them (off unless set)."""
    import dataclasses

    prof = dataclasses.replace(profile(slowdown=1.75), prefill_hold_below=16, prefill_hold_steps=8)
    cost = SimReplica("r0", prof, B, lambda: 0.0).scheduler.step_cost
    assert (cost.hold_below, cost.hold_steps) == (16, 8)
    assert SimReplica("r1", profile(slowdown=1.75), B, lambda: 0.0).scheduler.step_cost.hold_below == 0
