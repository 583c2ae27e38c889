"""engine/admission.py over a real scheduler and page pool (no model): the queue bound, queue-wait
limits and deadlines, and that every expiry hands its pages back."""
from __future__ import annotations

import pytest

from tokenmill.cache.page_pool import PagePool
from tokenmill.cache.radix import RadixCache
from tokenmill.contracts.sampling import SamplingParams
from tokenmill.engine import admission
from tokenmill.engine.kv_manager import KVManager
from tokenmill.engine.request import Request, RequestStatus
from tokenmill.engine.scheduler import Scheduler

PAGE = 4


def make(max_running: int = 1) -> Scheduler:
    pool = PagePool(64)
    return Scheduler(KVManager(pool, PAGE, RadixCache(pool, PAGE)), max_batch_tokens=64,
                     max_running_requests=max_running)


def req(rid: str, *, deadline: float | None = None, queue_deadline: float | None = None) -> Request:
    return Request(rid, list(range(1, 10)), SamplingParams(max_tokens=8, temperature=0.0),
                   deadline=deadline, queue_deadline=queue_deadline)


def test_queue_bound() -> None:
    s = make()
    admission.check_queue(s, None)
    for i in range(3):
        admission.check_queue(s, 3)
        s.add_request(req(f"r{i}"))
    with pytest.raises(admission.QueueFullError) as e:
        admission.check_queue(s, 3)
    assert e.value.num_waiting == 3 and "overloaded" in str(e.value)
    s.schedule()                      # one is admitted: room again
    admission.check_queue(s, 3)


def test_deadline_finishes_running_and_waiting_and_frees_pages() -> None:
    s = make()
    running, waiting = req("run", deadline=10.0), req("wait", deadline=20.0)
    s.add_request(running)
    s.add_request(waiting)
    out = s.schedule()
    s.post_step(out)
    assert running.status is RequestStatus.RUNNING and running.page_table
    assert admission.expire(s, 9.9) == []
    assert admission.expire(s, 10.0) == [running]
    assert running.finish_reason == admission.DEADLINE and not running.page_table
    assert admission.expire(s, 25.0) == [waiting] and waiting.finish_reason == admission.DEADLINE
    assert not s.has_unfinished()
    s.check_pages()
    assert s.kv.pool.num_free() + s.kv.cache.num_cached_pages == s.kv.pool.num_pages


def test_queue_deadline_applies_only_before_the_first_admission() -> None:
    s = make()
    first, second = req("a", queue_deadline=5.0), req("b", queue_deadline=5.0)
    s.add_request(first)
    s.add_request(second)
    s.post_step(s.schedule())         # "a" started, "b" still waits
    assert admission.expire(s, 6.0) == [second]
    assert second.finish_reason == admission.QUEUE_TIMEOUT and first.status is RequestStatus.RUNNING
    s.preempt(first)                  # back in the queue, but it had started: exempt
    assert first.status is RequestStatus.WAITING and admission.expire(s, 7.0) == []
    s.check_pages()


def test_start_estimator_predicts_from_recent_finishes() -> None:
    s = make(max_running=1)
    est = admission.StartEstimator(window=8, horizon_s=60.0, min_samples=4)
    assert est.predicted_wait(s, 0.0) == 0.0               # a free slot: starts next step
    admission.check_predicted_wait(s, est, 5.0, queue_deadline=4.5)   # deadline passed: expire() says so, not this
    s.add_request(req("run"))
    s.post_step(s.schedule())                              # the one slot is busy
    assert est.predicted_wait(s, 0.0) == 0.0               # no history: no prediction, admit
    for t in (10.0, 11.0, 12.0, 13.0):                     # one finish a second
        est.finished(t)
    assert est.finish_rate(13.0) == pytest.approx(1.0)
    assert est.predicted_wait(s, 13.0) == pytest.approx(3.0)          # k = 1: (1 + 2) / 1
    s.add_request(req("w1"))
    s.add_request(req("w2"))
    upper = 3.0 + 2.0 * 3.0 ** 0.5                                    # k = 3
    assert est.predicted_wait(s, 13.0) == pytest.approx(upper)
    admission.check_predicted_wait(s, est, 13.0, queue_deadline=13.0 + upper + 0.1)
    admission.check_predicted_wait(s, est, 13.0, queue_deadline=None)
    with pytest.raises(admission.WaitTooLongError) as e:
        admission.check_predicted_wait(s, est, 13.0, queue_deadline=13.0 + upper - 0.1)
    assert isinstance(e.value, admission.QueueFullError) and e.value.reason == "predicted_wait"
    assert e.value.retry_after_s == pytest.approx(upper) and "up to 6.5 s" in str(e.value)
    assert est.finish_rate(13.0 + 61.0) is None            # history past the horizon is forgotten
    assert est.predicted_wait(s, 13.0 + 61.0) == 0.0
