"""Prefix caching of hybrid (linear-attention) models with state snapshots, in the real engine.

A hybrid model's linear layers carry a recurrent state, so a prefix hit is exact only from a
state snapshot: the match ends at the deepest snapshot on the cached path. Every test compares
greedy outputs with prefix caching on against an engine with it off, token for token, and checks
``cached_tokens`` against where the snapshots are: at the last page boundary a finished request
computed (prompt + output), every ``state_snapshot_interval`` tokens of a prefill, and at the
branch point where a prompt leaves a cached one. Runs on every tiny hybrid architecture.
"""
from __future__ import annotations

import random
from typing import Any

import pytest

from tokenmill import LLM, SamplingParams
from tokenmill.engine.request import RequestStatus

P = 8          # page size of every engine here
K = 5          # output tokens per request (ignore_eos: always exactly K)
GREEDY = SamplingParams(max_tokens=K, temperature=0.0, ignore_eos=True)
HYBRID_ARCHS = ["Qwen3NextForCausalLM", "BailingHybridForCausalLM"]


@pytest.fixture(scope="module", params=HYBRID_ARCHS)
def hybrid(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    from tokenmill.loader import load_model
    from tokenmill.loader.tiny import build_tiny_checkpoint

    path = build_tiny_checkpoint(tmp_path_factory.mktemp("hybrid") / request.param, request.param, seed=5)
    loaded = load_model(str(path))
    assert loaded.model.kv_cache_spec().is_hybrid
    return loaded


def make_llm(loaded: Any, **kw: Any) -> LLM:
    opts: dict[str, Any] = dict(page_size=P, kv_cache_tokens=4096, max_batch_tokens=64,
                                state_snapshot_interval=0, debug_checks=True, max_running_requests=8)
    opts.update(kw)
    return LLM(loaded.source.as_posix(), loaded=loaded, **opts)


def fresh(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(100, 49000) for _ in range(n)]


def run_both(on: LLM, off: LLM, prompt: list[int]) -> Any:
    a = on.generate([prompt], GREEDY)[0]
    b = off.generate([prompt], GREEDY)[0]
    assert a.token_ids == b.token_ids, "the prefix cache changed the output"
    assert b.cached_tokens == 0
    return a


@pytest.mark.parametrize("k", [K, 2 * P + 3], ids=["short-output", "long-output"])
@pytest.mark.parametrize("residue", [0, P - 1, 1], ids=["on-page", "page-minus-1", "page-plus-1"])
def test_session_turns_hit_previous_prompt_and_output(hybrid: Any, residue: int, k: int) -> None:
    """Turn t resends turn t-1's prompt + output plus new tokens; the previous sequence ends on,
    one before, or one after a page boundary. The hit is what a dense model gets: the whole pages
    of the previous sequence's computed tokens (its last sampled token has no KV or state yet),
    whether the last page boundary falls in the prompt (short output: the prefill is cut there)
    or in the output (long output: decoding crosses it)."""
    rng = random.Random(20 + residue + k)
    params = SamplingParams(max_tokens=k, temperature=0.0, ignore_eos=True)
    on, off = make_llm(hybrid), make_llm(hybrid, enable_prefix_cache=False)
    prompt = fresh(rng, 3 * P + residue - k if residue else 3 * P - k)
    prev: list[int] = []
    for turn in range(3):
        if turn:
            prompt = prev + fresh(rng, (-k) % P + P)
        a = on.generate([prompt], params)[0]
        assert a.token_ids == off.generate([prompt], params)[0].token_ids, f"turn {turn}: cache changed the output"
        want = (len(prev) - 1) // P * P if prev else 0
        assert a.cached_tokens == want, f"turn {turn}"
        prev = prompt + a.token_ids
        assert len(prev) % P == residue
    stats = on.engine.stats()
    assert stats.cached_tokens_total > 0
    assert stats.state_snapshots_cached == on.engine.kv.cache.num_snapshots > 0
    on.engine.check_pages()


@pytest.mark.parametrize("delta", [0, -1, 1], ids=["on-snapshot", "snapshot-minus-1", "snapshot-plus-1"])
def test_branch_sharing_a_prefix_that_ends_at_a_snapshot_or_next_to_one(hybrid: Any, delta: int) -> None:
    """A long prompt is prefilled with snapshots every 2 pages; a second one shares ``4P + delta``
    tokens with it and then diverges. It hits the deepest snapshot inside the shared whole pages,
    takes a snapshot at its branch point, and a third prompt with the same shared part hits that."""
    rng = random.Random(30 + delta)
    on = make_llm(hybrid, state_snapshot_interval=2 * P)
    off = make_llm(hybrid, enable_prefix_cache=False)
    base = fresh(rng, 7 * P + 3)
    assert run_both(on, off, base).cached_tokens == 0
    shared = 4 * P + delta
    branch = base[:shared] + fresh(rng, 2 * P + 5)
    pages = shared // P * P                      # whole shared pages: 4P, 3P, 4P
    snap = pages // (2 * P) * (2 * P)            # deepest interval snapshot in them: 4P, 2P, 4P
    assert run_both(on, off, branch).cached_tokens == snap
    again = base[:shared] + fresh(rng, 3 * P)
    assert run_both(on, off, again).cached_tokens == pages   # the branch point snapshot
    on.engine.check_pages()


def test_long_prefill_is_cut_at_interval_snapshots(hybrid: Any) -> None:
    """A prompt far longer than the interval: a later prompt sharing 5.5 intervals of it hits
    the fifth interval snapshot; outputs equal the uncached engine's."""
    rng = random.Random(40)
    interval = 2 * P
    on = make_llm(hybrid, state_snapshot_interval=interval, max_batch_tokens=48)
    off = make_llm(hybrid, enable_prefix_cache=False, max_batch_tokens=48)
    base = fresh(rng, 12 * P + 5)
    run_both(on, off, base)
    assert on.engine.kv.num_snapshots_taken >= 6
    other = base[:11 * P] + fresh(rng, P)
    assert run_both(on, off, other).cached_tokens == 5 * interval


def test_dropped_snapshots_fall_back_and_a_zero_budget_never_hits(hybrid: Any) -> None:
    rng = random.Random(50)
    on = make_llm(hybrid, state_snapshot_interval=2 * P)
    off = make_llm(hybrid, enable_prefix_cache=False)
    base = fresh(rng, 6 * P + 2)
    run_both(on, off, base)
    cache = on.engine.kv.cache
    probe = base[:6 * P] + fresh(rng, 4)
    deepest = cache.match_prefix(probe[:-1], touch=False)
    assert deepest.num_tokens == 6 * P
    assert cache.drop_snapshot(deepest.snapshot)   # the 6P (tail) snapshot goes, its pages stay
    assert run_both(on, off, probe).cached_tokens == 4 * P
    none = make_llm(hybrid, state_snapshot_slots=0)
    run_both(none, off, base)
    assert run_both(none, off, base + fresh(rng, 3)).cached_tokens == 0
    assert none.engine.kv.cache.num_snapshots == 0


def test_integrity_under_random_workload_with_evictions_aborts_and_preemption(hybrid: Any) -> None:
    """Many requests sharing prefixes in a KV pool and snapshot budget both too small for them:
    pages, state slots and snapshots are evicted, requests preempted and aborted. Page, slot and
    snapshot accounting hold after every step, and every request that finishes gives exactly the
    uncached engine's tokens."""
    rng = random.Random(60)
    on = make_llm(hybrid, kv_cache_tokens=10 * P, state_snapshot_slots=3, state_snapshot_interval=2 * P,
                  max_running_requests=3, max_batch_tokens=24)
    off = make_llm(hybrid, enable_prefix_cache=False)
    engine = on.engine
    stems = [fresh(rng, 3 * P + 1), fresh(rng, 2 * P + 3)]
    prompts = {}
    for i in range(14):
        stem = stems[i % 2] if i % 3 else []
        prompts[f"r{i}"] = stem[:rng.randrange(len(stem) // 2, len(stem) + 1)] + fresh(rng, rng.randrange(2, 2 * P))
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    pending = list(prompts)
    aborted: set[str] = set()
    outputs: dict[str, list[int]] = {}
    steps = 0
    while pending or engine.has_unfinished_requests():
        for _ in range(rng.randrange(0, 4) if steps else 6):
            if pending:
                rid = pending.pop(0)
                engine.add_request(rid, prompts[rid], params)
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = list(out.token_ids)
        steps += 1
        running = [r for r in engine.scheduler.running if r.status is RequestStatus.RUNNING]
        if running and rng.random() < 0.08:
            victim = rng.choice(running).request_id
            engine.abort_request(victim)
            aborted.add(victim)
        engine.check_pages()
        assert steps < 2000
    assert engine.num_preemptions > 0, "the workload should preempt"
    assert engine.kv.num_snapshot_hits > 0 and engine.kv.num_snapshots_taken > 0
    cache = engine.kv.cache
    assert cache.num_locked_snapshots == 0 and cache.num_locked_pages == 0
    assert cache.num_snapshots + engine.kv.slots.num_free_snapshots() == 3
    finished = [rid for rid in prompts if rid not in aborted]
    assert finished and all(rid in outputs for rid in finished)
    for rid in finished:
        assert outputs[rid] == off.generate([prompts[rid]], params)[0].token_ids, rid
    engine.kv.flush()
    assert engine.kv.pool.num_free() == engine.kv.pool.num_pages and cache.num_snapshots == 0


def test_parallel_requests_sharing_a_system_prompt(hybrid: Any) -> None:
    """Requests arriving together with one system prompt: the first computes it and, asked by
    the scheduler, snapshots where the prompts part; the others wait for that and hit it."""
    rng = random.Random(70)
    on, off = make_llm(hybrid), make_llm(hybrid, enable_prefix_cache=False)
    system = fresh(rng, 4 * P + 3)
    prompts = [system + fresh(rng, P + i) for i in range(4)]
    outs = on.generate(prompts, GREEDY)
    for p, a in zip(prompts, outs):
        assert a.token_ids == off.generate([p], GREEDY)[0].token_ids
    assert [a.cached_tokens for a in outs] == [0, 4 * P, 4 * P, 4 * P]
    on.engine.check_pages()
