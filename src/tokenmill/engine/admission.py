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

Both times are absolute ``time.monotonic()`` seconds. Finishing goes through
``Scheduler.finish``, which hands the request's pages back.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tokenmill.engine.request import Request
    from tokenmill.engine.scheduler import Scheduler

QUEUE_TIMEOUT = "queue_timeout"
DEADLINE = "deadline"


class QueueFullError(RuntimeError):
    """The waiting queue is at its limit; the request was not queued."""

    def __init__(self, num_waiting: int, limit: int) -> None:
        super().__init__(f"the server is overloaded: {num_waiting} requests are already waiting "
                         f"(limit {limit}); retry later")
        self.num_waiting = num_waiting
        self.limit = limit


def check_queue(scheduler: Scheduler, limit: int | None) -> None:
    if limit is not None and len(scheduler.waiting) >= limit:
        raise QueueFullError(len(scheduler.waiting), limit)


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
