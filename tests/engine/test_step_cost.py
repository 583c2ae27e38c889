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
