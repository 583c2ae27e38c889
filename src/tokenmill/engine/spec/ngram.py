"""Prompt lookup (n-gram) drafting: find the context's last ``n`` tokens earlier in the
request's own prompt + output and propose what followed them.

``n`` runs from ``max_n`` down to ``min_n``; the first ``n`` with a match wins, and among its
matches the most recent one (agent output tends to continue what it quoted last). The search is
vectorised with numpy over a per-request token buffer that grows by the new tokens only, so a
step costs a few array comparisons, never a Python loop over the context.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from tokenmill.engine.spec.base import Draft, Proposer

if TYPE_CHECKING:
    from tokenmill.engine.request import Request


class _TokenBuffer:
    """A request's tokens as a growable int32 array (amortised O(1) append)."""

    __slots__ = ("data", "size")

    def __init__(self) -> None:
        self.data = np.empty(256, dtype=np.int32)
        self.size = 0

    def sync(self, tokens: list[int]) -> np.ndarray:
        n = len(tokens)
        if n > self.data.shape[0]:
            grown = np.empty(max(n, 2 * self.data.shape[0]), dtype=np.int32)
            grown[: self.size] = self.data[: self.size]
            self.data = grown
        if n > self.size:
            self.data[self.size:n] = tokens[self.size:n]
            self.size = n
        return self.data[:n]


def ngram_lookup(tokens: np.ndarray, min_n: int, max_n: int, k: int) -> list[int]:
    """Tokens that followed the most recent earlier occurrence of the longest matching suffix."""
    size = tokens.shape[0]
    for n in range(min(max_n, size - 1), min_n - 1, -1):
        pattern = tokens[size - n:]
        # windows starting at 0 .. size-n-1 (the suffix itself excluded)
        hay = tokens[: size - 1]
        if hay.shape[0] < n:
            continue
        windows = np.lib.stride_tricks.sliding_window_view(hay, n)
        hits = np.flatnonzero((windows == pattern).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return tokens[start:start + k].tolist()
    return []


class NgramProposer(Proposer):
    name = "ngram"

    def __init__(self, min_n: int = 2, max_n: int = 5) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got {min_n} and {max_n}")
        self.min_n, self.max_n = min_n, max_n
        self._buffers: dict[str, _TokenBuffer] = {}

    def propose(self, requests: Sequence[Request], num_tokens: Sequence[int]) -> list[Draft]:
        drafts = []
        for req, k in zip(requests, num_tokens):
            if k <= 0:
                drafts.append(Draft([]))
                continue
            buf = self._buffers.get(req.request_id)
            if buf is None:
                buf = self._buffers[req.request_id] = _TokenBuffer()
            tokens = buf.sync(req.all_token_ids)
            drafts.append(Draft(ngram_lookup(tokens, self.min_n, self.max_n, k)))
        return drafts

    def request_finished(self, request: Request) -> None:
        self._buffers.pop(request.request_id, None)
