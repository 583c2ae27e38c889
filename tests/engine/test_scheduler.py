"""Scheduler and KV-manager behaviour over token counts and page ids, with no model."""
from __future__ import annotations

from tokenmill.cache.page_pool import PagePool
from tokenmill.engine.kv_manager import KVManager
from tokenmill.engine.request import Request, RequestStatus
from tokenmill.engine.sampling_params import SamplingParams
from tokenmill.engine.scheduler import Scheduler, SchedulerOutput

PAGE = 4


def make(num_pages: int, budget: int = 64, max_running: int = 16) -> Scheduler:
    return Scheduler(KVManager(PagePool(num_pages), PAGE), max_batch_tokens=budget,
                     max_running_requests=max_running)


def req(rid: str, prompt_len: int, max_tokens: int = 4) -> Request:
    return Request(rid, list(range(1, prompt_len + 1)), SamplingParams(max_tokens=max_tokens, temperature=0.0))


def held_pages(s: Scheduler) -> int:
    return sum(len(r.page_table) for r in s.running)


def step(s: Scheduler) -> SchedulerOutput:
    """One engine step without a model: every sampling request gets token 7."""
    out = s.schedule()
    s.post_step(out)
    for sr in out.scheduled:
        r = sr.request
        # pages cover exactly the tokens computed so far
        assert len(r.page_table) == -(-r.num_computed_tokens // PAGE)
        if sr.samples:
            r.all_token_ids.append(7)
            if r.num_output_tokens >= r.params.max_tokens:
                s.finish(r, "length")
    assert s.kv.pool.num_free() + held_pages(s) == s.kv.pool.num_pages
    return out


def test_decodes_first_then_prefill_chunk_within_budget() -> None:
    s = make(64, budget=10)
    for i in range(3):
        s.add_request(req(f"d{i}", 2, max_tokens=8))
    out = step(s)  # three short prompts prefilled together
    assert [x.num_tokens for x in out.scheduled] == [2, 2, 2]
    s.add_request(req("long", 30))
    out = step(s)
    assert [(x.request.request_id, x.num_tokens) for x in out.scheduled] == [
        ("d0", 1), ("d1", 1), ("d2", 1), ("long", 7)]
    assert out.num_tokens == 10
    assert not out.scheduled[-1].samples and all(x.samples for x in out.scheduled[:3])


def test_long_prompt_is_chunked_and_samples_once_at_the_end() -> None:
    s = make(64, budget=16)
    r = req("a", 50, max_tokens=2)
    s.add_request(r)
    chunks = []
    while s.has_unfinished():
        out = step(s)
        chunks.append([(x.start, x.num_tokens, x.samples) for x in out.scheduled])
    assert chunks == [[(0, 16, False)], [(16, 16, False)], [(32, 16, False)], [(48, 2, True)], [(50, 1, True)]]
    assert r.status is RequestStatus.FINISHED and r.output_token_ids == [7, 7]
    assert s.kv.pool.num_free() == 64


def test_max_running_requests_limits_the_batch_and_new_requests_join_between_steps() -> None:
    s = make(64, budget=64, max_running=2)
    for i in range(4):
        s.add_request(req(f"r{i}", 3, max_tokens=2))
    out = step(s)
    assert [x.request.request_id for x in out.scheduled] == ["r0", "r1"]
    assert len(s.waiting) == 2
    out = step(s)  # r0 and r1 finish in this step (second token) and leave at once
    assert [x.request.request_id for x in out.scheduled] == ["r0", "r1"]
    assert not s.running
    out = step(s)
    assert [x.request.request_id for x in out.scheduled] == ["r2", "r3"]


def test_preemption_takes_the_latest_admitted_and_requeues_it_first() -> None:
    # 6 pages of 4 tokens; three requests of 7-token prompts need 2 pages each to start.
    s = make(6, budget=64)
    rs = [req(f"r{i}", 7, max_tokens=6) for i in range(3)]
    for r in rs:
        s.add_request(r)
    step(s)
    assert [r.request_id for r in s.running] == ["r0", "r1", "r2"] and s.kv.pool.num_free() == 0
    step(s)  # the 8th token still fits the two pages
    out = step(s)  # the 9th needs a third page each: r2 (last admitted) is preempted for r0 and r1
    assert [r.request_id for r in out.preempted] == ["r2"]
    assert [r.request_id for r in s.waiting] == ["r2"]
    assert rs[2].num_computed_tokens == 0 and rs[2].page_table == [] and rs[2].num_preemptions == 1
    assert s.num_preemptions == 1
    while s.has_unfinished():
        step(s)
    assert all(r.output_token_ids == [7] * 6 for r in rs)
    assert s.kv.pool.num_free() == 6


def test_a_lone_request_never_preempts_itself_when_it_fits_the_pool() -> None:
    s = make(3, budget=5)
    r = req("a", 9, max_tokens=3)  # 9 + 3 = 12 tokens = 3 pages exactly
    s.add_request(r)
    while s.has_unfinished():
        step(s)
    assert r.output_token_ids == [7, 7, 7] and s.num_preemptions == 0


def test_abort_frees_pages_of_running_and_waiting_requests() -> None:
    s = make(8, budget=64, max_running=1)
    a, b = req("a", 9), req("b", 3)
    s.add_request(a)
    s.add_request(b)
    step(s)
    assert s.kv.pool.num_free() == 8 - 3
    assert s.abort("a") is a and a.finish_reason == "abort" and a.page_table == []
    assert s.kv.pool.num_free() == 8
    assert s.abort("b") is b and not s.has_unfinished()
    assert s.abort("b") is None  # unknown or finished ids are ignored


def test_waiting_request_is_not_admitted_without_pages_and_keeps_its_place() -> None:
    s = make(4, budget=64)
    a, b = req("a", 12, max_tokens=4), req("b", 8)
    s.add_request(a)
    s.add_request(b)
    out = step(s)
    assert [x.request.request_id for x in out.scheduled] == ["a"]  # b needs 2 pages, 1 is free
    assert list(s.waiting) == [b] and b.page_table == []
    while s.has_unfinished():
        step(s)
    assert b.output_token_ids == [7] * 4
