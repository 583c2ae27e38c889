"""Scheduler and KV-manager behaviour over token counts and page ids, with no model."""
from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from tokenmill.cache.page_pool import PagePool
from tokenmill.cache.radix import RadixCache
from tokenmill.engine.kv_manager import KVManager
from tokenmill.engine.request import Request, RequestStatus
from tokenmill.contracts.sampling import SamplingParams
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


# -- with the radix prefix cache -----------------------------------------------------------------
def make_cached(num_pages: int, budget: int = 64, max_running: int = 16) -> Scheduler:
    pool = PagePool(num_pages)
    kv = KVManager(pool, PAGE, RadixCache(pool, PAGE))
    return Scheduler(kv, max_batch_tokens=budget, max_running_requests=max_running)


def cached_step(s: Scheduler) -> SchedulerOutput:
    out = s.schedule()
    s.post_step(out)
    for sr in out.scheduled:
        r = sr.request
        if sr.samples:
            r.all_token_ids.append(7)
            if r.num_output_tokens >= r.params.max_tokens:
                s.finish(r, "length")
    s.check_pages()
    return out


def test_finished_request_is_matched_by_the_next_one_and_its_pages_are_locked() -> None:
    s = make_cached(16)
    a = req("a", 10, max_tokens=3)  # 10 + 3 tokens, 12 computed -> 3 whole pages cached
    s.add_request(a)
    while s.has_unfinished():
        cached_step(s)
    assert s.kv.cache.num_cached_pages == 3 and s.kv.pool.num_free() == 13
    b = Request("b", a.all_token_ids[:12] + [99, 98], SamplingParams(max_tokens=2))
    s.add_request(b)
    out = cached_step(s)
    assert b.num_cached_tokens == 12 and out.scheduled[0].start == 12 and out.scheduled[0].num_tokens == 2
    assert s.kv.cache.num_locked_pages == 3 and b.page_table[:3] == [0, 1, 2]
    while s.has_unfinished():
        cached_step(s)
    assert s.prompt_tokens_total == 24 and s.cached_tokens_total == 12


def test_eviction_comes_before_preemption() -> None:
    s = make_cached(6, budget=64)
    old = req("old", 16, max_tokens=1)  # leaves 4 pages in the cache
    s.add_request(old)
    while s.has_unfinished():
        cached_step(s)
    assert s.kv.cache.num_cached_pages == 4 and s.kv.pool.num_free() == 2
    new = [Request(f"n{i}", [50 + i] * 9, SamplingParams(max_tokens=3)) for i in range(2)]
    for r in new:
        s.add_request(r)
    while s.has_unfinished():
        cached_step(s)
    assert s.num_preemptions == 0 and all(r.output_token_ids == [7, 7, 7] for r in new)


def test_chunked_prefill_shares_pages_with_a_concurrent_identical_prompt() -> None:
    s = make_cached(32, budget=8)
    prompt = list(range(1, 25))
    a = Request("a", prompt, SamplingParams(max_tokens=2))
    s.add_request(a)
    cached_step(s)
    cached_step(s)  # 16 tokens of a computed: 4 pages published to the cache
    assert s.kv.cache.num_cached_pages == 4 and a.num_tree_pages == 4
    b = Request("b", list(prompt), SamplingParams(max_tokens=2))
    s.add_request(b)
    while s.has_unfinished():
        cached_step(s)
    # b waits for the rest of a's prefill (they share the prompt), then reuses all of it but
    # the last token: 23 tokens -> 5 whole pages
    assert b.num_cached_tokens == 20
    assert a.output_token_ids == b.output_token_ids == [7, 7]


@settings(max_examples=40, deadline=None)
@given(num_pages=st.integers(4, 24), budget=st.integers(1, 40), max_running=st.integers(1, 6),
       use_cache=st.booleans(),
       specs=st.lists(st.tuples(st.integers(0, 2), st.integers(1, 30), st.integers(1, 6)),
                      min_size=1, max_size=8))
def test_random_workloads_finish_and_keep_page_accounting(num_pages: int, budget: int, max_running: int,
                                                          use_cache: bool, specs: list) -> None:
    """Requests share prefixes (three families); pools are small; every request must finish."""
    pool = PagePool(num_pages)
    kv = KVManager(pool, PAGE, RadixCache(pool, PAGE) if use_cache else None)
    s = Scheduler(kv, max_batch_tokens=budget, max_running_requests=max_running)
    reqs = []
    for i, (family, plen, max_tokens) in enumerate(specs):
        if plen + max_tokens > num_pages * PAGE:
            continue  # the engine rejects these at add_request
        prompt = [1000 * (family + 1) + j for j in range(plen)]
        r = Request(f"r{i}", prompt, SamplingParams(max_tokens=max_tokens), session_id=f"s{family}")
        reqs.append(r)
        s.add_request(r)
    for _ in range(2000):
        if not s.has_unfinished():
            break
        out = cached_step(s)
        assert out.num_tokens <= budget and len(s.running) <= max_running
        assert out.scheduled, "a step with unfinished requests scheduled nothing"
    assert not s.has_unfinished()
    assert all(r.output_token_ids == [7] * r.params.max_tokens for r in reqs)
    cached = kv.cache.num_cached_pages if kv.cache is not None else 0
    assert pool.num_free() + cached == num_pages
