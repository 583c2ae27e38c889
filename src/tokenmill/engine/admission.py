"""Admission limits of one engine: a bounded waiting queue, queue-wait limits and deadlines.

Pure bookkeeping over the scheduler's queues (no torch, no I/O). The engine calls
:func:`check_queue` when a request is added and :func:`expire` at the start of every step:

* ``max_waiting_requests``: a request that would make the waiting queue longer is refused with
  :class:`QueueFullError` (the server answers 429).
* ``queue_deadline``: a request still waiting for its *first* admission at that time finishes with
  reason ``queue_timeout`` and no output (the server answers 503). A request put back in the queue
  by preemption has been admitted once and is exempt.
* ``deadline``: a request not finished at that time finishes with reason ``deadline`` wherever it
  is (waiting or running), keeping the tokens it produced.
* Predicted wait (:class:`StartEstimator`): a request with a ``queue_deadline`` that, by the rate
  at which running requests have been finishing, would not start before that deadline is refused
  at once with :class:`WaitTooLongError` (a 429 whose Retry-After is the predicted wait) rather than
  queued to time out later. Requests that are admitted therefore wait at most about the limit,
  whatever the offered load, and the queue bound stops being the only thing between overload and
  admitted requests' latency.

Both times are absolute ``time.monotonic()`` seconds. Finishing goes through
``Scheduler.finish``, which hands the request's pages back.
"""
from __future__ import annotations

import math
from collections import deque
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tokenmill.engine.request import Request
    from tokenmill.engine.scheduler import Scheduler

QUEUE_TIMEOUT = "queue_timeout"
DEADLINE = "deadline"


class QueueFullError(RuntimeError):
    """The waiting queue is at its limit; the request was not queued."""

    reason = "queue_full"

    def __init__(self, num_waiting: int, limit: int) -> None:
        super().__init__(f"the server is overloaded: {num_waiting} requests are already waiting "
                         f"(limit {limit}); retry later")
        self.num_waiting = num_waiting
        self.limit = limit
        self.retry_after_s: float | None = None


class WaitTooLongError(QueueFullError):
    """The request would wait longer than its queue-wait limit to start; it was not queued."""

    reason = "predicted_wait"

    def __init__(self, predicted_s: float, limit_s: float, num_waiting: int) -> None:
        RuntimeError.__init__(self, f"the server is overloaded: a new request could wait up to {predicted_s:.1f} s "
                                    f"to start (limit {limit_s:g} s, {num_waiting} waiting); retry later")
        self.num_waiting = num_waiting
        self.limit = num_waiting
        self.predicted_s = predicted_s
        self.retry_after_s = predicted_s


def check_queue(scheduler: Scheduler, limit: int | None) -> None:
    if limit is not None and len(scheduler.waiting) >= limit:
        raise QueueFullError(len(scheduler.waiting), limit)


class StartEstimator:
    """How long a request queued now may wait for its first step, from recent finishes.

    A queued request starts when a running slot frees up, and slots free up as running requests
    finish. With ``f`` slots free and ``w`` requests already waiting, a new request needs
    ``k = w + 1 - f`` more finishes. At the recent finish rate ``r`` (the last ``window``
    finishes within ``horizon_s``) they take ``k / r`` seconds on average; treating finishes as a
    Poisson stream, ``(k + 2 sqrt(k)) / r`` is exceeded only rarely (about 2-3%), and that upper
    figure is what :meth:`predicted_wait` returns: a request is refused when even a typical bad
    case would pass its queue deadline, rather than admitted to time out later with a 503.
    With too little history (fewer than ``min_samples`` recent finishes) no prediction is made
    (0: admit).
    """

    def __init__(self, window: int = 32, horizon_s: float = 120.0, min_samples: int = 4) -> None:
        if window < 2 or min_samples < 2 or horizon_s <= 0:
            raise ValueError("StartEstimator needs window >= 2, min_samples >= 2 and horizon_s > 0")
        self.times: deque[float] = deque(maxlen=window)
        self.horizon_s = horizon_s
        self.min_samples = min_samples

    def finished(self, now: float) -> None:
        """A running request finished at ``now`` (monotonic seconds)."""
        self.times.append(now)

    def finish_rate(self, now: float) -> float | None:
        while self.times and now - self.times[0] > self.horizon_s:
            self.times.popleft()
        n = len(self.times)
        if n < self.min_samples:
            return None
        span = max(now, self.times[-1]) - self.times[0]
        return (n - 1) / span if span > 0 else None

    def predicted_wait(self, scheduler: Scheduler, now: float) -> float:
        """The wait (seconds) a request queued now stays under in all but about 2-3% of cases."""
        free = scheduler.max_running_requests - len(scheduler.running)
        ahead = len(scheduler.waiting) + 1 - free
        if ahead <= 0:
            return 0.0
        rate = self.finish_rate(now)
        return 0.0 if rate is None else (ahead + 2.0 * math.sqrt(ahead)) / rate


def wait_too_long(predicted_s: float, limit_s: float | None) -> bool:
    return limit_s is not None and predicted_s > limit_s


def check_predicted_wait(scheduler: Scheduler, estimator: StartEstimator, now: float,
                         queue_deadline: float | None) -> None:
    """Refuse (:class:`WaitTooLongError`) a request that may not start by ``queue_deadline``.
    A predicted wait of 0 (a slot is free, or too little history) is never refused here: a
    request that reached the engine after its queue deadline (a slow host between arrival and
    the engine thread) is timed out by :func:`expire` with the reason that is true, queue_timeout,
    rather than refused for a wait of 0 s."""
    if queue_deadline is None:
        return
    wait = estimator.predicted_wait(scheduler, now)
    limit = queue_deadline - now
    if wait > 0.0 and wait_too_long(wait, limit):
        raise WaitTooLongError(wait, max(limit, 0.0), len(scheduler.waiting))


def expire(scheduler: Scheduler, now: float) -> list[Request]:
    """Finish every request whose queue wait or deadline has passed; return them."""
    due: list[tuple[Request, str]] = []
    for req in scheduler.requests.values():
        if req.deadline is not None and now >= req.deadline:
            due.append((req, DEADLINE))
        elif (req.queue_deadline is not None and now >= req.queue_deadline
              and req.num_cached_tokens is None and req.status.value == "waiting"):
            due.append((req, QUEUE_TIMEOUT))
    for req, reason in due:
        scheduler.finish(req, reason)
    return [req for req, _ in due]
