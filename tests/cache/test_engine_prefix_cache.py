"""The prefix cache inside the engine: outputs, cached_tokens, pressure and session retention.

Every test drives the real engine through the offline API on a tiny random Llama. Outputs with
the cache must equal outputs without it, greedy, token for token; ``cached_tokens`` must be
exactly what whole-page matching allows (the last prompt token is always computed, and a
finished request leaves its last sampled token uncomputed).
"""
from __future__ import annotations

import random
import time
from typing import Any

import pytest

from tokenmill import LLM, SamplingParams

P = 8          # page size of every engine here
K = 5          # output tokens per turn (ignore_eos: always exactly K)
GREEDY = SamplingParams(max_tokens=K, temperature=0.0, ignore_eos=True)


def make_llm(loaded: Any, **kw: Any) -> LLM:
    opts: dict[str, Any] = dict(page_size=P, kv_cache_tokens=4096, max_batch_tokens=32,
                                debug_checks=True)
    opts.update(kw)
    return LLM(loaded.source.as_posix(), loaded=loaded, **opts)


def fresh_tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(100, 49000) for _ in range(n)]


def expected_hit(shared: int, prompt_len: int) -> int:
    """Whole pages of the shared part, never the last prompt token."""
    return (min(shared, prompt_len - 1) // P) * P


@pytest.mark.parametrize("residue", [0, P - 1, 1], ids=["on-page", "page-minus-1", "page-plus-1"])
def test_multi_turn_resend_history(tiny_llama: Any, residue: int) -> None:
    """Each turn resends prompt + output of the previous one plus new tokens; the previous
    sequence (the shared prefix) ends on, one before, or one after a page boundary."""
    rng = random.Random(10 + residue)
    on, off = make_llm(tiny_llama), make_llm(tiny_llama, enable_prefix_cache=False)
    first_len = 3 * P + residue - K if residue else 3 * P - K   # S_1 = len + K hits the residue
    new_per_turn = 2 * P - K                                    # keeps S_T % P constant
    prompt = fresh_tokens(rng, first_len)
    prev_seq: list[int] = []
    for turn in range(3):
        if turn:
            prompt = prev_seq + fresh_tokens(rng, new_per_turn)
        a = on.generate([prompt], GREEDY)[0]
        b = off.generate([prompt], GREEDY)[0]
        assert a.token_ids == b.token_ids, f"turn {turn}: cache changed the output"
        assert len(a.token_ids) == K
        # The previous turn's last sampled token has no KV yet, so S-1 tokens are cached.
        want = expected_hit(len(prev_seq) - 1, len(prompt)) if prev_seq else 0
        assert a.cached_tokens == want, f"turn {turn}"
        assert b.cached_tokens == 0
        prev_seq = prompt + a.token_ids
        assert len(prev_seq) % P == residue
    stats = on.engine.stats()
    assert stats.prompt_tokens_total > stats.cached_tokens_total > 0
    on.engine.check_pages()


@pytest.mark.parametrize("shared", [2 * P, 2 * P - 1, 2 * P + 1])
def test_branch_diverges_near_page_boundary(tiny_llama: Any, shared: int) -> None:
    """A second conversation shares exactly ``shared`` tokens (a system prompt) with a cached
    one and then diverges: only whole shared pages are reused."""
    rng = random.Random(shared)
    on, off = make_llm(tiny_llama), make_llm(tiny_llama, enable_prefix_cache=False)
    base = fresh_tokens(rng, 5 * P + 3)
    first = on.generate([base], GREEDY)[0]
    assert first.token_ids == off.generate([base], GREEDY)[0].token_ids
    branch = base[:shared] + fresh_tokens(rng, 2 * P + 5)
    a = on.generate([branch], GREEDY)[0]
    assert a.cached_tokens == (shared // P) * P
    assert a.token_ids == off.generate([branch], GREEDY)[0].token_ids
    # The branch itself is now cached: resending it (plus output) hits all its computed pages.
    again = branch + a.token_ids + fresh_tokens(rng, 3)
    c = on.generate([again], GREEDY)[0]
    assert c.cached_tokens == expected_hit(len(branch) + K - 1, len(again))
    assert c.token_ids == off.generate([again], GREEDY)[0].token_ids


def test_prompt_entirely_cached_still_computes_last_token(tiny_llama: Any) -> None:
    rng = random.Random(7)
    on, off = make_llm(tiny_llama), make_llm(tiny_llama, enable_prefix_cache=False)
    prompt = fresh_tokens(rng, 4 * P)
    on.generate([prompt + fresh_tokens(rng, 9)], GREEDY)
    a = on.generate([prompt], GREEDY)[0]            # a strict prefix of a cached sequence
    assert a.cached_tokens == 3 * P                  # not 4 * P: the last token is computed
    assert a.token_ids == off.generate([prompt], GREEDY)[0].token_ids


def _sessions_turns(on: LLM, off: LLM, rng: random.Random, num_sessions: int, turns: int,
                    first_len: int, new_len: int) -> list[list[Any]]:
    """Run ``turns`` turns of ``num_sessions`` concurrent conversations on both engines."""
    histories = [fresh_tokens(rng, first_len) for _ in range(num_sessions)]
    sids = [f"s{i}" for i in range(num_sessions)]
    outs: list[list[Any]] = []
    for turn in range(turns):
        prompts = [h if turn == 0 else h + fresh_tokens(rng, new_len) for h in histories]
        a = on.generate(prompts, GREEDY, session_ids=sids)
        b = off.generate(prompts, GREEDY, session_ids=sids)
        for i in range(num_sessions):
            assert a[i].token_ids == b[i].token_ids, f"turn {turn} session {i}"
        on.engine.check_pages()
        histories = [p + o.token_ids for p, o in zip(prompts, a)]
        outs.append(a)
    return outs


def test_pool_too_small_for_all_sessions(tiny_llama: Any) -> None:
    """Four concurrent sessions whose histories outgrow the pool: eviction (and possibly
    preemption) happens, outputs stay identical, page accounting holds after every turn."""
    rng = random.Random(5)
    # 16 pages of 8 tokens; after turn 1 the four histories need 4 x 6 = 24 pages.
    kw: dict[str, Any] = dict(kv_cache_tokens=16 * P, max_batch_tokens=64)
    on = make_llm(tiny_llama, **kw)
    off = make_llm(tiny_llama, enable_prefix_cache=False, **kw)
    outs = _sessions_turns(on, off, rng, num_sessions=4, turns=3, first_len=40, new_len=11)
    stats = on.engine.stats()
    assert stats.kv_pages_free + stats.kv_pages_cached == 16   # idle: nothing held by requests
    full_hits = [expected_hit(len(p.prompt_token_ids) + K - 1, len(c.prompt_token_ids))
                 for turn in (1, 2) for p, c in zip(outs[turn - 1], outs[turn])]
    got_hits = [c.cached_tokens for turn in (1, 2) for c in outs[turn]]
    assert all(g <= f for g, f in zip(got_hits, full_hits))
    assert stats.num_preemptions > 0 or got_hits != full_hits   # the pressure was real


def test_ample_pool_concurrent_sessions_hit_everything(tiny_llama: Any) -> None:
    rng = random.Random(6)
    on = make_llm(tiny_llama)
    off = make_llm(tiny_llama, enable_prefix_cache=False)
    outs = _sessions_turns(on, off, rng, num_sessions=4, turns=3, first_len=29, new_len=10)
    for turn in range(1, 3):
        for prev, cur in zip(outs[turn - 1], outs[turn]):
            prev_len = len(prev.prompt_token_ids) + K
            assert cur.cached_tokens == expected_hit(prev_len - 1, len(cur.prompt_token_ids))
    stats = on.engine.stats()
    assert stats.cached_tokens_total == sum(o.cached_tokens for t in outs for o in t)
    assert stats.prompt_tokens_total == sum(len(o.prompt_token_ids) for t in outs for o in t)


def _flood(llm: LLM, rng: random.Random, n: int, length: int) -> None:
    """One-off requests, two at a time, each leaving its pages in the cache."""
    for _ in range(n // 2):
        llm.generate([fresh_tokens(rng, length), fresh_tokens(rng, length)], GREEDY)


def test_retained_session_keeps_its_hit_through_a_flood(tiny_llama: Any) -> None:
    rng = random.Random(8)
    # 40 pages: the conversation holds 6 when idle; the flood brings ~60 pages of one-offs.
    llm = make_llm(tiny_llama, kv_cache_tokens=40 * P, session_retention_s=600.0)
    convo = fresh_tokens(rng, 6 * P - K + 1)           # prompt + output = 6 pages + 1 token
    other = fresh_tokens(rng, 6 * P - K + 1)           # same shape, no session id
    a1 = llm.generate([convo], GREEDY, session_ids=["agent"])[0]
    b1 = llm.generate([other], GREEDY)[0]
    assert llm.engine.kv.cache.is_session_retained("agent")
    _flood(llm, rng, n=12, length=4 * P + 3)
    a2 = llm.generate([convo + a1.token_ids + fresh_tokens(rng, 7)], GREEDY,
                      session_ids=["agent"])[0]
    b2 = llm.generate([other + b1.token_ids + fresh_tokens(rng, 7)], GREEDY)[0]
    assert a2.cached_tokens == 6 * P                   # the whole history, kept
    assert b2.cached_tokens == 0                       # the flood did evict what was unprotected
    llm.engine.check_pages()


def test_session_evictable_after_retention_window(tiny_llama: Any) -> None:
    rng = random.Random(9)
    llm = make_llm(tiny_llama, kv_cache_tokens=40 * P, session_retention_s=0.2)
    convo = fresh_tokens(rng, 6 * P - K + 1)
    a1 = llm.generate([convo], GREEDY, session_ids=["agent"])[0]
    time.sleep(0.3)                                    # the window closes (sleep only lengthens)
    assert not llm.engine.kv.cache.is_session_retained("agent")
    _flood(llm, rng, n=12, length=4 * P + 3)
    a2 = llm.generate([convo + a1.token_ids + fresh_tokens(rng, 7)], GREEDY,
                      session_ids=["agent"])[0]
    assert a2.cached_tokens == 0                       # plain LRU: the oldest path went first


def test_flush_and_disabled_cache(tiny_llama: Any) -> None:
    rng = random.Random(11)
    llm = make_llm(tiny_llama)
    prompt = fresh_tokens(rng, 5 * P)
    llm.generate([prompt], GREEDY)
    assert llm.generate([prompt], GREEDY)[0].cached_tokens == 4 * P
    assert llm.engine.flush_cache()
    stats = llm.engine.stats()
    assert stats.kv_pages_cached == 0 and stats.kv_pages_free == stats.kv_pages_total
    assert llm.generate([prompt], GREEDY)[0].cached_tokens == 0
    off = make_llm(tiny_llama, enable_prefix_cache=False)
    off.generate([prompt], GREEDY)
    assert off.generate([prompt], GREEDY)[0].cached_tokens == 0
    assert off.engine.stats().cached_tokens_total == 0


def test_concurrent_requests_with_one_prompt_hit_each_others_prefill(tiny_llama: Any) -> None:
    """n parallel requests with the same long prompt (as with n > 1 or parallel tool calls):
    the first computes the prompt, the others wait for its pages and reuse them; outputs equal
    the uncached ones."""
    rng = random.Random(77)
    shared = fresh_tokens(rng, 12 * P)
    prompts = [shared + fresh_tokens(rng, 3) for _ in range(4)]
    # the step budget fits all four prompts at once: without the wait they would all compute it
    on, off = make_llm(tiny_llama, max_batch_tokens=512), make_llm(tiny_llama, enable_prefix_cache=False)
    got = on.generate(prompts, GREEDY)
    want = off.generate(prompts, GREEDY)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    hits = sorted(o.cached_tokens for o in got)
    assert hits[0] == 0 and hits[1:] == [12 * P] * 3, hits
    on.engine.check_pages()
