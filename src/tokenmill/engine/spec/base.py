"""The proposer interface every speculative method implements, and its statistics.

A proposer guesses the next tokens of running requests; the engine verifies the guesses with
one target forward pass (:mod:`tokenmill.layers.speculative`), so a proposer can never change
what a request outputs, only how many tokens a step yields.

Contract (all calls come from the engine thread, in this order each step):

* :meth:`Proposer.observe` (learned drafters only, ``capture_layers`` non-empty): the target's
  hidden states for the tokens each request computed in the step just run, for the requests
  the step captured for (all of them unless ``resume_context`` is set: then only those that
  may draft soon, so a request's observed positions can have gaps);
* :meth:`Proposer.propose`: for each request, at most ``num_tokens[i]`` drafts (fewer, or none,
  is fine), with their draft distribution where the proposer has one;
* :meth:`Proposer.request_finished` once per request leaving the engine (free per-request state).
"""
from __future__ import annotations

import abc
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple

if TYPE_CHECKING:
    from tokenmill.engine.request import Request

# buckets of the acceptance-length histogram (tokens emitted per verified step)
ACCEPT_LENGTH_BUCKETS = (1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 24, 33)


class Draft(NamedTuple):
    token_ids: list[int]
    probs: Any = None      # torch.Tensor [len(token_ids), vocab] draft distribution, or None
    # a proposer-specific class of the draft (ngram, suffix: the length of the match it came
    # from, capped); adaptive k pools acceptance per kind over all requests
    # (:class:`KindStats`). None: the request's own moving averages decide.
    kind: int | None = None


class Proposer(abc.ABC):
    name: str = "abstract"
    # the proposer is cheap enough to run with the longest allowed draft every step and tags
    # its drafts with a ``kind``: adaptive k then cuts each draft after seeing it
    drafts_then_cuts: bool = False
    # what adaptive k assumes before it has seen any draft of a kind: the chance the first
    # draft is accepted, per kind (a missing kind uses the largest kind below it)
    kind_first_prior: dict[int, float] = {}
    # target layers whose hidden states the proposer reads (-1: the embedding output)
    capture_layers: frozenset[int] = frozenset()
    # learned drafters: how many recent positions a draft needs after capture was off (the
    # engine captures for a request only while its next possible draft is at most this many
    # steps away, and the proposer drafts from a context broken by a gap only once it holds
    # this many); 0: capture every step
    resume_context: int = 0
    # what adaptive k assumes at first about how often a request's first draft is accepted
    # (None: the engine's default); a drafter with a measured acceptance length sets it
    first_rate_prior: float | None = None

    @abc.abstractmethod
    def propose(self, requests: Sequence[Request], num_tokens: Sequence[int]) -> list[Draft]:
        """Up to ``num_tokens[i]`` draft tokens for ``requests[i]`` (one Draft per request)."""

    def observe(self, request: Request, start: int, hidden: Any) -> None:
        """Target hidden states ``hidden`` ([n, features]) of ``request``'s tokens at positions
        ``start .. start + n - 1`` (all accepted); learned drafters override it."""

    def request_finished(self, request: Request) -> None:
        """``request`` left the engine (finished or aborted): drop what is kept for it."""


class KindStats:
    """Acceptance per draft position for drafts of one kind, pooled over requests.

    ``p[j]``: the chance draft ``j`` (0-based) is accepted given that drafts ``0 .. j-1`` were,
    estimated from decayed counts plus a prior worth ``PRIOR_WEIGHT`` drafts (first position:
    ``first``, later positions: ``CONT_PRIOR``; copied text comes in runs, so once a draft holds
    the next usually does too). :meth:`gains` gives the chance each position is reached and
    accepted, which is what that row adds to the step's expected tokens.
    """

    PRIOR_WEIGHT = 3.0
    CONT_PRIOR = 0.8
    DECAY = 0.97        # weight kept by older drafts at each new draft of this kind

    __slots__ = ("reach", "hit", "prior")

    def __init__(self, k: int, first: float) -> None:
        self.prior = [first] + [self.CONT_PRIOR] * (k - 1)
        self.reach = [0.0] * k
        self.hit = [0.0] * k

    def record(self, num_draft: int, num_accepted: int) -> None:
        d = self.DECAY
        for j in range(len(self.reach)):
            self.reach[j] *= d
            self.hit[j] *= d
        for j in range(min(num_draft, num_accepted + 1, len(self.reach))):
            self.reach[j] += 1.0
            if j < num_accepted:
                self.hit[j] += 1.0

    def gains(self, n: int) -> list[float]:
        out: list[float] = []
        g = 1.0
        w = self.PRIOR_WEIGHT
        for j in range(min(n, len(self.reach))):
            g *= (self.hit[j] + w * self.prior[j]) / (self.reach[j] + w)
            out.append(g)
        return out


@dataclass
class SpecStats:
    """Counters of one engine's speculation (plain data: read by the server's metrics)."""

    method: str
    num_speculative_tokens: int
    proposed: int = 0           # draft tokens verified
    accepted: int = 0           # of which accepted
    verify_steps: int = 0       # request-steps that verified at least one draft
    emitted: int = 0            # tokens those steps emitted (accepted + 1 each)
    # acceptance-length histogram: counts per bucket upper bound (cumulative at render time)
    length_counts: list[int] = field(default_factory=lambda: [0] * len(ACCEPT_LENGTH_BUCKETS))
    position_proposed: list[int] = field(default_factory=list)
    position_accepted: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.position_proposed:
            self.position_proposed = [0] * self.num_speculative_tokens
            self.position_accepted = [0] * self.num_speculative_tokens

    def record(self, num_draft: int, num_accepted: int) -> None:
        self.proposed += num_draft
        self.accepted += num_accepted
        self.verify_steps += 1
        length = num_accepted + 1
        self.emitted += length
        for b, upper in enumerate(ACCEPT_LENGTH_BUCKETS):
            if length <= upper:
                self.length_counts[b] += 1
                break
        for j in range(min(num_draft, len(self.position_proposed))):
            self.position_proposed[j] += 1
            if j < num_accepted:
                self.position_accepted[j] += 1

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens emitted per verified step (1 = no draft ever accepted)."""
        return self.emitted / self.verify_steps if self.verify_steps else 0.0

    def snapshot(self) -> SpecStats:
        return SpecStats(self.method, self.num_speculative_tokens, self.proposed, self.accepted,
                         self.verify_steps, self.emitted, list(self.length_counts),
                         list(self.position_proposed), list(self.position_accepted))
