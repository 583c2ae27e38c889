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
    """``n`` greedy tokens, recomputing the whole sequence each step (no EOS handling)."""
    seq = list(ids)
    out: list[int] = []
    for _ in range(n):
        tok = int(hf_logits(ref, seq)[-1].argmax())
        out.append(tok)
        seq.append(tok)
    return out


def random_prompts(lengths: list[int], seed: int = 0, vocab: int = 49152) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]
