"""The online step-time model and the prefill budget it gives the scheduler."""
from __future__ import annotations

import pytest

from tokenmill.cache.page_pool import PagePool
from tokenmill.contracts.sampling import SamplingParams
from tokenmill.engine.kv_manager import KVManager
from tokenmill.engine.request import Request
from tokenmill.engine.scheduler import Scheduler
from tokenmill.engine.step_cost import StepCost


def test_fit_recovers_a_line_and_budget_keeps_the_slowdown():
    cost = StepCost(slowdown=2.0)
    assert cost.fit() is None and cost.prefill_budget(4, 500) == cost.warmup_tokens
    for n in (1, 4, 16, 64, 200, 8, 32):
        cost.observe(n, 0.050 + 0.002 * n)
    a, b = cost.fit()
    assert a == pytest.approx(0.050, rel=1e-6) and b == pytest.approx(0.002, rel=1e-6)
    d = 4
    p = cost.prefill_budget(d, 10_000)
    assert cost.predict(d + p) <= 2.0 * cost.predict(d) + 1e-12
    assert cost.predict(d + p + 1) > 2.0 * cost.predict(d)
    assert cost.prefill_budget(d, 10) == 10           # never above what the step has left
    cost2 = StepCost(slowdown=2.0)
    for n in (1, 2, 3, 4):
        cost2.observe(n, 1.0)                         # flat: extra tokens are free
    assert cost2.prefill_budget(1, 300) == 300


def test_old_observations_fade():
    cost = StepCost(slowdown=2.0, decay=0.8)
    for n in (1, 50, 100):
        cost.observe(n, 1.0 + 0.1 * n)
    for _ in range(40):
        for n in (1, 50, 100):
            cost.observe(n, 0.01 + 0.001 * n)
    a, b = cost.fit()
    assert a == pytest.approx(0.01, rel=1e-3) and b == pytest.approx(0.001, rel=1e-3)


@pytest.mark.parametrize("bad", [dict(slowdown=1.0), dict(min_tokens=0), dict(decay=1.0)])
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
