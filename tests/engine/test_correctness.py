"""Greedy outputs equal HF transformers on the same weights; batching never changes them."""
from __future__ import annotations

import pytest
import torch

from engine_oracle import hf_greedy, random_prompts
from tokenmill import LLM, SamplingParams

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def test_smollm_gguf_greedy_matches_hf_generate(smollm) -> None:
    from tokenmill.loader import build_hf_reference

    prompts = ["The capital of France is", "def fibonacci(n):",
               "Here is a short poem about the sea:\n", "List three primary colors:"]
    llm = LLM(loaded=smollm, kv_cache_tokens=2048, debug_checks=True)
    params = [SamplingParams(max_tokens=32, temperature=0.0)] * 4
    # a fifth request: the first prompt again, past its EOS
    params.append(SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True))
    *outs, no_eos = llm.generate(prompts + prompts[:1], params)
    ref = build_hf_reference(smollm).eval()
    for prompt, out in zip(prompts, outs):
        ids = smollm.tokenizer(prompt, return_tensors="pt").input_ids
        with torch.no_grad():
            gen = ref.generate(ids, max_new_tokens=32, do_sample=False)
        expected = gen[0, ids.shape[1]:].tolist()
        assert out.token_ids == expected, prompt
        assert out.prompt_token_ids == ids[0].tolist()
        assert out.text == smollm.tokenizer.decode(out.token_ids, skip_special_tokens=True)
        assert out.finish_reason == ("stop" if expected[-1] in smollm.eos_token_ids else "length")
    eos_at = outs[0].token_ids.index(smollm.eos_token_ids[0])  # "Paris. ..." ends with EOS early
    assert outs[0].finish_reason == "stop" and eos_at < 31
    assert no_eos.token_ids[:eos_at + 1] == outs[0].token_ids and len(no_eos.token_ids) == 32
    assert no_eos.finish_reason == "length"


@pytest.mark.parametrize("arch", ["LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"])
def test_tiny_models_mixed_batch_greedy_matches_hf(tiny_model, arch: str) -> None:
    lm, ref = tiny_model(arch)
    prompts = random_prompts([5, 23, 1, 40, 16, 9], seed=1)
    llm = LLM(loaded=lm, kv_cache_tokens=1024, enable_prefix_cache=False, debug_checks=True)
    outs = llm.generate(prompts, GREEDY)
    for p, out in zip(prompts, outs):
        assert out.token_ids == hf_greedy(ref, p, GREEDY.max_tokens)
        assert out.finish_reason == "length"


class TestBatchInvariance:
    prompts = random_prompts([37, 3, 18, 64, 7, 29, 50, 12], seed=2)

    @pytest.fixture(scope="class")
    def alone(self, tiny_llama) -> list[list[int]]:
        lm, _ = tiny_llama
        llm = LLM(loaded=lm, kv_cache_tokens=2048, enable_prefix_cache=False)
        return [llm.generate([p], GREEDY)[0].token_ids for p in self.prompts]

    def test_alone_matches_hf(self, tiny_llama, alone) -> None:
        _, ref = tiny_llama
        assert alone[0] == hf_greedy(ref, self.prompts[0], GREEDY.max_tokens)

    def test_batch_of_eight_equals_alone(self, tiny_llama, alone) -> None:
        lm, _ = tiny_llama
        llm = LLM(loaded=lm, kv_cache_tokens=2048, enable_prefix_cache=False)
        assert [o.token_ids for o in llm.generate(self.prompts, GREEDY)] == alone

    @pytest.mark.parametrize("prefix_cache", [False, True])
    def test_chunked_prefill_of_seven_equals_unchunked(self, tiny_llama, alone, prefix_cache: bool) -> None:
        lm, _ = tiny_llama
        llm = LLM(loaded=lm, kv_cache_tokens=2048, max_batch_tokens=7, enable_prefix_cache=prefix_cache,
                  debug_checks=True)
        assert [o.token_ids for o in llm.generate(self.prompts, GREEDY)] == alone

    def test_identical_prompts_share_pages_during_chunked_prefill(self, tiny_llama, alone) -> None:
        lm, _ = tiny_llama
        llm = LLM(loaded=lm, kv_cache_tokens=2048, max_batch_tokens=7, debug_checks=True)
        outs = llm.generate([self.prompts[3]] * 3, GREEDY)  # 64-token prompt, chunks of 7
        assert [o.token_ids for o in outs] == [alone[3]] * 3
        assert max(o.cached_tokens for o in outs) > 0

    @pytest.mark.parametrize("prefix_cache", [False, True])
    def test_preemption_keeps_outputs(self, tiny_llama, alone, prefix_cache: bool) -> None:
        lm, _ = tiny_llama
        # 6 pages of 16 tokens: the longest request alone needs 5, so requests must be preempted.
        llm = LLM(loaded=lm, kv_cache_tokens=96, enable_prefix_cache=prefix_cache, debug_checks=True)
        outs = llm.generate(self.prompts, GREEDY)
        assert llm.engine.num_preemptions > 0
        assert [o.token_ids for o in outs] == alone
        llm.engine.check_pages()
