"""HF-transformers oracles used by the engine tests (full forward passes, no KV cache)."""
from __future__ import annotations

import random

import torch


@torch.no_grad()
def hf_logits(ref: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    """fp32 logits [len(ids), vocab] of the HF model over ``ids``."""
    return ref(torch.tensor([ids])).logits[0].float()


@torch.no_grad()
def hf_greedy(ref: torch.nn.Module, ids: list[int], n: int) -> list[int]:
    """``n`` greedy tokens from HF's own incremental decoding (its KV cache; no EOS handling)."""
    out = ref(torch.tensor([ids]), use_cache=True)
    tokens: list[int] = []
    for i in range(n):
        tok = int(out.logits[0, -1].argmax())
        tokens.append(tok)
        if i + 1 < n:
            out = ref(torch.tensor([[tok]]), past_key_values=out.past_key_values, use_cache=True)
    return tokens


def random_prompts(lengths: list[int], seed: int = 0, vocab: int = 49152) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]
