"""DeepSeek-V3 (MLA + MoE) through the engine: greedy equals HF, and batching, chunked prefill,
prefix hits and preemption never change it."""
from __future__ import annotations

import pytest

from engine_oracle import hf_greedy, random_prompts
from tokenmill import LLM, SamplingParams
from tokenmill.loader import build_hf_reference, load_model
from tokenmill.loader.tiny import build_tiny_checkpoint

GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
PROMPTS = random_prompts([37, 3, 18, 64, 7, 29], seed=5)


@pytest.fixture(scope="module")
def kimi_like(tmp_path_factory):
    """Kimi K2's router setting (one expert group) with no query compression and no dense layer."""
    path = build_tiny_checkpoint(tmp_path_factory.mktemp("kimi"), "DeepseekV3ForCausalLM", seed=4,
                                 q_lora_rank=None, n_group=1, topk_group=1, first_k_dense_replace=0)
    lm = load_model(str(path))
    return lm, build_hf_reference(lm)


@pytest.fixture(scope="module")
def alone(tiny_model) -> list[list[int]]:
    lm, _ = tiny_model("DeepseekV3ForCausalLM")
    llm = LLM(loaded=lm, kv_cache_tokens=2048, enable_prefix_cache=False)
    return [llm.generate([p], GREEDY)[0].token_ids for p in PROMPTS]


def test_alone_matches_hf(tiny_model, alone) -> None:
    _, ref = tiny_model("DeepseekV3ForCausalLM")
    assert [hf_greedy(ref, p, GREEDY.max_tokens) for p in PROMPTS] == alone


def test_kimi_like_mixed_batch_matches_hf(kimi_like) -> None:
    lm, ref = kimi_like
    llm = LLM(loaded=lm, kv_cache_tokens=1024, enable_prefix_cache=False, debug_checks=True)
    outs = llm.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == [hf_greedy(ref, p, GREEDY.max_tokens) for p in PROMPTS]


def test_batch_equals_alone(tiny_model, alone) -> None:
    lm, _ = tiny_model("DeepseekV3ForCausalLM")
    llm = LLM(loaded=lm, kv_cache_tokens=2048, enable_prefix_cache=False)
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == alone


def test_chunked_prefill_of_seven_with_prefix_hits(tiny_model, alone) -> None:
    lm, _ = tiny_model("DeepseekV3ForCausalLM")
    llm = LLM(loaded=lm, kv_cache_tokens=2048, max_batch_tokens=7, debug_checks=True)
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == alone
    again = llm.generate([PROMPTS[3], PROMPTS[0]], GREEDY)  # whole pages of both are cached now
    assert [o.token_ids for o in again] == [alone[3], alone[0]]
    assert again[0].cached_tokens >= 48 and again[1].cached_tokens >= 32


@pytest.mark.parametrize("prefix_cache", [False, True])
def test_preemption_keeps_outputs(tiny_model, alone, prefix_cache: bool) -> None:
    lm, _ = tiny_model("DeepseekV3ForCausalLM")
    # 5 pages of 16 tokens: the longest request alone needs all 5, so requests must be preempted.
    llm = LLM(loaded=lm, kv_cache_tokens=80, enable_prefix_cache=prefix_cache, debug_checks=True)
    outs = llm.generate(PROMPTS, GREEDY)
    assert llm.engine.num_preemptions > 0
    assert [o.token_ids for o in outs] == alone
    llm.engine.check_pages()
