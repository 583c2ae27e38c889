"""Prompt lookup (n-gram) drafting: find the context's last ``n`` tokens earlier in the
request's own prompt + output and propose what followed them.

``n`` runs from ``max_n`` down to ``min_n``; the first ``n`` with a match wins, and among its
matches the most recent one (agent output tends to continue what it quoted last). The proposer
keeps a per-request index of its n-grams that grows by the new tokens only, so a step costs a
few dictionary probes, never a pass over the context; :func:`ngram_match` is the same search
vectorised with numpy over a whole array (the reference the tests compare the index with).
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from tokenmill.engine.spec.base import Draft, Proposer, copy_confidence, match_confidence

if TYPE_CHECKING:
    from tokenmill.engine.request import Request


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


class _NgramIndex:
    """A request's n-grams (``min_n .. max_n`` tokens) -> where the latest occurrence that has
    a following token ends. Grows by the new tokens only (tokens are only ever appended:
    rejected drafts never enter a request's tokens), so a lookup is ``max_n - min_n + 1``
    dictionary probes whatever the context length."""

    __slots__ = ("min_n", "max_n", "maps", "next_end")

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n, self.max_n = min_n, max_n
        self.maps: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in range(min_n, max_n + 1)}
        self.next_end = 0   # windows ending before this index are in the maps

    def lookup(self, tokens: list[int], k: int) -> tuple[list[int], int]:
        """Same result as :func:`ngram_match` over ``tokens``."""
        size = len(tokens)
        # windows that end at e <= size - 1 (a token follows them); the context's own suffix
        # ends at size and is never indexed
        for e in range(max(self.next_end, self.min_n), size):
            for n in range(self.min_n, min(self.max_n, e) + 1):
                self.maps[n][tuple(tokens[e - n:e])] = e
        self.next_end = max(self.next_end, size)
        for n in range(min(self.max_n, size - 1), self.min_n - 1, -1):
            e = self.maps[n].get(tuple(tokens[size - n:]))
            if e is None:
                continue
            length = n
            h, tail = e - n, size - n    # the match starts at h; the context's suffix at tail
            while length < MAX_KIND and h > 0 and tokens[h - 1] == tokens[tail - 1]:
                h, tail, length = h - 1, tail - 1, length + 1
            return tokens[e:e + k], length
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
        self._index: dict[str, _NgramIndex] = {}

    def propose(self, requests: Sequence[Request], num_tokens: Sequence[int]) -> list[Draft]:
        drafts = []
        for req, k in zip(requests, num_tokens):
            if k <= 0:
                drafts.append(Draft([]))
                continue
            index = self._index.get(req.request_id)
            if index is None:
                index = self._index[req.request_id] = _NgramIndex(self.min_n, self.max_n)
            draft, length = index.lookup(req.all_token_ids, k)
            # a copied token is as likely as a match of the length behind it (the drafts
            # before it included) is to go on
            conf = (copy_confidence(draft, [match_confidence(length + j) for j in range(len(draft))],
                                    self.control_token_ids) if draft else None)
            drafts.append(Draft(draft, kind=length if draft else None, confidence=conf))
        return drafts

    def request_finished(self, request: Request) -> None:
        self._index.pop(request.request_id, None)
