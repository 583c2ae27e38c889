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


MAX_KIND = 8   # matches are measured up to this many tokens (the draft's kind)


def ngram_lookup(tokens: np.ndarray, min_n: int, max_n: int, k: int) -> list[int]:
    """Tokens that followed the most recent earlier occurrence of the longest matching suffix."""
    return ngram_match(tokens, min_n, max_n, k)[0]


def ngram_match(tokens: np.ndarray, min_n: int, max_n: int, k: int) -> tuple[list[int], int]:
    """:func:`ngram_lookup`'s draft and how long the match really is: the matched suffix
    extended backwards while the two contexts agree, up to ``MAX_KIND`` tokens (0: no match).
    A long match is a copy in progress, whose next tokens are far likelier to hold."""
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
            h = int(hits[-1])
            length = n
            m = min(MAX_KIND - n, h)
            if m > 0:   # extend backwards: tokens before the hit vs tokens before the suffix
                same = tokens[h - m:h][::-1] == tokens[size - n - m:size - n][::-1]
                length += m if same.all() else int(np.argmin(same))
            start = h + n
            return tokens[start:start + k].tolist(), length
    return [], 0


class NgramProposer(Proposer):
    name = "ngram"
    drafts_then_cuts = True
    # first-draft acceptance assumed per match length until measured (a 2-token match is often
    # a coincidence; a longer one usually a copy)
    kind_first_prior = {1: 0.25, 2: 0.4, 3: 0.6, 4: 0.7, 5: 0.8}

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
            draft, length = ngram_match(tokens, self.min_n, self.max_n, k)
            drafts.append(Draft(draft, kind=length if draft else None))
        return drafts

    def request_finished(self, request: Request) -> None:
        self._buffers.pop(request.request_id, None)
