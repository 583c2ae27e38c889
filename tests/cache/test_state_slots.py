"""State-slot allocation of hybrid models, on the torch-free core: the allocator, admission needing
a slot and pages, every way out freeing both, and the accounting check."""
from __future__ import annotations

import pytest

from tokenmill.cache.page_pool import PagePool
from tokenmill.cache.radix import RadixCache
from tokenmill.cache.state_slots import StateSlotPool
from tokenmill.contracts.sampling import SamplingParams
from tokenmill.engine.kv_manager import KVManager
from tokenmill.engine.request import Request
from tokenmill.engine.scheduler import Scheduler

P = 4


def test_request_and_snapshot_slots_are_apart_and_checked() -> None:
    pool = StateSlotPool(3, 2)
    assert pool.num_slots == 5 and pool.num_free() == 3 and pool.num_free_snapshots() == 2
    got = [pool.alloc() for _ in range(3)]
    assert got == [0, 1, 2] and pool.alloc() is None and pool.num_used() == 3
    assert [pool.alloc_snapshot(), pool.alloc_snapshot(), pool.alloc_snapshot()] == [3, 4, None]
    pool.free(1)
    with pytest.raises(ValueError, match="freed twice"):
        pool.free(1)
    with pytest.raises(ValueError, match="outside"):
        pool.free(3)            # a snapshot slot is not a request slot
    with pytest.raises(ValueError, match="outside"):
        pool.free_snapshot(0)
    pool.free_snapshot(4)
    assert pool.alloc() == 1 and pool.alloc_snapshot() == 4
    with pytest.raises(ValueError):
        StateSlotPool(0)


def _setup(num_pages: int, slots: int, running: int, cache: bool = True, snapshots: int = 2):
    pages = PagePool(num_pages)
    state = StateSlotPool(slots, snapshots)
    kv = KVManager(pages, P, RadixCache(pages, P, snapshot_slots=state) if cache else None, slots=state)
    return kv, Scheduler(kv, max_batch_tokens=64, max_running_requests=running)


def _req(rid: str, n: int, max_tokens: int = 4) -> Request:
    return Request(rid, list(range(10, 10 + n)), SamplingParams(max_tokens=max_tokens, temperature=0.0))


def _run(sched: Scheduler, steps: int, finish_after: int | None = None) -> None:
    """Steps without a model: every step's sampling requests get token 7; a request finishes once
    it has ``finish_after`` output tokens."""
    for _ in range(steps):
        out = sched.schedule()
        sched.post_step(out)
        for s in out.scheduled:
            if s.samples:
                s.request.append_token(7)
                if finish_after is not None and s.request.num_output_tokens >= finish_after:
                    sched.finish(s.request, "length")
        sched.check_pages()


def test_admission_needs_a_free_slot_even_when_pages_and_running_limit_allow() -> None:
    kv, sched = _setup(num_pages=64, slots=2, running=8)
    for i in range(4):
        sched.add_request(_req(f"r{i}", 6))
    out = sched.schedule()
    assert [s.request.request_id for s in out.scheduled] == ["r0", "r1"]
    assert kv.slots.num_free() == 0 and kv.state_usage() == 1.0
    assert sorted(r.state_slot for r in sched.running) == [0, 1]
    assert all(r.state_slot is None for r in sched.waiting)
    sched.post_step(out)
    sched.check_pages()
    sched.finish(sched.running[0], "stop")     # finishing frees its slot: the next one gets in
    assert kv.slots.num_free() == 1
    out = sched.schedule()
    assert "r2" in [s.request.request_id for s in out.scheduled] and kv.slots.num_free() == 0
    sched.post_step(out)
    sched.check_pages()


def test_abort_preemption_and_finish_free_slots_and_pages() -> None:
    # 6 pages of 4 tokens: three 9-token prompts cannot all grow, so someone is preempted
    kv, sched = _setup(num_pages=6, slots=3, running=3)
    for i in range(3):
        sched.add_request(_req(f"r{i}", 7, max_tokens=8))
    for _ in range(20):    # until the pages run out
        _run(sched, 1)
        if sched.num_preemptions:
            break
    assert sched.num_preemptions > 0
    victim = next(r for r in sched.waiting if r.num_preemptions)
    assert victim.state_slot is None and not victim.page_table   # preemption freed both
    held = {r.state_slot for r in sched.running}
    assert len(held) == len(sched.running) and kv.slots.num_free() == 3 - len(sched.running)
    sched.abort(sched.running[-1].request_id)
    sched.check_pages()
    assert kv.slots.num_free() == 3 - len(sched.running)
    _run(sched, 60, finish_after=8)
    assert not sched.has_unfinished()
    assert kv.slots.num_free() == 3 and kv.pool.num_free() + kv.cache.num_cached_pages == 6
    kv.check([])


def test_check_catches_broken_slot_accounting() -> None:
    kv, sched = _setup(num_pages=16, slots=2, running=2)
    sched.add_request(_req("a", 5))
    sched.add_request(_req("b", 5))
    sched.post_step(sched.schedule())
    a, b = sched.running
    b.state_slot, saved = a.state_slot, b.state_slot
    with pytest.raises(AssertionError, match="share a slot"):
        sched.check_pages()
    b.state_slot = saved
    kv.slots.free(saved)          # freed behind the running request's back
    with pytest.raises(AssertionError, match="not allocated"):
        sched.check_pages()


def test_hybrid_requests_take_no_prefix_hit_without_a_state_snapshot() -> None:
    """Cached pages alone are not a usable hit for a hybrid model: the linear layers' state at the
    end of the match would be missing. With no snapshot taken (no ``copy_state``), the request
    computes everything from position 0 although its pages are in the tree."""
    kv, sched = _setup(num_pages=32, slots=2, running=2)
    assert kv.copy_state is None
    sched.add_request(_req("first", 13))
    _run(sched, 6, finish_after=2)
    assert kv.cache.num_cached_pages >= 3 and kv.cache.num_snapshots == 0 and not sched.has_unfinished()
    again = _req("again", 13)
    sched.add_request(again)
    (s,) = sched.schedule().scheduled
    assert s.start == 0 and again.num_cached_tokens == 0 and again.page_table and again.num_tree_pages == 0
