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


def _l3_hits(outs: list[list[Any]]) -> int:
    return sum(o.cached_tokens_by_tier["l3"] for s in outs for o in s)


def test_corrupt_truncated_and_foreign_pages_are_recomputed(tiny_llama: Any, tmp_path: Any,
                                                           caplog: Any) -> None:
    """Bad page files are counted, logged and recomputed; the output never changes."""
    from tokenmill.cache.storage import FileStorage
    from tokenmill.loader import load_model
    from tokenmill.loader.tiny import build_tiny_checkpoint

    store = f"file:{tmp_path / 'kv'}"
    prompts = sessions(3, 6 * P, seed=11)
    base = run_turns(make_llm(tiny_llama, enable_prefix_cache=False), prompts, 1)
    writer = make_llm(tiny_llama, cache_storage=store)
    run_turns(writer, prompts, 1)
    writer.engine.close()
    tiers = writer.engine.tiers
    backend = FileStorage(tmp_path / "kv", tiers.keyer.namespace)
    k0, k1, k2 = (tiers.keyer.keys(p) for p in prompts)
    # session 0: flip one payload byte of page 2; session 1: truncate page 1
    path = backend.path(k0[2])
    raw = bytearray(path.read_bytes())
    raw[-5] ^= 0x40
    path.write_bytes(bytes(raw))
    path = backend.path(k1[1])
    path.write_bytes(path.read_bytes()[:100])
    # session 2: page 3 replaced by a page another model wrote for the same tokens
    other_dir = build_tiny_checkpoint(tmp_path / "other", "LlamaForCausalLM", seed=99)
    other = make_llm(load_model(str(other_dir)), cache_storage=store)
    run_turns(other, [prompts[2]], 1)
    other.engine.close()
    o_keys = other.engine.tiers.keyer.keys(prompts[2])
    assert set(o_keys).isdisjoint(k2)            # another model never addresses these pages
    foreign = FileStorage(tmp_path / "kv", other.engine.tiers.keyer.namespace).path(o_keys[3])
    backend.path(k2[3]).write_bytes(foreign.read_bytes())

    reader = make_llm(tiny_llama, cache_storage=store)
    with caplog.at_level("WARNING"):
        outs = run_turns(reader, prompts, 1)
    for i in range(3):
        assert outs[i][0].token_ids == base[i][0].token_ids, f"session {i}"
    got = [o[0].cached_tokens_by_tier["l3"] // P for o in outs]
    assert got == [2, 1, 3]
    errors = reader.engine.stats().tiers.l3_errors
    assert errors == {"corrupt": 1, "truncated": 1, "foreign": 1}
    text = caplog.text
    assert "checksum" in text and "another model" in text
    reader.engine.close()


@pytest.mark.parametrize("policy", ["write_through_selective", "write_back"])
def test_write_policies(tiny_llama: Any, tmp_path: Any, policy: str) -> None:
    store = f"file:{tmp_path / 'kv'}"
    prompts = sessions(4, 6 * P, seed=13)
    llm = make_llm(tiny_llama, cache_storage=store, cache_write_policy=policy,
                   cache_write_min_hits=2, host_cache_memory_gib=0.00005 if policy == "write_back" else 0.0)
    run_turns(llm, prompts[:1], 1)
    llm.engine.tiers.drain()
    first = llm.engine.stats().tiers.pages_written["l3"]
    assert first == 0                       # neither policy writes a page computed once
    run_turns(llm, prompts, 3)
    llm.engine.tiers.drain()
    st = llm.engine.stats().tiers
    assert st.pages_written["l3"] > 0
    if policy == "write_back":
        assert st.pages_written["l2"] > 0   # L3 got pages only through L2's evictions
    llm.engine.close()
    base = run_turns(make_llm(tiny_llama, enable_prefix_cache=False), prompts, 1)
    fresh = make_llm(tiny_llama, cache_storage=store)
    outs = run_turns(fresh, prompts, 1)
    assert [o[0].token_ids for o in outs] == [o[0].token_ids for o in base]
    assert _l3_hits(outs) > 0
    fresh.engine.close()


def test_redis_down_at_start_then_killed_mid_run(tiny_llama: Any, redis_server: Any,
                                                 caplog: Any) -> None:
    from tokenmill.utils.proc import free_port

    prompts = sessions(2, 5 * P, seed=17)
    base = run_turns(make_llm(tiny_llama, enable_prefix_cache=False), prompts, 2)
    # down at start: nothing listens on the port
    dead = make_llm(tiny_llama, cache_storage=f"redis://127.0.0.1:{free_port()}/0",
                    cache_storage_timeout_s=0.2)
    with caplog.at_level("WARNING"):
        outs = run_turns(dead, prompts, 2)
    assert [[o.token_ids for o in s] for s in outs] == [[o.token_ids for o in s] for s in base]
    assert dead.engine.stats().tiers.l3_errors.get("unavailable", 0) >= 1
    assert "is down" in caplog.text
    dead.engine.close()
    # killed mid-run
    llm = make_llm(tiny_llama, cache_storage=redis_server.url, cache_storage_timeout_s=0.2)
    run_turns(llm, prompts, 1)
    llm.engine.tiers.drain()
    assert llm.engine.stats().tiers.pages_written["l3"] >= 8
    llm.engine.flush_cache()                 # L1 empty: the next turns would read L3
    redis_server.kill()
    outs = run_turns(llm, prompts, 2)
    assert [[o.token_ids for o in s] for s in outs] == [[o.token_ids for o in s] for s in base]
    assert _l3_hits(outs) == 0
    assert llm.engine.stats().tiers.l3_errors.get("unavailable", 0) >= 1
    llm.engine.check_pages()
    llm.engine.close()


def test_redis_shared_by_two_engines(tiny_llama: Any, redis_server: Any) -> None:
    """Two replicas of one model agree on keys: B finds what A computed; A's flush empties it."""
    prompts = sessions(2, 6 * P, seed=19)
    a = make_llm(tiny_llama, cache_storage=redis_server.url)
    run_turns(a, prompts, 1)
    a.engine.tiers.drain()
    b = make_llm(tiny_llama, cache_storage=redis_server.url)
    outs = run_turns(b, prompts, 1)
    assert [o[0].cached_tokens_by_tier["l3"] for o in outs] == [((6 * P - 1) // P) * P] * 2
    b.engine.tiers.drain()
    assert b.engine.stats().tiers.pages_written["l3"] == 0   # nothing written twice
    assert a.engine.flush_storage_cache() == 2 * ((6 * P + K - 1) // P)
    c = make_llm(tiny_llama, cache_storage=redis_server.url)
    assert _l3_hits(run_turns(c, prompts, 1)) == 0
    for llm in (a, b, c):
        llm.engine.close()


@pytest.mark.parametrize("arch,kv_dtype,layout", [("DeepseekV3ForCausalLM", "auto", ""), ("LlamaForCausalLM", "fp8_e4m3", ""),
                                                  ("DeepseekV3ForCausalLM", "fp8_e4m3", ""), ("LlamaForCausalLM", "int8", "rows"),
                                                  ("LlamaForCausalLM", "int8", "tiled")])
def test_other_kv_layouts_round_trip(tmp_path: Any, arch: str, kv_dtype: str, layout: str, monkeypatch) -> None:
    """MLA latent pages ([N, P, E]) and fp8 / int8 pages (bytes + scales; int8 in rows and in the
    tiled order) through L2 and L3 files: the outputs equal an engine whose L1 holds everything
    and hits the same pages there. (With fp8 a cached prefix is read back quantized, so a hit may
    differ from a cold prefill in the last bits: the oracle is an L1 hit on the same pages, not a
    cold run.)"""
    from tokenmill.loader import load_model
    from tokenmill.loader.tiny import build_tiny_checkpoint

    if layout:
        monkeypatch.setenv("TOKENMILL_KV_INT8_LAYOUT", layout)

    loaded = load_model(str(build_tiny_checkpoint(tmp_path / "m", arch, seed=2)))
    prompts = sessions(4, 6 * P, seed=23)
    ref = make_llm(loaded, kv_cache_tokens=4096, kv_cache_dtype=kv_dtype)
    base = run_turns(ref, prompts, 2)
    warm = [ref.generate([p], GREEDY)[0] for p in prompts]      # L1 hits on the turn-1 pages
    llm = make_llm(loaded, kv_cache_dtype=kv_dtype, host_cache_memory_gib=0.01)
    outs = run_turns(llm, prompts, 2)
    assert [[o.token_ids for o in s] for s in outs] == [[o.token_ids for o in s] for s in base]
    assert sum(o.cached_tokens_by_tier["l2"] for s in outs for o in s) > 0
    store = f"file:{tmp_path / 'kv'}"
    with make_llm(loaded, kv_cache_dtype=kv_dtype, cache_storage=store) as writer:
        run_turns(writer, prompts, 1)
    with make_llm(loaded, kv_cache_dtype=kv_dtype, cache_storage=store) as reader:
        again = run_turns(reader, prompts, 1)
    assert [s[0].token_ids for s in again] == [o.token_ids for o in warm]
    assert [s[0].cached_tokens_by_tier["l3"] for s in again] == [o.cached_tokens for o in warm]
    assert all(o.cached_tokens > 0 for o in warm)


def test_int8_page_orders_do_not_share_l3_pages(tiny_llama: Any, tmp_path: Any, monkeypatch) -> None:
    """Tiled int8 pages hold a page's bytes in another order than rows-order ones, so the layout is
    part of the L3 namespace: a rows-order engine finds none of a tiled engine's pages in shared
    storage, and a second tiled engine finds them."""
    prompts = sessions(3, 4 * P, seed=31)
    store = f"file:{tmp_path / 'kv'}"
    monkeypatch.setenv("TOKENMILL_KV_INT8_LAYOUT", "tiled")
    with make_llm(tiny_llama, kv_cache_dtype="int8", cache_storage=store) as writer:
        first = run_turns(writer, prompts, 1)
    monkeypatch.setenv("TOKENMILL_KV_INT8_LAYOUT", "rows")
    with make_llm(tiny_llama, kv_cache_dtype="int8", cache_storage=store) as rows:
        assert _l3_hits(run_turns(rows, prompts, 1)) == 0
    monkeypatch.setenv("TOKENMILL_KV_INT8_LAYOUT", "tiled")
    with make_llm(tiny_llama, kv_cache_dtype="int8", cache_storage=store) as tiled:
        again = run_turns(tiled, prompts, 1)
    assert _l3_hits(again) > 0
    assert [s[0].token_ids for s in again] == [s[0].token_ids for s in first]
