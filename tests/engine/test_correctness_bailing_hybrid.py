"""Ling (BailingHybrid: KDA linear layers + MLA + MoE) through the engine: greedy equals HF for a
batch of mixed-length prompts, and chunked prefill and preemption (which frees and later refills
both the pages and the state slot) never change it."""
from __future__ import annotations

import pytest

from engine_oracle import hf_greedy, random_prompts
from tokenmill import LLM, SamplingParams
from tokenmill.loader import build_hf_reference, load_model
from tokenmill.loader.tiny import build_tiny_checkpoint

ARCH = "BailingHybridForCausalLM"
GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
PROMPTS = random_prompts([37, 3, 18, 64, 7, 29], seed=5)


@pytest.fixture(scope="module")
def group3(tmp_path_factory):
    """A second layer pattern: groups of 3 (KDA, KDA, MLA, KDA, KDA), every MLP dense."""
    path = build_tiny_checkpoint(tmp_path_factory.mktemp("ling3"), ARCH, seed=4, num_hidden_layers=5,
                                 layer_group_size=3, first_k_dense_replace=5)
    lm = load_model(str(path))
    return lm, build_hf_reference(lm)


@pytest.fixture(scope="module")
def oracle(tiny_model) -> list[list[int]]:
    _, ref = tiny_model(ARCH)
    return [hf_greedy(ref, p, GREEDY.max_tokens) for p in PROMPTS]


def test_mixed_batch_matches_hf(tiny_model, oracle) -> None:
    lm, _ = tiny_model(ARCH)
    llm = LLM(loaded=lm, kv_cache_tokens=2048, enable_prefix_cache=False, debug_checks=True)
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == oracle


def test_second_layer_pattern_mixed_batch_matches_hf(group3) -> None:
    lm, ref = group3
    llm = LLM(loaded=lm, kv_cache_tokens=2048, enable_prefix_cache=False, debug_checks=True)
    outs = llm.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == [hf_greedy(ref, p, GREEDY.max_tokens) for p in PROMPTS]


def test_chunked_prefill_of_seven(tiny_model, oracle) -> None:
    """Every prompt is prefilled 7 tokens per step, each chunk continuing from the state the last
    one left in the request's slot, beside other requests' decodes."""
    lm, _ = tiny_model(ARCH)
    llm = LLM(loaded=lm, kv_cache_tokens=2048, max_batch_tokens=7, enable_prefix_cache=False, debug_checks=True)
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == oracle


@pytest.mark.parametrize("prefix_cache", [False, True])
def test_preemption_keeps_outputs(tiny_model, oracle, prefix_cache: bool) -> None:
    lm, _ = tiny_model(ARCH)
    # 5 pages of 16 tokens: the longest request alone needs all 5, so requests must be preempted.
    llm = LLM(loaded=lm, kv_cache_tokens=80, enable_prefix_cache=prefix_cache, debug_checks=True)
    outs = llm.generate(PROMPTS, GREEDY)
    assert llm.engine.num_preemptions > 0
    assert [o.token_ids for o in outs] == oracle
    llm.engine.check_pages()


def test_few_state_slots_queue_requests_without_changing_outputs(tiny_model, oracle) -> None:
    """Two request slots for six prompts: admission waits for a free slot (pages are plentiful)."""
    lm, _ = tiny_model(ARCH)
    llm = LLM(loaded=lm, kv_cache_tokens=2048, max_running_requests=2, enable_prefix_cache=False,
              debug_checks=True)
    assert llm.engine.kv.slots.num_request_slots == 2
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == oracle
    assert llm.engine.kv.slots.num_free() == 2


def test_prefix_cache_hits_match_hf(tiny_model, oracle) -> None:
    """Prefix caching on (state snapshots): the first pass, prefilled in chunks of 7, equals HF; then
    two follow-up turns (prompt + output + 5 new tokens) start from their cached prefixes (the
    attention pages plus the linear layers' state restored from the snapshot at the last page
    boundary the first turn computed) and still equal HF."""
    lm, ref = tiny_model(ARCH)
    llm = LLM(loaded=lm, kv_cache_tokens=2048, max_batch_tokens=7, debug_checks=True)
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == oracle
    turns = [PROMPTS[i] + oracle[i] + random_prompts([5], seed=60 + i)[0] for i in (3, 0)]
    again = llm.generate(turns, GREEDY)
    assert [o.token_ids for o in again] == [hf_greedy(ref, t, GREEDY.max_tokens) for t in turns]
    assert [o.cached_tokens for o in again] == [64, 32]   # 64 + 9 and 37 + 9 computed, pages of 16
