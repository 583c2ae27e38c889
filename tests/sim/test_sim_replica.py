"""One simulated replica: step-model timings against hand-computed values, the real RadixCache
(prefix hits, LRU eviction) and page accounting."""
from __future__ import annotations

import random

import pytest

from tokenmill.sim.profiles import DecodeModel, PrefillModel, ReplicaProfile
from tokenmill.sim.replica import SimReplica, SimRequest

B = 16  # block tokens


def profile(kv_tokens: int = 1 << 16, max_running: int = 64, chunk: int = 512,
            decode_ctx: float = 0.0) -> ReplicaProfile:
    return ReplicaProfile(
        name="test", kv_capacity_tokens=kv_tokens, max_running_requests=max_running, page_size=B,
        max_prefill_tokens=chunk,
        prefill=PrefillModel(fixed_s=0.004, per_token_s=1e-4, per_token_context_s=1e-8),
        decode=DecodeModel(fixed_s=0.010, per_request_s=0.002, per_context_token_s=decode_ctx))


class Driver:
    """Feeds requests to one replica at their arrival times and runs its events."""

    def __init__(self, rep: SimReplica) -> None:
        self.rep = rep
        self.now = 0.0
        self.done: list[SimRequest] = []

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


def test_mixed_step_then_batched_decode():
    prof = profile()
    rep, d = make(prof)
    a, b = req(1000, 64, 6), req(2000, 64, 6)
    d.run([(0.0, a), (0.0, b)])
    pa = prof.prefill.chunk_s(64, 0)
    d1, d2 = prof.decode.step_s(1, 0), prof.decode.step_s(2, 0)
    assert a.t_first_token == pytest.approx(pa)
    # b's prefill rides in one step with a's first decode
    assert b.t_first_token == pytest.approx(pa + d1 + pa)
    # a had 5 tokens to decode, 1 done in the mixed step, 4 at batch 2
    assert a.t_finish == pytest.approx(b.t_first_token + 4 * d2)
    # b: 4 of its 5 at batch 2, the last alone
    assert b.t_finish == pytest.approx(a.t_finish + d1)


def test_lru_eviction_uses_the_real_cache():
    prof = profile(kv_tokens=8 * B)          # 8 pages
    rep, d = make(prof)
    a, b, c = req(100, 48, 16), req(200, 48, 16), req(300, 48, 16)   # 4 pages each
    d.run([(0.0, a)])
    d.run([(1.0, b)])
    assert rep.cache.num_cached_pages == 8 and rep.pool.num_free() == 0
    d.run([(2.0, c)])                        # evicts the least recently used: a
    a2, b2 = req(900, 48, 16, prefix=a.key), req(901, 48, 16, prefix=b.key)
    d.run([(3.0, b2)])
    assert b2.cached_tokens == 32            # (48 - 1) // 16 whole blocks of b's prompt
    d.run([(4.0, a2)])
    assert a2.cached_tokens == 0


def test_a_request_waits_for_pages_held_by_a_running_one():
    prof = profile(kv_tokens=8 * B)
    rep, d = make(prof)
    a, b = req(100, 64, 16), req(200, 64, 16)           # 5 pages each, 8 in the pool
    rep.submit(a, 0.0)
    rep.submit(b, 0.0)
    assert rep.num_running == 1 and rep.num_waiting == 1
    d.run([])
    assert b.t_admit == pytest.approx(a.t_finish)        # admitted when a's pages became evictable
    assert b.cached_tokens == 0


def test_max_running_requests_queues_the_rest():
    prof = profile(max_running=1)
    rep, d = make(prof)
    a, b = req(100, 32, 4), req(200, 32, 4)
    rep.submit(a, 0.0)
    rep.submit(b, 0.0)
    assert (rep.num_running, rep.num_waiting, rep.inflight) == (1, 1, 2)
    d.run([])
    assert b.t_admit == pytest.approx(a.t_finish)


def test_kv_cache_usage_counts_only_pinned_and_held_pages():
    prof = profile(kv_tokens=10 * B)
    rep, d = make(prof)
    a = req(100, 64, 16)
    rep.submit(a, 0.0)
    assert rep.kv_cache_usage == pytest.approx(5 / 10)
    d.run([])
    assert rep.cache.num_cached_pages == 5
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
