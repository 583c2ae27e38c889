"""The L2 host tier and the file L3 tier inside the real engine (tiny random Llama).

Every test compares greedy outputs against an engine without any cache: pages that travel
through host memory or storage must come back bit-identical (L2 in the pool's dtype), so the
outputs are the same token for token, while ``cached_tokens_by_tier`` says where the hit came
from.
"""
from __future__ import annotations

import random
from typing import Any

import pytest

from tokenmill import LLM, SamplingParams

P = 8
K = 4
GREEDY = SamplingParams(max_tokens=K, temperature=0.0, ignore_eos=True)


def make_llm(loaded: Any, **kw: Any) -> LLM:
    opts: dict[str, Any] = dict(page_size=P, kv_cache_tokens=20 * P, max_batch_tokens=64,
                                debug_checks=True, session_retention_s=0.0)
    opts.update(kw)
    return LLM(loaded.source.as_posix(), loaded=loaded, **opts)


def sessions(n: int, length: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, 40000) for _ in range(length)] for _ in range(n)]


def run_turns(llm: LLM, prompts: list[list[int]], turns: int, seed: int = 1) -> list[list[Any]]:
    """Round-robin multi-turn sessions; each turn resends the history plus a few new tokens."""
    rng = random.Random(seed)
    hist = [list(p) for p in prompts]
    outs: list[list[Any]] = [[] for _ in prompts]
    for _ in range(turns):
        for i in range(len(hist)):
            o = llm.generate([hist[i]], GREEDY, session_ids=[f"s{i}"])[0]
            outs[i].append(o)
            hist[i] = hist[i] + o.token_ids + [rng.randrange(100, 40000) for _ in range(3)]
    return outs


def test_l2_demotes_and_reloads(tiny_llama: Any) -> None:
    """L1 holds about two of four sessions; with L2 the others come back from host memory."""
    prompts = sessions(4, 6 * P)
    base = run_turns(make_llm(tiny_llama, enable_prefix_cache=False), prompts, 3)
    l1 = run_turns(make_llm(tiny_llama), prompts, 3)
    llm = make_llm(tiny_llama, host_cache_memory_gib=0.01)
    l2 = run_turns(llm, prompts, 3)
    for i in range(4):
        assert [o.token_ids for o in l2[i]] == [o.token_ids for o in base[i]], f"session {i}"
    hit_l1 = sum(o.cached_tokens for s in l1 for o in s)
    hit_l2 = sum(o.cached_tokens for s in l2 for o in s)
    from_l2 = sum(o.cached_tokens_by_tier["l2"] for s in l2 for o in s)
    assert from_l2 > 0 and hit_l2 > hit_l1
    for s in l2:
        for o in s:
            assert sum(o.cached_tokens_by_tier.values()) == o.cached_tokens
    st = llm.engine.stats().tiers
    assert st.hit_tokens["l2"] == from_l2
    assert st.pages_written["l2"] > 0 and st.bytes_read["l2"] > 0
    # Every later turn's history (minus the last sampled token) is cached somewhere.
    for s in l2:
        for t in range(1, 3):
            prev = s[t - 1]
            assert s[t].cached_tokens >= ((len(prev.prompt_token_ids) + K - 1) // P) * P
    llm.engine.check_pages()


def test_l2_bfloat16_host_pages(tiny_llama: Any) -> None:
    """A bf16 host tier holds twice the pages; reloaded pages are rounded but still used."""
    llm = make_llm(tiny_llama, host_cache_memory_gib=0.01, host_cache_dtype="bfloat16")
    tiers = llm.engine.tiers
    assert tiers.host_page_bytes * 2 == tiers.payload_bytes
    outs = run_turns(llm, sessions(4, 6 * P, seed=5), 2)
    assert sum(o.cached_tokens_by_tier["l2"] for s in outs for o in s) > 0
    llm.engine.check_pages()


def test_file_tier_survives_restart(tiny_llama: Any, tmp_path: Any) -> None:
    """write_through to files; a new engine (a restart) finds the history in L3."""
    store = f"file:{tmp_path / 'kv'}"
    prompts = sessions(2, 5 * P, seed=7)
    base = run_turns(make_llm(tiny_llama, enable_prefix_cache=False), prompts, 2)
    first = make_llm(tiny_llama, cache_storage=store)
    run_turns(first, prompts, 1)
    first.engine.tiers.drain()
    assert first.engine.stats().tiers.pages_written["l3"] >= 2 * 4
    first.engine.close()
    second = make_llm(tiny_llama, cache_storage=store)
    again = run_turns(second, prompts, 1)
    for i in range(2):
        o = again[i][0]
        assert o.token_ids == base[i][0].token_ids
        assert o.cached_tokens_by_tier["l3"] == ((len(prompts[i]) - 1) // P) * P
    st = second.engine.stats().tiers
    assert st.hit_pages["l3"] == sum(o[0].cached_tokens_by_tier["l3"] for o in again) // P
    assert st.prefetch_count >= 2 and st.bytes_read["l3"] > 0
    second.engine.close()
