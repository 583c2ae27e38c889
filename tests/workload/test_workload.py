"""Workload generators: determinism, closed-loop prompts, Mooncake replay, theoretical CHR."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from tokenmill.workload import (AgenticWorkloadConfig, InfinitePrefixCache, TraceRecord, TraceReplayConfig,
                                      branch_prompt, first_prompt, load_mooncake_trace, make_session, make_sessions,
                                      next_prompt, poisson_arrivals, scaled_prompt_length, theoretical_hit_rate,
                                      theoretical_hit_rate_hash_ids, trace_requests)

TRACE = Path(__file__).resolve().parents[3] / "shared" / "data" / "mooncake" / "conversation_trace.jsonl"


def _tokens(s):  # everything that defines a session's requests
    return [(t.new_token_ids, t.output_tokens, t.think_time_s, t.is_user_turn, t.parallel_requests) for t in s.turns]


def test_sessions_are_fixed_by_seed() -> None:
    cfg = AgenticWorkloadConfig(min_turns_per_session=2, turns_per_session=6, thick_session_fraction=0.5,
                                user_turn_probability=0.3)
    a, b = make_sessions(cfg), make_sessions(cfg)
    assert [_tokens(s) for s in a] == [_tokens(s) for s in b]
    # same session whatever the order it is built in
    assert _tokens(make_session(cfg, 5)) == _tokens(a[5])
    other = make_sessions(AgenticWorkloadConfig(min_turns_per_session=2, turns_per_session=6,
                                                thick_session_fraction=0.5, user_turn_probability=0.3, seed=1))
    assert [_tokens(s) for s in a] != [_tokens(s) for s in other]
    # sessions differ from each other, share only the system prompt
    assert a[0].turns[0].new_token_ids != a[1].turns[0].new_token_ids
    assert a[0].shared_prompt_ids == a[1].shared_prompt_ids and len(a[0].shared_prompt_ids) == cfg.shared_prompt_tokens
    assert len({s.session_id for s in a}) == len(a)


def test_session_shape() -> None:
    cfg = AgenticWorkloadConfig(num_sessions=200, min_turns_per_session=2, turns_per_session=5,
                                thick_session_fraction=0.25, thick_session_parallel=3, user_turn_probability=0.2,
                                tool_think_median_s=0.1, user_think_median_s=5.0, max_think_s=20.0)
    sessions = make_sessions(cfg)
    turns = [s.num_turns for s in sessions]
    assert min(turns) == 2 and max(turns) == 5            # heterogeneous lengths, within bounds
    thick = [s for s in sessions if s.is_thick]
    assert 0.1 < len(thick) / len(sessions) < 0.4
    assert all(t.parallel_requests == 3 for s in thick for t in s.turns)
    later = [t for s in sessions for t in s.turns if t.index > 0]
    assert all(s.turns[0].think_time_s == 0 and s.turns[0].is_user_turn for s in sessions)
    user = [t.think_time_s for t in later if t.is_user_turn]
    tool = [t.think_time_s for t in later if not t.is_user_turn]
    assert 0.1 < len(user) / len(later) < 0.3
    assert all(0 <= x <= 20.0 for x in user + tool)
    assert sorted(tool)[len(tool) // 2] < 0.3 < sorted(user)[len(user) // 2]
    for s in sessions[:5]:
        assert len(s.turns[0].new_token_ids) == cfg.first_turn_tokens
        assert all(len(t.new_token_ids) == cfg.new_tokens_per_turn for t in s.turns[1:])
        assert all(cfg.vocab_low <= x < cfg.vocab_high for t in s.turns for x in t.new_token_ids)


def test_closed_loop_prompt_construction() -> None:
    cfg = AgenticWorkloadConfig(thick_session_fraction=1.0, thick_session_parallel=2, branch_tokens=4)
    s = make_session(cfg, 0)
    p0 = first_prompt(s)
    assert p0 == [*s.shared_prompt_ids, *s.turns[0].new_token_ids]
    assert len(p0) == cfg.planned_input_tokens(0)
    out = [7] * cfg.output_tokens_per_turn
    p1 = next_prompt(p0, out, s.turns[1].new_token_ids)
    assert p1[:len(p0)] == p0 and p1[len(p0):len(p0) + len(out)] == out
    assert p1[len(p0) + len(out):] == list(s.turns[1].new_token_ids)
    assert len(p1) == cfg.planned_input_tokens(1)
    b = branch_prompt(p1, s.turns[1], 1)
    assert b[:len(p1)] == p1 and len(b) == len(p1) + 4
    with pytest.raises(ValueError):
        s.turns[1].branch_suffix(2)


def test_production_preset_shape() -> None:
    cfg = AgenticWorkloadConfig.production()
    assert cfg.turns_per_session == 30 and cfg.output_tokens_per_turn == 500
    assert 95_000 <= cfg.planned_input_tokens(29) <= 105_000
    assert cfg.planned_input_tokens(29) / cfg.output_tokens_per_turn == pytest.approx(200, rel=0.05)


@pytest.mark.parametrize("kw", [dict(num_sessions=0), dict(turns_per_session=0), dict(min_turns_per_session=9),
                                dict(user_turn_probability=1.5), dict(vocab_low=10, vocab_high=10),
                                dict(tool_think_median_s=-1.0), dict(output_tokens_per_turn=0)])
def test_config_validation(kw: dict) -> None:
    with pytest.raises(ValueError):
        AgenticWorkloadConfig(**kw)


def _records() -> list[TraceRecord]:
    return [TraceRecord(0, 1024, 10, (1, 2)), TraceRecord(1000, 1300, 20, (1, 2, 3)),
            TraceRecord(3000, 700, 512, (1, 9)), TraceRecord(2000, 100, 5, (4,))]


def test_mooncake_shared_ids_give_identical_blocks() -> None:
    cfg = TraceReplayConfig(block_tokens=16, time_scale=2.0, max_output_tokens=None)
    reqs = trace_requests(_records(), cfg)
    p = [r.prompt_token_ids for r in reqs]
    assert p[0][:32] == p[1][:32]                  # ids 1, 2 shared
    assert p[0][:16] == p[2][:16]                  # id 1 shared
    assert p[2][16:] != p[1][16:16 + len(p[2]) - 16]  # id 9 != id 2
    assert p[3][:16] != p[0][:len(p[3])]
    # rescaled lengths: full blocks -> 16 tokens, tail in proportion
    assert [len(x) for x in p] == [32, 16 * 2 + round(276 * 16 / 512), 16 + round(188 * 16 / 512), round(100 / 32)]
    # time scaling (trace ms -> s, x2) and output scaling (x16/512)
    assert [r.arrival_s for r in reqs] == [0.0, 2.0, 6.0, 4.0]
    assert [r.output_tokens for r in reqs] == [max(1, round(10 / 32)), round(20 / 32), 16, max(1, round(5 / 32))]
    # request 1 extends request 0's whole prompt -> same session; request 2 does not
    assert reqs[1].session_id == reqs[0].session_id and reqs[2].session_id != reqs[0].session_id
    # deterministic, and the seed changes the blocks
    assert trace_requests(_records(), cfg) == reqs
    assert trace_requests(_records(), TraceReplayConfig(block_tokens=16, seed=1))[0].prompt_token_ids != p[0]


def test_block_rescaling_lengths() -> None:
    assert scaled_prompt_length(TraceRecord(0, 6758, 1, tuple(range(14))), 512) == 6758
    assert scaled_prompt_length(TraceRecord(0, 6758, 1, tuple(range(14))), 16) == 13 * 16 + 3   # tail 102 -> 3
    assert scaled_prompt_length(TraceRecord(0, 1024, 1, (1, 2)), 16) == 32                   # full tail block
    assert scaled_prompt_length(TraceRecord(0, 1, 1, (5,)), 16) == 1


def test_load_mooncake_trace_errors(tmp_path: Path) -> None:
    good = tmp_path / "t.jsonl"
    good.write_text("\n".join(json.dumps({"timestamp": i, "input_length": 600, "output_length": 3,
                                          "hash_ids": [0, i]}) for i in range(5)) + "\n")
    assert len(load_mooncake_trace(good)) == 5 and len(load_mooncake_trace(good, limit=2)) == 2
    bad = tmp_path / "b.jsonl"
    bad.write_text('{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [0]}\n{"oops": 1}\n')
    with pytest.raises(ValueError, match="line 2"):
        load_mooncake_trace(bad)


def test_poisson_arrivals() -> None:
    xs = poisson_arrivals(4000, 10.0, seed=3)
    assert xs == poisson_arrivals(4000, 10.0, seed=3) and xs[0] == 0.0
    gaps = [b - a for a, b in zip(xs, xs[1:])]
    assert all(g >= 0 for g in gaps)
    assert sum(gaps) / len(gaps) == pytest.approx(0.1, rel=0.1)
    with pytest.raises(ValueError):
        poisson_arrivals(3, 0.0)


def test_infinite_prefix_cache_token_and_block_level() -> None:
    c = InfinitePrefixCache(block_size=1)
    assert c.observe([1, 2, 3, 4]) == 0
    assert c.observe([1, 2, 3, 9]) == 3
    assert c.observe([1, 2, 3, 4, 5], output=[6, 7]) == 4
    assert c.lookup([1, 2, 3, 4, 5, 6, 7, 8]) == 7    # output was inserted too
    b = InfinitePrefixCache(block_size=2)
    b.insert([1, 2, 3, 4, 5])
    assert b.lookup([1, 2, 3, 4, 5]) == 4             # whole blocks only
    assert b.lookup([1, 2, 3, 9]) == 2
    s = theoretical_hit_rate([[1, 2, 3, 4], [1, 2, 3, 4, 5, 6], [9]])
    assert (s.cached_tokens, s.prompt_tokens) == (4, 11) and s.hit_rate == pytest.approx(4 / 11)


def _independent_block_chr(path: Path) -> tuple[int, int]:
    """Set of prefix tuples: a request hits its longest already-seen prefix of hash ids."""
    seen: set[tuple[int, ...]] = set()
    hit = total = 0
    with open(path) as f:
        for line in f:
            ids = tuple(json.loads(line)["hash_ids"])
            k = 0
            while k < len(ids) and ids[:k + 1] in seen:
                k += 1
            hit += k
            total += len(ids)
            for j in range(1, len(ids) + 1):
                seen.add(ids[:j])
    return hit, total


def test_theoretical_chr_on_mooncake_trace_matches_independent_computation() -> None:
    if not TRACE.exists():
        pytest.skip(f"{TRACE} not present")
    recs = load_mooncake_trace(TRACE)
    stats = theoretical_hit_rate_hash_ids(recs)
    hit, total = _independent_block_chr(TRACE)
    assert (stats.cached_blocks, stats.total_blocks) == (hit, total)
    assert stats.block_hit_rate == pytest.approx(hit / total)
    assert 0.2 < stats.block_hit_rate < 0.6
    assert stats.prompt_tokens == sum(r.input_length for r in recs)
    assert 0 < stats.token_hit_rate < 1
    # token-level CHR of the rescaled replay (block_tokens=16) with the token-id cache agrees
    # with the block-level count on hash ids rescaled the same way
    reqs = trace_requests(recs[:600], TraceReplayConfig(block_tokens=16))
    tok = theoretical_hit_rate([r.prompt_token_ids for r in reqs], block_size=16)
    ids16 = theoretical_hit_rate_hash_ids(recs[:600], block_tokens=16)
    full_block_hits = sum(min(h, len(r.prompt_token_ids) // 16) for h, r in zip(
        _per_request_hits(recs[:600]), reqs))
    assert tok.cached_tokens == 16 * full_block_hits
    assert ids16.prompt_tokens == tok.prompt_tokens


def _per_request_hits(recs: list[TraceRecord]) -> list[int]:
    seen: set[tuple[int, ...]] = set()
    out = []
    for r in recs:
        k = 0
        while k < len(r.hash_ids) and r.hash_ids[:k + 1] in seen:
            k += 1
        out.append(k)
        seen.update(r.hash_ids[:j] for j in range(1, len(r.hash_ids) + 1))
    return out


def test_lognormal_mean() -> None:
    cfg = AgenticWorkloadConfig(tool_think_median_s=1.0, tool_think_sigma=0.5)
    assert cfg.tool_think.mean_s == pytest.approx(math.exp(0.125))
