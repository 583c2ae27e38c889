"""The default model, SmolLM2-135M-Instruct, through the GGUF loader against HF transformers on the
same dequantized weights."""
from __future__ import annotations

from paged_driver import PagedDriver, hf_logits

PROMPTS = [
    "What is the capital of France?",
    "Write a Python function that reverses a string.",
    "List three colours of the rainbow.",
    "Explain what a hash map is in one sentence.",
]


def _chat_ids(tokenizer, text: str) -> list[int]:
    ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                        tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def test_default_model_loads_from_gguf(smollm2):
    loaded, _ = smollm2
    assert loaded.source.suffix == ".gguf" and loaded.source.is_file()
    assert loaded.name == "smollm2-135m-instruct"
    assert loaded.hf_config.architectures == ["LlamaForCausalLM"]
    assert loaded.hf_config.tie_word_embeddings is True
    assert loaded.model.lm_head is loaded.model.embed_tokens
    assert loaded.max_model_len == 8192
    assert loaded.eos_token_ids == [loaded.tokenizer.convert_tokens_to_ids("<|im_end|>")]
    assert "<|im_start|>" in loaded.tokenizer.chat_template
    spec = loaded.model.kv_cache_spec()
    assert (spec.num_layers, spec.layers[0].num_kv_heads, spec.layers[0].head_dim) == (30, 3, 64)


def test_prefill_and_greedy_decode_match_hf(smollm2):
    """All prompts prefilled in one batch, then 24 batched greedy decode steps; every chosen token
    must be HF's argmax on the same prefix, and prefill logits must agree closely."""
    loaded, ref = smollm2
    prompts = [_chat_ids(loaded.tokenizer, p) for p in PROMPTS]
    drv = PagedDriver(loaded.model, num_pages=64, page_size=16)
    logits = drv.step([(str(i), p) for i, p in enumerate(prompts)])
    for i, p in enumerate(prompts):
        theirs = hf_logits(ref, p)[-1]
        assert (logits[i] - theirs).abs().max().item() < 1e-3
        assert int(logits[i].argmax()) == int(theirs.argmax())
    outs: list[list[int]] = [[] for _ in prompts]
    for _ in range(24):
        nxt = [int(row.argmax()) for row in logits]
        for o, t in zip(outs, nxt):
            o.append(t)
        logits = drv.step([(str(i), [t]) for i, t in enumerate(nxt)])
    for p, out in zip(prompts, outs):
        full = hf_logits(ref, p + out)
        hf_choice = full[len(p) - 1:-1].argmax(-1).tolist()
        assert out == hf_choice
    # The weights are right, not just equal on both sides: llama.cpp's Q/K row permutation is undone.
    assert "Paris" in loaded.tokenizer.decode(outs[0])
