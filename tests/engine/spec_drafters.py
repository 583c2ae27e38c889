"""Proposers the speculative-decoding tests share."""
from __future__ import annotations

import torch

from tokenmill.engine.spec.base import Draft, Proposer


class BadSampledDrafter(Proposer):
    """Drafts sampled from a fixed distribution q over a few candidates, unlike the target's p
    (the candidates may lie outside a grammar: the tests under constraints pass such ones)."""

    name = "bad"

    def __init__(self, candidates: list[int], vocab: int, seed: int = 0) -> None:
        weights = torch.linspace(1.0, 3.0, len(candidates))  # skewed the wrong way on purpose
        self.q = torch.zeros(vocab)
        self.q[torch.tensor(candidates)] = weights / weights.sum()
        self.gen = torch.Generator().manual_seed(seed)

    def propose(self, requests, num_tokens):
        out = []
        for k in num_tokens:
            toks = torch.multinomial(self.q, k, replacement=True, generator=self.gen).tolist()
            out.append(Draft(toks, self.q.expand(k, -1).clone()))
        return out
