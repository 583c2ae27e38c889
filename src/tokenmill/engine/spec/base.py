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
    # per draft token: the proposer's estimate of the chance that it is accepted given that the
    # drafts before it were (model-free proposers: from the match behind it). It never changes
    # verification; the engine's draft gate (:class:`ConfidenceCalibration`) calibrates it
    # against the acceptance it observes and sends only the prefix that pays for its rows.
    confidence: Sequence[float] | None = None


# the chance that a token copied from an earlier occurrence of the context is right, by how
# many tokens of context that occurrence matches (1, 2, ..., 8 or more; the drafts before a
# token count as matched: they are accepted when it is reached). Measured with suffix and
# n-gram drafts at every position of the default model's greedy answers to held-out agent
# turns and prose prompts (none of the benchmark's): agent 0.23 / 0.56 / 0.77 / 0.81 / 0.87 /
# 0.91 / 0.87 / 0.94, prose 0.19 / 0.29 / 0.48 / 0.64 / 0.51 / 0.78 / 0.47 / 0.75; this is
# a smoothed mean of the two, on the low side (a miss costs a multi-row step), and the draft
# gate corrects it online for the workload at hand.
MATCH_CONFIDENCE = (0.18, 0.4, 0.55, 0.65, 0.7, 0.75, 0.8, 0.88)


def match_confidence(length: int) -> float:
    """:data:`MATCH_CONFIDENCE` for a match of ``length`` tokens (>= 1)."""
    return MATCH_CONFIDENCE[min(max(length, 1), len(MATCH_CONFIDENCE)) - 1]


# a control token (EOS, a chat template's turn markers) copied from the context: the copy runs
# across a turn boundary of the context (a prompt restating the question ends where the
# answer goes on), which the output seldom repeats
CONTROL_CONFIDENCE = 0.05


def copy_confidence(tokens: Sequence[int], confidence: list[float], control: frozenset[int]) -> list[float]:
    """``confidence`` with each token of ``control`` capped at :data:`CONTROL_CONFIDENCE`."""
    if control:
        for j, t in enumerate(tokens):
            if t in control:
                confidence[j] = min(confidence[j], CONTROL_CONFIDENCE)
    return confidence


class Proposer(abc.ABC):
    name: str = "abstract"
    # the proposer is cheap enough to run with the longest allowed draft every step and tags
    # its drafts with a ``kind``: adaptive k then cuts each draft after seeing it
    drafts_then_cuts: bool = False
    # what adaptive k assumes before it has seen any draft of a kind: the chance the first
    # draft is accepted, per kind (a missing kind uses the largest kind below it)
    kind_first_prior: dict[int, float] = {}
    # the model's control tokens (EOS, chat-template markers; the engine sets them): a
    # model-free proposer states a low confidence for copying one (:func:`copy_confidence`)
    control_token_ids: frozenset[int] = frozenset()
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


class ConfidenceCalibration:
    """The draft gate's calibration: a proposer's per-token confidence -> the acceptance rate
    observed for tokens of about that confidence, pooled over requests.

    Two levels, both from decayed counts of the verified drafts (a token counts once it is
    *reached*: sent, with every draft before it accepted):

    * a *scale* shared by all confidences: tokens accepted over the sum of their stated
      confidences, shrunk towards 1 by ``SCALE_WEIGHT`` tokens' worth of prior. A workload
      that copies less than the proposer assumes (free prose) or more (an agent quoting its
      input) moves every confidence at once, after a handful of drafts;
    * a *bias* per confidence bucket (``BUCKETS`` equal buckets over [0, 1]): what the bucket's
      tokens were accepted beyond their scaled confidences, shrunk towards none while the
      bucket has few observations (``PRIOR_WEIGHT``), so a proposer too sure in one range
      alone is corrected there, and the order of confidences inside a bucket is kept.

    A token of confidence ``c`` is believed with ``scale * c + bias``, clipped to
    [``FLOOR``, ``CEIL``]. :meth:`gains` multiplies the calibrated rates along a draft: the
    chance each position is reached and accepted, what its row adds to the step's expected
    tokens.
    """

    BUCKETS = 10
    PRIOR_WEIGHT = 4.0
    SCALE_WEIGHT = 10.0
    DECAY = 0.99        # weight kept by older observations at each new verified draft
    FLOOR, CEIL = 0.01, 0.99

    __slots__ = ("reached", "accepted", "stated")

    def __init__(self) -> None:
        self.reached = [0.0] * self.BUCKETS
        self.accepted = [0.0] * self.BUCKETS
        self.stated = [0.0] * self.BUCKETS

    def _bucket(self, c: float) -> int:
        return min(max(int(c * self.BUCKETS), 0), self.BUCKETS - 1)

    @property
    def scale(self) -> float:
        w = self.SCALE_WEIGHT
        return (sum(self.accepted) + w) / (sum(self.stated) + w)

    def rate(self, c: float, scale: float | None = None) -> float:
        """The calibrated chance that a draft of confidence ``c`` is accepted when reached."""
        s = self.scale if scale is None else scale
        b = self._bucket(c)
        bias = (self.accepted[b] - s * self.stated[b]) / (self.reached[b] + self.PRIOR_WEIGHT)
        return min(max(s * c + bias, self.FLOOR), self.CEIL)

    def gains(self, confidence: Sequence[float]) -> list[float]:
        out: list[float] = []
        g = 1.0
        s = self.scale
        for c in confidence:
            g *= self.rate(c, s)
            out.append(g)
        return out

    def record(self, confidence: Sequence[float], num_draft: int, num_accepted: int) -> None:
        """A draft with these confidences was verified: ``num_draft`` sent, the first
        ``num_accepted`` of them accepted."""
        d = self.DECAY
        for b in range(self.BUCKETS):
            self.reached[b] *= d
            self.accepted[b] *= d
            self.stated[b] *= d
        for j in range(min(num_draft, num_accepted + 1, len(confidence))):
            c = confidence[j]
            b = self._bucket(c)
            self.reached[b] += 1.0
            self.stated[b] += c
            if j < num_accepted:
                self.accepted[b] += 1.0


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
