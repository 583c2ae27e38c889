"""One request alone and the same request inside a batch of 32 of mixed lengths give the same
logits (not just the same tokens) to within 1e-5, with both attention backends.

The other 31 sequences mix decodes over cached context, fresh prefills and prefill chunks
after cached context, so every attention path shares the step with the request under test.
"""
from __future__ import annotations

import copy
import random

import pytest
import torch

from tests.models.paged_driver import PagedDriver
from tokenmill.layers.linear import OneDNNLinear, onednn_available, use_linear_backend


def _tokens(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(vocab) for _ in range(n)]


@pytest.mark.parametrize("linear", ["torch", "onednn"])
@pytest.mark.parametrize("backend", ["torch", "native"])
@pytest.mark.parametrize("shape", ["decode", "chunk_after_context", "fresh_prefill"])
def test_alone_equals_in_a_batch_of_32(tiny_pairs, backend, shape, linear):
    loaded, _ = tiny_pairs["LlamaForCausalLM"]
    model, vocab = loaded.model, loaded.model.args.vocab_size
    use_linear_backend(model, "torch")   # the shared fixture may have been packed by an engine
    if linear == "onednn":
        if not onednn_available():
            pytest.skip("this torch build has no oneDNN")
        model = copy.deepcopy(model)
        assert use_linear_backend(model, "onednn") > 0
        assert isinstance(model.layers[0].qkv_proj, OneDNNLinear)
    rng = random.Random(11)
    history = _tokens(rng, 37, vocab)
    step_tokens = {"decode": _tokens(rng, 1, vocab), "chunk_after_context": _tokens(rng, 9, vocab),
                   "fresh_prefill": _tokens(rng, 23, vocab)}[shape]
    if shape == "fresh_prefill":
        history = []
    others = []
    for i in range(31):   # (earlier context, this step's tokens): decodes, fresh prefills, chunks
        kind = i % 3
        ctx = rng.randrange(5, 60) if kind != 1 else 0
        n = 1 if kind == 0 else rng.randrange(2, 20)
        others.append((f"o{i}", _tokens(rng, ctx, vocab), _tokens(rng, n, vocab)))

    alone = PagedDriver(model, num_pages=700, page_size=4, backend=backend)
    if history:
        alone.step([("me", history)])
    want = alone.step([("me", step_tokens)], all_rows=True)

    batched = PagedDriver(model, num_pages=700, page_size=4, seed=5, backend=backend)
    warm = [(name, ctx) for name, ctx, _ in others if ctx] + ([("me", history)] if history else [])
    batched.step(warm)
    chunks = [(name, toks) for name, _, toks in others[:16]] + [("me", step_tokens)] + \
             [(name, toks) for name, _, toks in others[16:]]
    got_all = batched.step(chunks, all_rows=True)
    start = sum(len(t) for _, t in chunks[:16])
    got = got_all[start:start + len(step_tokens)]
    assert got.shape == want.shape
    assert (got - want).abs().max().item() <= 1e-5
    assert torch.equal(got.argmax(-1), want.argmax(-1))
