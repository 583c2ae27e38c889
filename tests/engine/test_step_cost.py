"""The online step-time model and the prefill budget it gives the scheduler."""
from __future__ import annotations

import pytest

from tokenmill.cache.page_pool import PagePool
from tokenmill.contracts.sampling import SamplingParams
from tokenmill.engine.kv_manager import KVManager
from tokenmill.engine.request import Request, RequestStatus
from tokenmill.engine.scheduler import Scheduler
from tokenmill.engine.step_cost import StepCost


def test_fit_recovers_a_line_and_budget_keeps_the_slowdown():
    cost = StepCost(slowdown=2.0)
    assert cost.fit() is None and cost.prefill_budget(4, 500) == cost.warmup_tokens
    for n in (1, 4, 16, 64, 200, 8, 32):
        cost.observe(n, 0.050 + 0.002 * n)
    a, b, c = cost.fit()
    assert a == pytest.approx(0.050, rel=1e-6) and b == pytest.approx(0.002, rel=1e-6) and c == 0.0
    d = 4
    p = cost.prefill_budget(d, 10_000)
    assert cost.predict(d + p) <= 2.0 * cost.predict(d) + 1e-12
    assert cost.predict(d + p + 1) > 2.0 * cost.predict(d)
    assert cost.prefill_budget(d, 10) == 10           # never above what the step has left
    cost2 = StepCost(slowdown=2.0)
    for n in (1, 2, 3, 4):
        cost2.observe(n, 1.0)                         # flat: extra tokens are free
    assert cost2.prefill_budget(1, 300) == 300


def test_chunks_end_on_whole_row_groups():
    """With kernels that handle rows in groups of 16, a chunk that would end a few rows into a new
    group is cut back to the last whole group; within the first group, on a group's end, or where
    the decodes already end inside the chunk's last group, the line's chunk stands."""
    def budget(group: int, decodes: int, limit: int = 10_000) -> int:
        cost = StepCost(slowdown=2.0, row_group=group)
        for n in (1, 4, 16, 64, 200, 8, 32):
            cost.observe(n, 0.0105 + 0.001 * n)   # 2 T(d) = T(d) + 0.0105 + 0.001 d: 10.5 + d more rows
        return cost.prefill_budget(decodes, limit)
    assert budget(1, 9) == 19                  # 28 rows: the line alone
    assert budget(16, 9) == 7                  # cut back to 16 rows
    assert budget(16, 2) == 12                 # 14 rows: inside the first group, as the line says
    assert budget(16, 22) == 26                # 22 + 32 = 54 rows -> 48
    assert budget(16, 3) == 13                 # 16 rows: already whole
    assert budget(16, 20, limit=5) == 5        # 25 rows: the decodes already end in that group
    assert budget(16, 16, limit=5) == 1        # 21 rows: cut to nothing, but a first chunk keeps min_tokens
    bound = StepCost(slowdown=2.0, row_group=16)
    for n in (1, 4, 16, 64, 200, 8, 32):
        bound.observe(n, 0.0105 + 0.001 * n)
    b = bound.bound(9)
    b.add(0, b.cap(0, 10_000))                 # the first chunk fills the group: 16 rows
    assert b.rows == 16 and b.cap(0, 4) == 0   # a second chunk would only spill into the next one
    assert budget(16, 9, limit=3) == 3         # never above what the step has left


def test_old_observations_fade():
    cost = StepCost(slowdown=2.0, decay=0.8)
    for n in (1, 50, 100):
        cost.observe(n, 1.0 + 0.1 * n)
    for _ in range(40):
        for n in (1, 50, 100):
            cost.observe(n, 0.01 + 0.001 * n)
    a, b, _ = cost.fit()
    assert a == pytest.approx(0.01, rel=1e-3) and b == pytest.approx(0.001, rel=1e-3)


@pytest.mark.parametrize("bad", [dict(slowdown=1.0), dict(min_tokens=0), dict(decay=1.0), dict(split_rows=0),
                                 dict(slowdown=2.0, finish_slowdown=1.5), dict(row_group=0),
                                 dict(lone_slowdown=1.0), dict(lone_min_prefill=-1)])
def test_bad_settings_are_refused(bad):
    with pytest.raises(ValueError):
        StepCost(**bad)


def test_scheduler_bounds_prefill_only_while_decodes_run():
    cost = StepCost(slowdown=2.0, min_tokens=8)
    for n in (1, 10, 100, 400):
        cost.observe(n, 0.05 + 0.005 * n)            # budget with 1 decode: (0.055) / 0.005 = 11
    sched = Scheduler(KVManager(PagePool(256), 16), max_batch_tokens=512, max_running_requests=8,
                      step_cost=cost)
    a = Request("a", list(range(300)), SamplingParams(max_tokens=4))
    sched.add_request(a)
    out = sched.schedule()                            # alone: the whole budget
    assert [s.num_tokens for s in out.scheduled] == [300]
    sched.post_step(out)
    a.all_token_ids.append(7)                         # a now decodes
    b = Request("b", list(range(1000, 1400)), SamplingParams(max_tokens=4))
    sched.add_request(b)
    out = sched.schedule()
    tokens = {s.request.request_id: s.num_tokens for s in out.scheduled}
    assert tokens == {"a": 1, "b": 11}


@pytest.mark.parametrize("streamed", [(False,), (True,), (False, False), (False, True)])
def test_only_streamed_decodes_bound_the_prefill_beside_them(streamed):
    """A response sent whole is seen only at its end: its decodes leave the step to prefill (the
    whole budget, as without a bound). One streamed decode in the step brings the bound back
    for all of it (the step's time is what that stream waits for)."""
    cost = StepCost(slowdown=2.0, min_tokens=8)
    for n in (1, 10, 100, 400):
        cost.observe(n, 0.05 + 0.005 * n)
    sched = Scheduler(KVManager(PagePool(256), 16), max_batch_tokens=512, max_running_requests=8,
                      step_cost=cost)
    decoders = [Request(f"d{i}", list(range(100 * i, 100 * i + 40)), SamplingParams(max_tokens=8), streamed=s)
                for i, s in enumerate(streamed)]
    for r in decoders:
        sched.add_request(r)
    assert _step(sched) == {r.request_id: 40 for r in decoders}   # all prefilled; now they decode
    sched.add_request(Request("p", list(range(1000, 1600)), SamplingParams(max_tokens=4)))
    got = _step(sched)
    d = len(decoders)
    assert all(got[r.request_id] == 1 for r in decoders)
    if any(streamed):
        assert cost.predict(d + got["p"]) <= 2.0 * cost.predict(d) + 1e-12 < cost.predict(d + got["p"] + 1)
    else:
        assert got["p"] == 512 - d                    # the rest of the step budget


@pytest.mark.parametrize("finish", [None, 4.0])
def test_a_prefill_whose_remainder_fits_the_finishing_bound_goes_at_once(finish):
    """With one decode running, the bound gives 11 tokens a step (2x the 55 ms decode step); the
    finishing exception lets a request being admitted take its whole prefill when the step stays
    within 4x (220 ms: at most 33 prefill tokens). A longer prefill is cut as before, to its
    end: its tail does not get the exception. Without it every chunk keeps the bound."""
    def decoding() -> tuple[StepCost, Scheduler]:
        cost = StepCost(slowdown=2.0, min_tokens=8, finish_slowdown=finish)
        for n in (1, 10, 100, 400):
            cost.observe(n, 0.05 + 0.005 * n)
        sched = Scheduler(KVManager(PagePool(256), 16), max_batch_tokens=512, max_running_requests=8,
                          step_cost=cost)
        sched.add_request(Request("a", list(range(300)), SamplingParams(max_tokens=40)))
        assert _step(sched) == {"a": 300}             # alone: the whole budget; a now decodes
        return cost, sched

    def chunks(n: int) -> list[int]:
        cost, sched = decoding()
        r = Request("p", list(range(1000, 1000 + n)), SamplingParams(max_tokens=4))
        sched.add_request(r)
        got = []
        while r.num_computed_tokens < n:
            step = _step(sched)
            assert step["a"] == 1
            got.append(step["p"])
            assert cost.predict(1 + got[-1]) <= (finish or 2.0) * cost.predict(1) + 1e-12
        return got

    if finish is None:
        assert chunks(30) == [11, 11, 8]
        assert chunks(62) == [11, 11, 11, 11, 11, 7]
    else:
        assert chunks(30) == [30]                     # an agent turn's prefill: one step
        assert chunks(33) == [33]
        assert chunks(34) == [11, 11, 11, 1]          # does not fit whole: bounded chunks to the end
        assert chunks(62) == [11, 11, 11, 11, 11, 7]


def test_a_short_prefill_cut_once_still_finishes_in_the_next_step():
    """A short turn admitted beside another one gets only the bound's leftover (1 token); it is
    still short (30 tokens whole fit 4x beside the decodes), so the next step takes its remainder
    at once instead of 12-token chunks."""
    cost = StepCost(slowdown=2.0, min_tokens=8, finish_slowdown=4.0)
    for n in (1, 10, 100, 400):
        cost.observe(n, 0.05 + 0.005 * n)
    sched = Scheduler(KVManager(PagePool(256), 16), max_batch_tokens=512, max_running_requests=8,
                      step_cost=cost)
    sched.add_request(Request("a", list(range(300)), SamplingParams(max_tokens=40)))
    assert _step(sched) == {"a": 300}
    sched.add_request(Request("s1", list(range(1000, 1010)), SamplingParams(max_tokens=40)))
    sched.add_request(Request("s2", list(range(2000, 2030)), SamplingParams(max_tokens=40)))
    first = _step(sched)
    assert first["a"] == 1 and first["s1"] == 10 and 0 < first["s2"] < 30
    assert _step(sched) == {"a": 1, "s1": 1, "s2": 30 - first["s2"]}


def _step(sched: Scheduler) -> dict[str, int]:
    out = sched.schedule()
    sched.post_step(out)
    for s in out.scheduled:
        if s.samples:
            s.request.all_token_ids.append(7)
    return {s.request.request_id: s.num_tokens for s in out.scheduled}


@pytest.mark.parametrize("shortest_first", [True, False])
def test_short_prefill_goes_before_a_long_one_while_decodes_run(shortest_first):
    """A new turn with little left to prefill is not queued behind a long first prompt while the
    budget is bounded; the long one still moves once passed over prefill_max_passes times."""
    cost = StepCost(slowdown=2.0, min_tokens=8)
    for n in (1, 10, 100, 400):
        cost.observe(n, 0.05 + 0.005 * n)            # budget with 1 decode: 11 tokens
    sched = Scheduler(KVManager(PagePool(256), 16), max_batch_tokens=512, max_running_requests=8,
                      step_cost=cost)
    sched.shortest_prefill_first = shortest_first
    a = Request("a", list(range(300)), SamplingParams(max_tokens=40))
    sched.add_request(a)
    assert _step(sched) == {"a": 300}                 # alone: the whole budget; a now decodes
    long = Request("long", list(range(1000, 1400)), SamplingParams(max_tokens=4))
    sched.add_request(long)
    assert _step(sched) == {"a": 1, "long": 11}
    short = Request("short", list(range(2000, 2020)), SamplingParams(max_tokens=4))
    sched.add_request(short)
    got = _step(sched)
    if not shortest_first:                            # first come, first served
        assert got == {"a": 1, "long": 11}
        return
    assert got == {"a": 1, "short": 11}               # admitted ahead of the running long prefill
    assert _step(sched) == {"a": 1, "short": 9, "long": 2}
    assert short.num_computed_tokens == 20 and long.num_computed_tokens == 13
    # a stream of short prefills cannot starve the long one: after 4 passes it goes first
    for i in range(6):
        sched.add_request(Request(f"s{i}", list(range(3000 + 100 * i, 3010 + 100 * i)),
                                  SamplingParams(max_tokens=1)))
    seen = [_step(sched) for _ in range(6)]
    assert sum(1 for t in seen if "long" in t) >= 3 and long.num_computed_tokens >= 13 + 30


# -- attention pairs and kinds of step ---------------------------------------------------------------

def _quant_cpu(rows: int, pairs: int) -> float:
    """A synthetic machine like this one with packed weights: up to 16 rows run the integer kernels
    (cheap per step, dearer per row), more rows pay a dequantization (35 ms) and then GEMM rates;
    attention pairs cost 1 us each in both kinds."""
    if rows <= 16:
        return 0.010 + 0.0015 * rows + 1e-6 * pairs
    return 0.035 + 0.0010 * rows + 1e-6 * pairs


def _observe_mixture(cost: StepCost, fn=_quant_cpu) -> None:
    for rows, pairs in [(1, 300), (2, 900), (4, 1600), (3, 400), (4, 4000), (8, 3000), (16, 9000), (12, 300),
                        (512, 200_000), (300, 50_000), (64, 80_000), (128, 10_000), (20, 30_000), (400, 300_000)]:
        cost.observe(rows, fn(rows, pairs), pairs)


def test_step_shape_counts_rows_and_causal_pairs():
    from tokenmill.engine.step_cost import StepShape, chunk_pairs

    class S:
        def __init__(self, start, n):
            self.start, self.num_tokens = start, n
    assert chunk_pairs(0, 3) == 1 + 2 + 3
    assert chunk_pairs(10, 1) == 11                     # a decode reads its whole context
    assert StepShape.of([S(10, 1), S(100, 4)]) == (5, 11 + 4 * 100 + 10)


def test_each_kind_has_its_own_fit_with_an_attention_term():
    cost = StepCost(slowdown=2.0, split_rows=16)
    _observe_mixture(cost)
    for rows in (4, 100):
        a, b, c = cost.fit(rows)
        want = (0.010, 0.0015) if rows <= 16 else (0.035, 0.0010)
        assert (a, b, c) == pytest.approx((*want, 1e-6), rel=1e-6)
    assert cost.predict(16, 5000) == pytest.approx(_quant_cpu(16, 5000))
    assert cost.predict(17, 5000) == pytest.approx(_quant_cpu(17, 5000))


def test_budget_keeps_the_bound_in_the_cheap_kind_and_shrinks_with_context():
    cost = StepCost(slowdown=2.0, split_rows=16)
    _observe_mixture(cost)
    d, dp = 4, 4 * 400                                  # four decodes at 400 tokens of context
    alone = _quant_cpu(d, dp)
    for context in (0, 500, 3000):
        k = cost.prefill_budget(d, 508, decode_pairs=dp, context=context)
        pairs = dp + k * context + k * (k + 1) // 2
        assert _quant_cpu(d + k, pairs) <= 2.0 * alone + 1e-12
        assert _quant_cpu(d + k + 1, pairs + context + k + 1) > 2.0 * alone   # the largest that fits
        assert d + k <= 16                              # a 17-row step would cost 3x: never chosen
    ks = [cost.prefill_budget(d, 508, decode_pairs=dp, context=c) for c in (0, 500, 3000)]
    assert ks[0] > ks[1] > ks[2] >= 1                   # a chunk reading more context is smaller
    # a looser bound can afford the dequantize + GEMM kind, and then takes all it allows
    k = ks[0]
    loose = StepCost(slowdown=10.0, split_rows=16)
    _observe_mixture(loose)
    kl = loose.prefill_budget(d, 508, decode_pairs=dp, context=0)
    assert kl > 16 > k and _quant_cpu(d + kl, dp + kl * (kl + 1) // 2) <= 10.0 * alone
    assert _quant_cpu(d + kl + 1, dp + (kl + 1) * (kl + 2) // 2) > 10.0 * alone


def test_warmup_with_kinds_stays_in_the_cheap_kind():
    cost = StepCost(slowdown=2.0, split_rows=16)
    # all of the room left in the cheap kind, then half of it: the kind's fit needs rows that vary
    assert [cost.prefill_budget(4, 500) for _ in range(4)] == [12, 6, 12, 6]
    # the decodes already fill the cheap kind: the plain warm-up budget (not a 1-token chunk
    # every step, which would keep the fits from ever seeing a spread of rows)
    assert cost.prefill_budget(20, 500) == cost.warmup_tokens


def test_a_kind_never_measured_is_entered_to_measure_it():
    """Decodes always running: the GEMM kind was never seen, the cheap kind is known. A step with
    the cheap kind full gets a warm-up's worth of chunk rather than the 1-token floor forever."""
    cost = StepCost(slowdown=2.0, split_rows=4)
    for rows, t in [(1, 0.010), (2, 0.011), (3, 0.012), (4, 0.013)] * 2:
        cost.observe(rows, t)
    assert cost.fit(4) is not None and cost.fit(5) is None
    # in turns all of the warm-up and half of it (the kind's fit needs rows that vary): with 2
    # decodes, the 2 rows left in the cheap kind, then 64 more, or half of those 66
    assert cost.prefill_budget(4, 500) == cost.warmup_tokens
    assert cost.prefill_budget(2, 500) == 3 + (2 + cost.warmup_tokens - 3) // 2
    assert cost.prefill_budget(2, 500) == 2 + cost.warmup_tokens
    for rows, t in [(5, 0.020), (40, 0.035), (68, 0.046)] * 2:      # measured now: the bound takes over
        cost.observe(rows, t)
    assert cost.prefill_budget(4, 500) < cost.warmup_tokens


def test_negative_slope_from_noise_is_dropped():
    cost = StepCost(slowdown=2.0)
    # time grows with rows; the pairs happen to be largest on the cheapest steps
    for rows, pairs, t in [(1, 9000, 0.011), (2, 5000, 0.012), (4, 100, 0.014), (8, 50, 0.018), (16, 10, 0.026)]:
        cost.observe(rows, t, pairs)
    a, b, c = cost.fit()
    assert c == 0.0 and b > 0.0
    assert cost.predict(16, 10) == pytest.approx(0.026, abs=2e-3)


def test_bound_is_shared_by_every_chunk_and_admission_of_a_step():
    cost = StepCost(slowdown=2.0, split_rows=16)
    _observe_mixture(cost)
    kv = KVManager(PagePool(512), 16)
    sched = Scheduler(kv, max_batch_tokens=1200, max_running_requests=8, step_cost=cost)
    decoders = [Request(f"d{i}", list(range(i * 1000, i * 1000 + 300)), SamplingParams(max_tokens=50))
                for i in range(4)]
    for r in decoders:
        sched.add_request(r)
    _step(sched)                                        # 4 x 300 prompt tokens in one step
    assert all(r.num_uncomputed_tokens == 1 for r in decoders)
    prefills = [Request(f"p{i}", list(range(50_000 + i * 1000, 50_000 + i * 1000 + n)), SamplingParams(max_tokens=2))
                for i, n in enumerate((400, 15, 15))]
    for r in prefills:
        sched.add_request(r)
    most_chunks = 0
    for _ in range(30):
        out = sched.schedule()
        shape = out.shape
        decode = [s for s in out.scheduled if s.start == s.request.num_tokens - 1]   # one token behind
        dpairs = sum(s.start + 1 for s in decode)
        if len(decode) == len(out.scheduled):
            break
        assert _quant_cpu(shape.rows, shape.pairs) <= 2.0 * _quant_cpu(len(decode), dpairs) + 1e-12
        assert shape.rows <= 16 and shape.rows > len(decode) + 1      # prefill moves, in the cheap kind
        most_chunks = max(most_chunks, len(out.scheduled) - len(decode))
        cost.observe_step(out.scheduled, _quant_cpu(shape.rows, shape.pairs))
        sched.post_step(out)
        for s in out.scheduled:
            if s.samples:
                s.request.all_token_ids.append(7)
    assert most_chunks >= 2                             # chunks and admissions share one bound
    assert all(r.num_computed_tokens > 0 for r in prefills)


def _amx_like(cost: StepCost) -> None:
    """Packed int4 on the amx set: a lone decode on the one-row kernel (7 ms plus its context),
    two rows and up on the tiles (from 11 ms), contexts varying apart from the rows."""
    for ctx in (200, 400, 600, 800) * 2:
        cost.observe(1, 0.007 + 1e-6 * ctx, ctx)
    for i, rows in enumerate((2, 5, 9, 14, 16) * 2):
        cost.observe(rows, 0.011 + 0.0008 * rows, 300 + 53 * i)


def test_a_lone_decode_step_is_a_kind_of_its_own():
    """With ``single_row`` one-row steps have their own fit (on context alone, their rows never
    vary), and the bound of a step with one decode is relative to that; one line through every
    row count put the lone decode near the tiles' intercept and let the mixed step grow with it."""
    # the amx set's limit: every step up to 2,048 rows runs the integer kernels (one kind besides)
    shared, own = StepCost(slowdown=1.75, split_rows=2048), StepCost(slowdown=1.75, split_rows=2048, single_row=True)
    _amx_like(shared)
    _amx_like(own)
    assert own.kind(1) == 2 and own.kind(2) == 0 and shared.kind(1) == 0
    assert own.predict(1, 400) == pytest.approx(0.0074, rel=1e-6)
    assert own.fit(2) == pytest.approx((0.011, 0.0008, 0.0), abs=1e-9)
    assert shared.predict(1, 400) > 0.009                     # the shared line misses the lone step (+22%)
    k_own = own.prefill_budget(1, 500, decode_pairs=400, context=0)
    k_shared = shared.prefill_budget(1, 500, decode_pairs=400, context=0)
    assert k_own == 1 and 0.011 + 0.0008 * (1 + k_own) <= 1.75 * 0.0074   # the largest chunk within 1.75x
    assert k_shared > k_own


def test_a_single_row_fit_without_spread_is_the_mean():
    cost = StepCost(slowdown=2.0, split_rows=16, single_row=True)
    assert cost.fit(1) is None
    for t in (0.008, 0.010, 0.009, 0.009):
        cost.observe(1, t, 500)                               # same rows, same context
    a, b, c = cost.fit(1)
    assert b == 0.0 and c == 0.0 and 0.008 < a < 0.010
    plain = StepCost(slowdown=2.0, split_rows=16)            # without single_row: no line in rows yet
    for t in (0.008, 0.010, 0.009, 0.009):
        plain.observe(1, t, 500)
    assert plain.fit(1) is None



def test_the_small_kind_is_learned_beside_a_known_lone_decode():
    """The lone decode's kind is known, the small kind (2 to split_rows rows) is not: the chunks
    that enter it to measure it vary in size, so its fit gets the spread in rows it needs within
    a few steps, and the bound then holds. Entered with the whole room every time (every step 24
    rows), it stayed unknown for as long as no other row count came by, and on an AVX-512 host
    without AMX each of those steps took 55 ms beside a 5.6 ms lone decode."""
    cost = StepCost(slowdown=1.75, split_rows=24, single_row=True)
    for _ in range(4):
        cost.observe(1, 0.0056, 400)                     # lone decodes: their kind is known
    assert cost.fit(1) is not None and cost.fit(2) is None

    def step(rows: int) -> float:                        # that host's small kind: 2 ms a row
        return 0.0017 + 0.002 * rows

    sizes, known = [], None
    for i in range(12):
        k = cost.prefill_budget(1, 500, decode_pairs=400, context=0)
        sizes.append(k)
        if cost.fit(2) is not None:
            known = i if known is None else known
            assert step(1 + k) <= 1.75 * 0.0056 + 1e-9      # the bound holds once the kind is known
        cost.observe(1 + k, step(1 + k), 400 + k * (k + 1) // 2)
    # first the GEMM kind (past 24 rows) is entered to measure it, then the small kind, in chunks
    # of the whole room and half of it
    assert sizes[:4] == [87, 55, 87, 55] and sizes[4:8] == [23, 12, 23, 12]
    assert known == 8 and sizes[8:] == [3] * 4


def test_a_known_kind_stays_known_when_its_rows_stop_varying():
    """One decode beside a long prefill at a 2-token chunk: every step has 3 rows, and the old
    spread in rows fades (decay 0.95 a step) below the fit's threshold after about 430 steps. The
    kind then keeps its last slopes and follows the steps' level; it used to fall back to its
    warm-up and fill the small kind to its last row again (24 rows, 10x the lone decode's time on
    an AVX-512 host without AMX)."""
    cost = StepCost(slowdown=1.75, split_rows=24, single_row=True)
    for _ in range(4):
        cost.observe(1, 0.0056, 400)
    for rows in (2, 3, 5, 8, 13, 21) * 2:
        cost.observe(rows, 0.0017 + 0.002 * rows, 400)
    for rows in (40, 88, 200) * 2:                         # the GEMM kind, past 24 rows
        cost.observe(rows, 0.020 + 0.001 * rows, 400)
    a, b, c = cost.fit(3)
    assert b == pytest.approx(0.002) and a == pytest.approx(0.0017)
    for _ in range(1000):                                  # the machine got slower: 1 ms more a step
        cost.observe(3, 0.0027 + 0.002 * 3, 400)
        assert cost.prefill_budget(1, 500, decode_pairs=400, context=0) <= 3
    a, b, c = cost.fit(3)
    assert b == pytest.approx(0.002, rel=0.1)                 # the slope as last measured
    assert cost.predict(3, 400) == pytest.approx(0.0087, rel=1e-3)   # the level of the recent steps



def _lone_learned(**kw) -> StepCost:
    """A learned model of int4 steps on an AVX-512 host without AMX: a lone decode 6 ms at 400
    tokens of context, 2 ms a row beside it, a GEMM kind past 24 rows."""
    cost = StepCost(slowdown=1.75, split_rows=24, single_row=True, **kw)
    for ctx in (200, 400, 600, 800) * 2:
        cost.observe(1, 0.0056 + 1e-6 * ctx, ctx)
    for i, rows in enumerate((2, 3, 5, 8, 13, 21) * 2):
        cost.observe(rows, 0.0017 + 0.002 * rows, 300 + 53 * i)
    for rows in (40, 88, 200) * 2:
        cost.observe(rows, 0.020 + 0.001 * rows, 400)
    return cost


def _four_decoders(cost: StepCost, max_batch_tokens: int = 512) -> tuple[Scheduler, list[Request]]:
    """A scheduler with 4 streamed 40-token prompts added (one step prefills them all)."""
    sched = Scheduler(KVManager(PagePool(256), 16), max_batch_tokens=max_batch_tokens, max_running_requests=8,
                      step_cost=cost)
    decoders = [Request(f"d{i}", list(range(100 * i, 100 * i + 40)), SamplingParams(max_tokens=8))
                for i in range(4)]
    for r in decoders:
        sched.add_request(r)
    return sched, decoders


def test_the_lone_cap_holds_several_decodes_to_a_multiple_of_one():
    """``lone_slowdown``: a step with several decodes also keeps within that many times a lone
    decode step at their mean context (one stream's TPOT alone), so a stream beside others waits
    at most that much longer per token than alone. One decode, and steps whose bound is already
    tighter, are unchanged; where the decodes alone come near the cap, the first chunk gets
    ``min_tokens`` (prefill never stops while decodes run)."""
    plain, capped = _lone_learned(), _lone_learned(lone_slowdown=2.0)
    step = lambda rows: 0.0017 + 0.002 * rows                       # noqa: E731
    # one decode: the lone cap is not consulted (its target is 1.75x that same step)
    assert capped.prefill_budget(1, 500, decode_pairs=400) == plain.prefill_budget(1, 500, decode_pairs=400)
    # two decodes: 1.75 x 5.7 ms is below 2 x 6.0 ms, the plain bound holds
    assert capped.prefill_budget(2, 500, decode_pairs=800) == plain.prefill_budget(2, 500, decode_pairs=800) == 2
    # four decodes (9.7 ms alone): plain lets the step reach 1.75x of that, 17 ms; the cap 12 ms
    k_plain = plain.prefill_budget(4, 500, decode_pairs=1600)
    k_capped = capped.prefill_budget(4, 500, decode_pairs=1600)
    assert k_plain == 3 and step(4 + k_plain) > 2.0 * 0.006
    assert k_capped == 1 and step(4 + k_capped) <= 2.0 * 0.006 < step(5 + k_capped)
    # six decodes alone (13.7 ms) are past the cap: the first chunk's floor, no more
    assert capped.prefill_budget(6, 500, decode_pairs=2400) == capped.min_tokens == 1
    b = capped.bound(6, 2400)
    b.add(0, b.cap(0, 500))
    assert b.cap(0, 500) == 0


@pytest.mark.parametrize("prompt,expect", [(64, 3), (600, 1)])
def test_the_lone_cap_holds_long_prefills_only(prompt, expect):
    """Beside 4 streamed decodes (9.7 ms alone, a lone one 5.6 ms), the plain bound lets a step
    reach 17 ms (3 prefill tokens), the lone cap at 2x 11.3 ms (none: the floor's 1 token). A
    prefill of at most ``lone_min_prefill`` uncached tokens (an agent turn after a hit) keeps the
    plain bound; a long prompt's chunks keep the cap."""
    sched, decoders = _four_decoders(_lone_learned(lone_slowdown=2.0))
    assert _step(sched) == {r.request_id: 40 for r in decoders}
    sched.add_request(Request("p", list(range(1000, 1000 + prompt)), SamplingParams(max_tokens=4)))
    got = _step(sched)
    assert all(got[r.request_id] == 1 for r in decoders) and got["p"] == expect
    got = _step(sched)                                   # its next chunk: the same bound
    assert got["p"] == expect

@pytest.mark.parametrize("stagger", [0, 32])
def test_a_step_without_decodes_completes_one_streamed_prompt(stagger):
    """With the bound on and no streamed decode running, a second streamed prompt that would
    complete in the same step stops ``prefill_stagger_tokens`` short, and finishes beside the first
    one's decodes under the bound; one with no more than that left completes (the bound's finishing
    exception would finish it a step later anyway). Responses sent whole are not held back (their
    decodes are not paced)."""
    cost = StepCost(slowdown=2.0, min_tokens=8)
    for n in (1, 10, 100, 400):
        cost.observe(n, 0.05 + 0.005 * n)             # 1 decode: 11 tokens of prefill beside it
    sched = Scheduler(KVManager(PagePool(256), 16), max_batch_tokens=512, max_running_requests=8,
                      step_cost=cost)
    sched.prefill_stagger_tokens = stagger
    reqs = [Request("a", list(range(100)), SamplingParams(max_tokens=4)),
            Request("b", list(range(1000, 1100)), SamplingParams(max_tokens=4)),
            Request("c", list(range(2000, 2020)), SamplingParams(max_tokens=4)),
            Request("d", list(range(3000, 3100)), SamplingParams(max_tokens=4)),
            Request("w", list(range(4000, 4100)), SamplingParams(max_tokens=4), streamed=False)]
    for r in reqs:
        sched.add_request(r)
    got = _step(sched)
    if not stagger:
        assert got == {"a": 100, "b": 100, "c": 20, "d": 100, "w": 100}
        return
    # a completes; b and d stop 32 short; c (20 tokens) and w (sent whole) complete
    assert got == {"a": 100, "b": 68, "c": 20, "d": 68, "w": 100}
    got = _step(sched)                                  # a, c and w decode: b and d go on under the bound
    assert got["a"] == got["c"] == got["w"] == 1
    k = sum(got.get(r, 0) for r in "bd")
    assert 0 < k < 32 and cost.predict(3 + k) <= 2.0 * cost.predict(3) + 1e-12 < cost.predict(4 + k)


def test_a_long_prompt_waits_for_the_decodes_instead_of_a_token_a_step():
    """``StepCost.hold_below``: beside 4 streamed decodes the plain bound gives a prompt 3 tokens a
    step; a long prompt (running, or waiting for admission) waits instead, at most ``hold_steps``
    steps in all, then takes the bound's chunks; once the decodes end it takes whole chunks."""
    cost = _lone_learned(hold_below=8, hold_steps=3)
    sched, decoders = _four_decoders(cost, max_batch_tokens=200)
    p = Request("p", list(range(1000, 1600)), SamplingParams(max_tokens=4))
    sched.add_request(p)
    assert _step(sched) == {**{r.request_id: 40 for r in decoders}, "p": 40}
    q = Request("q", list(range(5000, 5600)), SamplingParams(max_tokens=4))
    sched.add_request(q)
    for _ in range(3):                                   # both wait: the decodes run alone
        assert _step(sched) == {r.request_id: 1 for r in decoders}
        assert q.status is RequestStatus.WAITING and p.num_computed_tokens == 40
    assert sched._holds == {p: 3, q: 3}
    assert _step(sched) == {**{r.request_id: 1 for r in decoders}, "p": 3}   # holds spent
    for r in decoders:
        sched.finish(r, "length")
    assert _step(sched) == {"p": 200}                    # no decodes: no bound, no hold
    sched.finish(p, "abort")
    sched.finish(q, "abort")
    assert sched._holds == {}


@pytest.mark.parametrize("prompt,hold_below,expect", [(64, 8, 3), (600, 8, 0), (600, 0, 3), (600, 3, 3)])
def test_only_long_prompts_wait_and_only_for_chunks_below_the_mark(prompt, hold_below, expect):
    """An agent turn after a hit (at most ``lone_min_prefill`` uncached tokens) is never held; nor
    is a prompt whose bounded chunk reaches ``hold_below``; 0 turns holding off."""
    sched, decoders = _four_decoders(_lone_learned(hold_below=hold_below))
    _step(sched)
    sched.add_request(Request("p", list(range(1000, 1000 + prompt)), SamplingParams(max_tokens=4)))
    got = _step(sched)
    assert all(got[r.request_id] == 1 for r in decoders) and got.get("p", 0) == expect


def test_a_short_prompt_is_not_queued_behind_a_held_long_one():
    """A waiting long prompt that the hold keeps out of the step does not block a short one
    behind it in the queue (an agent turn, never held): that one is admitted with the plain
    bound's chunk, as it would be alone."""
    sched, decoders = _four_decoders(_lone_learned(hold_below=8))
    _step(sched)
    long = Request("long", list(range(1000, 1600)), SamplingParams(max_tokens=4))
    short = Request("short", list(range(3000, 3064)), SamplingParams(max_tokens=4))
    sched.add_request(long)
    sched.add_request(short)
    got = _step(sched)
    assert all(got[r.request_id] == 1 for r in decoders)
    assert "long" not in got and got["short"] == 3 and long.status is RequestStatus.WAITING
