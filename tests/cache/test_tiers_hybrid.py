"""The L2 host and L3 file tiers with hybrid (linear-attention) models: state snapshots travel
with the pages, in the real engine, on every tiny hybrid architecture.

A hybrid prefix hit is exact only where a state snapshot exists, so a lower-tier hit must bring
the snapshot at its end as well. Each test empties L1 (or restarts the engine) between turns and
checks that turn 2 hits the previous turn's prompt + output from L2 or L3, with greedy output
token for token equal to an engine without any cache, and that an unreadable snapshot record
falls back to the nearest earlier snapshot.
"""
from __future__ import annotations

import random
from typing import Any

import pytest

from tokenmill import LLM, SamplingParams

P = 8
K = 5
GREEDY = SamplingParams(max_tokens=K, temperature=0.0, ignore_eos=True)
HYBRID_ARCHS = ["Qwen3NextForCausalLM", "BailingHybridForCausalLM"]


@pytest.fixture(scope="module", params=HYBRID_ARCHS)
def hybrid(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    from tokenmill.loader import load_model
    from tokenmill.loader.tiny import build_tiny_checkpoint

    path = build_tiny_checkpoint(tmp_path_factory.mktemp("hytier") / request.param, request.param, seed=7)
    loaded = load_model(str(path))
    assert loaded.model.kv_cache_spec().is_hybrid
    return loaded


def make_llm(loaded: Any, **kw: Any) -> LLM:
    opts: dict[str, Any] = dict(page_size=P, kv_cache_tokens=64 * P, max_batch_tokens=64,
                                state_snapshot_interval=0, debug_checks=True, max_running_requests=4,
                                session_retention_s=0.0)
    opts.update(kw)
    return LLM(loaded.source.as_posix(), loaded=loaded, **opts)


def fresh(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(100, 49000) for _ in range(n)]


def evict_l1(llm: LLM) -> None:
    """Evict every L1 page (and so every L1 snapshot) through the radix tree's eviction hooks."""
    cache = llm.engine.kv.cache
    cache.evict(cache.num_cached_pages)
    assert cache.num_cached_pages == 0 and cache.num_snapshots == 0


def two_turns(llm: LLM, off: LLM, first: list[int], rng: random.Random, between: Any) -> tuple[Any, Any]:
    a = llm.generate([first], GREEDY)[0]
    assert a.token_ids == off.generate([first], GREEDY)[0].token_ids
    between()
    second = first + a.token_ids + fresh(rng, 6)
    b = llm.generate([second], GREEDY)[0]
    assert b.token_ids == off.generate([second], GREEDY)[0].token_ids, "the tier hit changed the output"
    return a, b


def test_l2_carries_snapshots_back_after_l1_eviction(hybrid: Any) -> None:
    rng = random.Random(1)
    llm = make_llm(hybrid, host_cache_memory_gib=0.01)
    off = make_llm(hybrid, enable_prefix_cache=False)
    first = fresh(rng, 4 * P + 3)
    a, b = two_turns(llm, off, first, rng, lambda: evict_l1(llm))
    want = (len(first) + K - 1) // P * P          # turn 1's computed whole pages
    assert b.cached_tokens == want
    assert b.cached_tokens_by_tier == {"l1": 0, "l2": want, "l3": 0}
    st = llm.engine.stats().tiers
    assert st.snapshot_hits["l2"] == 1 and st.snapshots_written["l2"] >= 1 and st.snapshots_l2 >= 1
    from tokenmill.server.tier_metrics import render_tier_metrics

    text = "\n".join(render_tier_metrics(st, 0, 0, {}))
    assert 'tokenmill:cache_tier_snapshot_hits_total{tier="l2"} 1' in text
    assert f'tokenmill:cache_tier_snapshots{{tier="l2"}} {st.snapshots_l2}' in text
    # L1's snapshot LRU gives one up while its pages stay: L2 still brings it back
    third = b.prompt_token_ids + b.token_ids + fresh(rng, 3)
    cache = llm.engine.kv.cache
    assert cache.evict_snapshots(cache.num_snapshots) >= 1 and cache.num_snapshots == 0
    c = llm.generate([third], GREEDY)[0]
    assert c.token_ids == off.generate([third], GREEDY)[0].token_ids
    assert c.cached_tokens == (len(b.prompt_token_ids) + K - 1) // P * P
    assert c.cached_tokens_by_tier["l1"] == c.cached_tokens      # pages from L1, snapshot from L2
    assert llm.engine.stats().tiers.snapshot_hits["l2"] == 2
    llm.engine.check_pages()


def test_l3_files_hit_after_eviction_and_after_a_restart(hybrid: Any, tmp_path: Any) -> None:
    rng = random.Random(2)
    store = f"file:{tmp_path / 'kv'}"
    llm = make_llm(hybrid, cache_storage=store)
    off = make_llm(hybrid, enable_prefix_cache=False)
    first = fresh(rng, 3 * P + 5)

    def evict_and_drain() -> None:
        llm.engine.tiers.drain()
        evict_l1(llm)

    a, b = two_turns(llm, off, first, rng, evict_and_drain)
    want = (len(first) + K - 1) // P * P
    assert b.cached_tokens_by_tier == {"l1": 0, "l2": 0, "l3": want}
    st = llm.engine.stats().tiers
    assert st.snapshot_hits["l3"] == 1 and st.snapshots_written["l3"] >= 1
    llm.engine.tiers.drain()
    llm.engine.close()
    # a new engine on the same folder: turn 3 of the session hits turn 2's history from L3
    again = make_llm(hybrid, cache_storage=store)
    third = b.prompt_token_ids + b.token_ids + fresh(rng, 2)
    c = again.generate([third], GREEDY)[0]
    assert c.token_ids == off.generate([third], GREEDY)[0].token_ids
    assert c.cached_tokens == c.cached_tokens_by_tier["l3"] == (len(b.prompt_token_ids) + K - 1) // P * P
    again.engine.check_pages()
    again.engine.close()


def test_corrupt_snapshot_file_falls_back_to_an_earlier_snapshot(hybrid: Any, tmp_path: Any,
                                                                caplog: Any) -> None:
    """Interval snapshots every 2 pages go to L3 with the tail one; the tail snapshot's file is
    corrupted, so a restarted engine's hit ends at the previous snapshot, counted and logged."""
    from tokenmill.cache.storage import FileStorage
    from tokenmill.engine.kv_tiers import snapshot_key

    rng = random.Random(3)
    store = f"file:{tmp_path / 'kv'}"
    off = make_llm(hybrid, enable_prefix_cache=False)
    writer = make_llm(hybrid, cache_storage=store, state_snapshot_interval=2 * P)
    first = fresh(rng, 5 * P + 2)
    a = writer.generate([first], GREEDY)[0]
    writer.engine.tiers.drain()
    writer.engine.close()
    tiers = writer.engine.tiers
    hist = first + a.token_ids
    keys = tiers.keyer.keys(hist)
    tail = (len(hist) - 1) // P                   # the tail snapshot's page boundary: 5
    backend = FileStorage(tmp_path / "kv", tiers.keyer.namespace)
    path = backend.path(snapshot_key(keys[tail - 1]))
    raw = bytearray(path.read_bytes())
    raw[-3] ^= 0x10
    path.write_bytes(bytes(raw))
    assert backend.path(snapshot_key(keys[3])).is_file()     # the interval snapshot at 4 pages
    reader = make_llm(hybrid, cache_storage=store, state_snapshot_interval=2 * P)
    second = hist + fresh(rng, 4)
    with caplog.at_level("WARNING"):
        b = reader.generate([second], GREEDY)[0]
    assert b.token_ids == off.generate([second], GREEDY)[0].token_ids
    assert b.cached_tokens == b.cached_tokens_by_tier["l3"] == 4 * P
    st = reader.engine.stats().tiers
    assert st.snapshot_fallbacks == 1 and st.l3_errors.get("corrupt") == 1
    assert "state snapshot" in caplog.text and "unreadable" in caplog.text
    reader.engine.check_pages()
    reader.engine.close()


@pytest.mark.parametrize("policy", ["write_back", "write_through_selective"])
def test_other_write_policies_put_snapshots_in_l3(hybrid: Any, tmp_path: Any, policy: str) -> None:
    """write_back: evicted L1 pages and snapshots go to L3 (no L2 here); selective: a prefix hit
    twice is written with the snapshot its hit restored. Either way a new engine hits them."""
    rng = random.Random(4)
    store = f"file:{tmp_path / 'kv'}"
    llm = make_llm(hybrid, cache_storage=store, cache_write_policy=policy, cache_write_min_hits=1)
    off = make_llm(hybrid, enable_prefix_cache=False)
    first = fresh(rng, 3 * P + 1)
    a = llm.generate([first], GREEDY)[0]
    second = first + a.token_ids + fresh(rng, 4)
    b = llm.generate([second], GREEDY)[0]            # an L1 hit (selective: now written)
    assert b.token_ids == off.generate([second], GREEDY)[0].token_ids
    want = (len(first) + K - 1) // P * P
    assert b.cached_tokens == b.cached_tokens_by_tier["l1"] == want
    evict_l1(llm)                                     # write_back: now written
    llm.engine.tiers.drain()
    assert llm.engine.stats().tiers.snapshots_written["l3"] >= 1
    llm.engine.close()
    again = make_llm(hybrid, cache_storage=store, cache_write_policy=policy)
    c = again.generate([second], GREEDY)[0]
    assert c.token_ids == b.token_ids
    got = c.cached_tokens_by_tier["l3"]
    assert c.cached_tokens == got and got >= want
    again.engine.close()


def test_redis_replicas_share_pages_and_snapshots(hybrid: Any, redis_server: Any) -> None:
    """Replica B serves turn 2 of a session replica A served turn 1 of (a real Redis); A's
    flush of the namespace removes the snapshots with the pages."""
    rng = random.Random(5)
    off = make_llm(hybrid, enable_prefix_cache=False)
    a = make_llm(hybrid, cache_storage=redis_server.url)
    first = fresh(rng, 3 * P + 2)
    out = a.generate([first], GREEDY)[0]
    a.engine.tiers.drain()
    b = make_llm(hybrid, cache_storage=redis_server.url)
    second = first + out.token_ids + fresh(rng, 5)
    got = b.generate([second], GREEDY)[0]
    assert got.token_ids == off.generate([second], GREEDY)[0].token_ids
    assert got.cached_tokens == got.cached_tokens_by_tier["l3"] == (len(first) + K - 1) // P * P
    assert b.engine.stats().tiers.snapshot_hits["l3"] == 1
    b.engine.tiers.drain()
    assert a.engine.flush_storage_cache() > 0
    c = make_llm(hybrid, cache_storage=redis_server.url)
    assert c.generate([second], GREEDY)[0].cached_tokens == 0
    for llm in (a, b, c):
        llm.engine.close()


def test_fp8_attention_pages_and_snapshots_through_l2(hybrid: Any) -> None:
    """fp8 attention pages (the linear layers' state stays fp32): a hit from L2 after eviction
    gives what an L1 hit on the same pages gives."""
    rng = random.Random(6)
    l2 = make_llm(hybrid, host_cache_memory_gib=0.01, kv_cache_dtype="fp8_e4m3")
    l1 = make_llm(hybrid, kv_cache_dtype="fp8_e4m3")
    first = fresh(rng, 3 * P + 4)
    a = l2.generate([first], GREEDY)[0]
    assert l1.generate([first], GREEDY)[0].token_ids == a.token_ids
    evict_l1(l2)
    second = first + a.token_ids + fresh(rng, 3)
    got, want = l2.generate([second], GREEDY)[0], l1.generate([second], GREEDY)[0]
    assert got.token_ids == want.token_ids
    assert got.cached_tokens_by_tier["l2"] == want.cached_tokens_by_tier["l1"] == (len(first) + K - 1) // P * P
    l2.engine.check_pages()


@pytest.mark.parametrize("policy", ["write_through", "write_back"])
def test_sessions_round_robin_under_pressure_on_every_budget(hybrid: Any, tmp_path: Any, policy: str) -> None:
    """Four sessions take turns with an L1 pool of about two, few snapshot slots, a small L2 (so
    snapshots and pages are displaced there too) and a file L3: outputs stay those of an engine
    without caching, accounting holds after every step (debug checks), and later turns hit."""
    rng = random.Random(7)
    llm = make_llm(hybrid, kv_cache_tokens=16 * P, state_snapshot_slots=3, state_snapshot_interval=2 * P,
                   host_cache_memory_gib=2e-4, cache_storage=f"file:{tmp_path / 'kv'}",
                   cache_write_policy=policy)
    off = make_llm(hybrid, enable_prefix_cache=False)
    hist = [fresh(rng, 3 * P + i) for i in range(4)]
    hits = 0
    for turn in range(3):
        for i in range(4):
            got = llm.generate([hist[i]], GREEDY)[0]
            assert got.token_ids == off.generate([hist[i]], GREEDY)[0].token_ids, (turn, i)
            assert sum(got.cached_tokens_by_tier.values()) == got.cached_tokens
            hits += got.cached_tokens if turn else 0
            hist[i] = hist[i] + got.token_ids + fresh(rng, 2)
        llm.engine.tiers.drain()
    assert hits > 0
    st = llm.engine.stats().tiers
    assert st.snapshot_hits["l2"] + st.snapshot_hits["l3"] > 0
    llm.engine.check_pages()
    llm.engine.close()


def test_host_snapshot_share_splits_l2_and_zero_keeps_snapshots_out(hybrid: Any) -> None:
    import argparse

    from tokenmill.engine.cli import add_cache_tier_arguments, engine_config_from_args

    ap = argparse.ArgumentParser()
    add_cache_tier_arguments(ap)
    assert engine_config_from_args(ap.parse_args(["--host-cache-snapshot-share", "0.5"])).host_cache_snapshot_share == 0.5
    with pytest.raises(ValueError, match="host_cache_snapshot_share"):
        make_llm(hybrid, host_cache_memory_gib=0.01, host_cache_snapshot_share=1.0)
    caps = {}
    for share in (0.25, 0.5):
        st = make_llm(hybrid, host_cache_memory_gib=0.01, host_cache_snapshot_share=share).engine.stats().tiers
        caps[share] = (st.snapshots_l2_capacity, st.pages_l2_capacity)
    assert caps[0.5][0] > caps[0.25][0] and caps[0.5][1] < caps[0.25][1]
    # no snapshot slots in L2: the evicted pages come back from L2 but no snapshot does, so no hit
    rng = random.Random(8)
    llm = make_llm(hybrid, host_cache_memory_gib=0.01, host_cache_snapshot_share=0.0)
    off = make_llm(hybrid, enable_prefix_cache=False)
    assert llm.engine.stats().tiers.snapshots_l2_capacity == 0
    a, b = two_turns(llm, off, fresh(rng, 3 * P), rng, lambda: evict_l1(llm))
    assert b.cached_tokens == 0
    llm.engine.check_pages()
