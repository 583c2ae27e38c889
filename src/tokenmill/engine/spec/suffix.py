"""Suffix speculation (after SuffixDecoding, arXiv 2411.04975), for agent-style workloads.

Two indexes of the same kind, a *suffix trie of bounded depth*: every window of at most
``max_depth`` consecutive tokens of the indexed sequences is a path from the root, and each
node counts how often its path occurred. From a node, the most frequent child is the most
likely continuation and ``child.count / node.count`` estimates its probability.

* a per-request trie over the request's prompt + output except its last token (whose windows
  have no continuation yet), extended by the new tokens each step (``O(max_depth)`` dictionary
  steps per token) and dropped when the request leaves;
* a global trie over the outputs of recently finished requests, holding at most
  ``max_global_tokens`` tokens; the oldest output is removed (its counts decremented, empty
  nodes deleted) when a new one would exceed the bound, so memory stays bounded.

Proposing: find the longest suffix of the context (at most ``max_depth // 2`` tokens) that is
a path of the trie, then walk the most frequent children while the estimated probability of
the whole draft stays above ``min_prob``; the draft is at most ``2 x`` the match length (a long
match earns a long draft) and at most ``k``. Both tries are asked; the draft with the larger
expected number of accepted tokens (the sum of its prefix probabilities) wins.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from typing import TYPE_CHECKING

from tokenmill.engine.spec.base import Draft, Proposer, copy_confidence, match_confidence

if TYPE_CHECKING:
    from tokenmill.engine.request import Request


class _Node:
    __slots__ = ("count", "children")

    def __init__(self) -> None:
        self.count = 0
        self.children: dict[int, _Node] = {}


class SuffixTrie:
    """Counts of every window of up to ``max_depth`` tokens of the sequences added."""

    def __init__(self, max_depth: int) -> None:
        if max_depth < 2:
            raise ValueError(f"max_depth must be >= 2, got {max_depth}")
        self.max_depth = max_depth
        self.root = _Node()
        self.num_nodes = 0
        self._open: list[tuple[_Node, int]] = []   # windows still growing: (node, depth)

    # -- building --------------------------------------------------------------------------------
    def extend(self, tokens: Sequence[int]) -> None:
        """Append ``tokens`` to the current sequence (windows continue across calls)."""
        d_max = self.max_depth
        open_ = self._open
        for tok in tokens:
            grown = []
            for node, depth in open_:
                if depth < d_max:
                    grown.append((self._child(node, tok), depth + 1))
            grown.append((self._child(self.root, tok), 1))
            open_ = grown
        self._open = open_

    def end_sequence(self) -> None:
        """The next :meth:`extend` starts a new sequence (no window spans the boundary)."""
        self._open = []

    def _child(self, node: _Node, tok: int) -> _Node:
        child = node.children.get(tok)
        if child is None:
            child = node.children[tok] = _Node()
            self.num_nodes += 1
        child.count += 1
        return child

    def remove(self, tokens: Sequence[int]) -> None:
        """Undo an earlier :meth:`extend` of exactly ``tokens`` as a sequence of its own."""
        n = len(tokens)
        for i in range(n):
            node = self.root
            for j in range(i, min(n, i + self.max_depth)):
                child = node.children[tokens[j]]
                child.count -= 1
                if child.count == 0:
                    del node.children[tokens[j]]
                    self.num_nodes -= self._size(child)
                    break
                node = child

    @staticmethod
    def _size(node: _Node) -> int:
        stack, n = [node], 0
        while stack:
            x = stack.pop()
            n += 1
            stack.extend(x.children.values())
        return n

    # -- querying --------------------------------------------------------------------------------
    def match(self, context: Sequence[int], max_len: int) -> tuple[_Node | None, int]:
        """The node of the longest suffix of ``context`` (<= ``max_len`` tokens) in the trie.

        Every suffix of an indexed window is indexed too, so the matching lengths form a prefix
        of 1, 2, ...: a binary search finds the longest.
        """
        lo, hi, best = 1, min(max_len, len(context)), None
        while lo <= hi:
            mid = (lo + hi) // 2
            node = self._walk(context[len(context) - mid:])
            if node is not None:
                best, lo = (node, mid), mid + 1
            else:
                hi = mid - 1
        return best if best is not None else (None, 0)

    def _walk(self, path: Sequence[int]) -> _Node | None:
        node = self.root
        for tok in path:
            node = node.children.get(tok)  # type: ignore[assignment]
            if node is None:
                return None
        return node

    def continuation(self, node: _Node, max_tokens: int, min_prob: float,
                     ratios: list[float] | None = None) -> tuple[list[int], float]:
        """Most frequent path below ``node``; returns (tokens, expected accepted tokens).
        ``ratios``, when given, receives each token's ``child.count / node.count``."""
        out: list[int] = []
        prob, score = 1.0, 0.0
        while len(out) < max_tokens and node.children:
            tok, child = max(node.children.items(), key=lambda kv: kv[1].count)
            r = child.count / node.count
            p = prob * r
            if p < min_prob:
                break
            out.append(tok)
            if ratios is not None:
                ratios.append(r)
            prob, score, node = p, score + p, child
        return out, score


class SuffixProposer(Proposer):
    name = "suffix"
    drafts_then_cuts = True
    # first-draft acceptance assumed per match length (the draft's kind) until measured
    kind_first_prior = {1: 0.2, 2: 0.4, 3: 0.6, 4: 0.7, 5: 0.8}

    def __init__(self, max_depth: int = 16, max_global_tokens: int = 20_000, min_prob: float = 0.1) -> None:
        self.max_depth = max_depth
        self.max_global_tokens = max_global_tokens
        self.min_prob = min_prob
        self._local: dict[str, tuple[SuffixTrie, list[int]]] = {}   # request id -> (trie, [tokens indexed])
        self.global_trie = SuffixTrie(max_depth)
        self._global_seqs: deque[list[int]] = deque()
        self._global_tokens = 0

    def propose(self, requests: Sequence[Request], num_tokens: Sequence[int]) -> list[Draft]:
        drafts = []
        pattern_max = max(1, self.max_depth // 2)
        for req, k in zip(requests, num_tokens):
            if k <= 0:
                drafts.append(Draft([]))
                continue
            trie = self._local_trie(req)
            context = req.all_token_ids[-pattern_max:]
            best: list[int] = []
            best_score, best_m, best_ratios = 0.0, 0, []
            for t in (trie, self.global_trie):
                node, m = t.match(context, pattern_max)
                if node is None:
                    continue
                room = min(k, 2 * m, self.max_depth - m)
                ratios: list[float] = []
                toks, score = t.continuation(node, room, self.min_prob, ratios)
                if score > best_score:
                    best, best_score, best_m, best_ratios = toks, score, m, ratios
            # a token's confidence: how often a match as long as the one behind it (the
            # context's plus the drafts before it) continues correctly, times how often this
            # path's most frequent continuation is the one taken
            conf = copy_confidence(best, [match_confidence(best_m + j) * r for j, r in enumerate(best_ratios)],
                                   self.control_token_ids)
            drafts.append(Draft(best, kind=min(best_m, 8) if best else None, confidence=conf if best else None))
        return drafts

    def _local_trie(self, req: Request) -> SuffixTrie:
        entry = self._local.get(req.request_id)
        if entry is None:
            entry = self._local[req.request_id] = (SuffixTrie(self.max_depth), [0])
        trie, done = entry
        # all but the last token: a window ending at the last token has no continuation yet, and
        # indexing it would make the context's own end its longest "match", with nothing to draft
        n = len(req.all_token_ids) - 1
        if n > done[0]:
            trie.extend(req.all_token_ids[done[0]:n])
            done[0] = n
        return trie

    def request_finished(self, request: Request) -> None:
        self._local.pop(request.request_id, None)
        out = request.output_token_ids
        if not out or self.max_global_tokens == 0:
            return
        out = out[-self.max_global_tokens:]
        while self._global_seqs and self._global_tokens + len(out) > self.max_global_tokens:
            old = self._global_seqs.popleft()
            self.global_trie.remove(old)
            self._global_tokens -= len(old)
        self.global_trie.end_sequence()
        self.global_trie.extend(out)
        self.global_trie.end_sequence()
        self._global_seqs.append(out)
        self._global_tokens += len(out)
