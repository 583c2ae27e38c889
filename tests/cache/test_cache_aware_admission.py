"""Cache-aware admission in the scheduler (pure Python, no model): while the queue is short,
the waiting request with the longest cached prefix goes first, and nobody starves."""
from __future__ import annotations

from tokenmill.cache.page_pool import PagePool
from tokenmill.cache.radix import RadixCache
from tokenmill.engine.kv_manager import KVManager
from tokenmill.engine.request import Request
from tokenmill.contracts.sampling import SamplingParams
from tokenmill.engine.scheduler import Scheduler

PAGE = 4


def make(budget: int, prefer: bool = True) -> Scheduler:
    pool = PagePool(256)
    s = Scheduler(KVManager(pool, PAGE, RadixCache(pool, PAGE)), max_batch_tokens=budget,
                  max_running_requests=64)
    s.prefer_cached_prefix = prefer
    return s


def req(rid: str, tokens: list[int], max_tokens: int = 2) -> Request:
    return Request(rid, list(tokens), SamplingParams(max_tokens=max_tokens, temperature=0.0))


def step(s: Scheduler) -> list[str]:
    """One engine step without a model; returns the ids of requests admitted in this step."""
    before = {r.request_id for r in s.running}
    out = s.schedule()
    s.post_step(out)
    for sr in out.scheduled:
        r = sr.request
        if sr.samples:
            r.all_token_ids.append(7)
            if r.num_output_tokens >= r.params.max_tokens:
                s.finish(r, "length")
    s.check_pages()
    return [sr.request.request_id for sr in out.scheduled if sr.request.request_id not in before]


def drain(s: Scheduler) -> None:
    while s.has_unfinished():
        step(s)


HISTORY = list(range(100, 140))   # 10 pages


def test_cached_request_jumps_a_short_queue() -> None:
    for prefer, first in ((True, "cached"), (False, "cold")):
        s = make(budget=8, prefer=prefer)
        s.add_request(req("prime", HISTORY))
        drain(s)
        s.add_request(req("cold", list(range(500, 540))))
        s.add_request(req("cached", HISTORY + [1, 2, 3]))
        assert step(s)[0] == first
        drain(s)
        assert s.kv.cache.num_locked_pages == 0


def test_passed_over_request_is_admitted_after_max_skips() -> None:
    s = make(budget=3)   # each hit below needs exactly 3 tokens: it fills the step
    s.add_request(req("prime", HISTORY, max_tokens=1))
    drain(s)
    s.add_request(req("cold", list(range(500, 540)), max_tokens=1))
    admitted: list[str] = []
    for i in range(12):   # a steady stream of cache hits arrives, one per step
        s.add_request(req(f"hit{i}", HISTORY + [i, i, i], max_tokens=1))
        admitted += step(s)
        if "cold" in admitted:
            break
    assert "cold" in admitted
    assert admitted.index("cold") <= s.admission_max_skips
    drain(s)


def test_long_queue_is_fifo() -> None:
    s = make(budget=4)
    s.prefer_cached_max_queue = 2
    s.add_request(req("prime", HISTORY, max_tokens=1))
    drain(s)
    s.add_request(req("cold", list(range(500, 540))))
    s.add_request(req("cached1", HISTORY + [1]))
    s.add_request(req("cached2", HISTORY + [2]))
    assert step(s) == ["cold"]
