"""Request state inside the engine, and what the engine hands back per step.

A request's progress is two counters over one token list (``all_token_ids`` = prompt + output):

* ``num_computed_tokens``: leading tokens whose K/V sit in the request's pages;
* ``num_tokens``: the length of ``all_token_ids``.

Everything else is derived: a request still prefilling has ``num_tokens - num_computed_tokens > 1``;
a decoding one has exactly 1 (its last sampled token, whose K/V is written by the next step).
A step that brings ``num_computed_tokens`` up to ``num_tokens`` samples one new token.
Speculative decoding adds draft tokens *beside* that list (``spec_token_ids``): a decoding
request with ``k`` drafts is scheduled ``1 + k`` tokens; after verification the accepted drafts
and one more token are appended, and ``num_computed_tokens`` counts the accepted drafts (their
K/V was written by the step), so the request is again exactly one token behind. Rejected drafts
never enter ``all_token_ids``.
After preemption ``num_computed_tokens`` drops back (to the cached prefix, or 0) and the same rule
recomputes prompt + output so far.

Page ownership (``page_table``)::

    page_table: [ p0 p1 ... p(k-1) | pk ... ]
                  ^ num_tree_pages: owned by the radix cache, locked through cache_node
                                   ^ the rest: owned by this request alone, freed when it leaves
"""
from __future__ import annotations

import enum
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple, overload

from tokenmill.contracts.sampling import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class TopLogprob(NamedTuple):
    token_id: int
    logprob: float


class TokenLogprob(NamedTuple):
    """Log-probability of one sampled token, and the ``params.logprobs`` most likely ones."""

    token_id: int
    logprob: float
    top_logprobs: list[TopLogprob]


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    session_id: str | None = None
    arrival_index: int = 0
    all_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    page_table: list[int] = field(default_factory=list)
    num_tree_pages: int = 0
    cache_node: Any = None            # locked radix node, or None
    state_slot: int | None = None     # hybrid models: the state-pool slot held while running
    # hybrid models' prefix cache (engine/kv_manager.py): the locked snapshot slot to restore into
    # state_slot before the first step, the request's own latest snapshot (radix Snapshot), and
    # the positions (tokens, page boundaries) where a snapshot is to be taken
    snapshot_restore: int | None = None
    tail_snapshot: Any = None
    snapshot_cuts: list[int] = field(default_factory=list)
    num_cached_tokens: int | None = None  # prefix-cache hit at first admission
    cached_tokens_by_tier: dict[str, int] | None = None  # that hit split by tier (l1, l2, l3)
    tier_state: Any = None            # lower-tier bookkeeping (engine.kv_tiers.TierState)
    num_preemptions: int = 0
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    logprobs: list[TokenLogprob] | None = None
    deadline: float | None = None     # time.monotonic() by which it must finish (engine/admission.py)
    queue_deadline: float | None = None  # time.monotonic() by which it must first be admitted
    # a streamed request: the client sees each token as it comes, so its decodes bound the prefill
    # beside them (engine/step_cost.py); a non-streamed one is only seen whole, and its decodes
    # leave the step to throughput
    streamed: bool = True
    generator: Any = None             # the request's random stream (owned by the model runner)
    penalty_state: Any = None         # incremental penalty counts (owned by the model runner)
    detokenizer: Any = None           # incremental detokenizer (owned by the engine)
    # speculative decoding (engine/spec): drafts for the next step, and their draft
    # distribution ([len(drafts), vocab] tensor) when the proposer has one
    spec_token_ids: list[int] = field(default_factory=list)
    spec_probs: Any = None
    spec_kind: int | None = None      # the pending drafts' kind (Draft.kind), for adaptive k
    spec_confidence: list[float] | None = None   # the pending drafts' confidences (draft gate)
    spec_accept_rate: float = 0.5     # moving average of the share of drafts accepted
    spec_first_rate: float = 0.5      # moving average: the first draft of a step is accepted (adaptive k)
    spec_seen: bool = False           # the speculative decoder has set this request's starting estimates
    spec_continue_rate: float = 0.7   # moving average: a draft is accepted after an accepted one
    spec_steps_off: int = 0           # steps since the adaptive rule last let this request draft
    spec_probe_every: int = 8         # steps between probes while its drafts are poor (doubles per failure)
    num_draft_tokens: int = 0         # drafts verified for this request so far
    num_accepted_draft_tokens: int = 0
    # Hook for constrained decoding: called with (request, drafts), returns the prefix of the
    # drafts that the request's constraint (e.g. a grammar) allows; None: every draft allowed.
    draft_validator: Any = None
    grammar: Any = None               # GrammarState of a constrained request (engine/structured.py)
    prompt_logprobs: list[TokenLogprob | None] | None = None  # one per prompt token, first is None

    def __post_init__(self) -> None:
        if not self.all_token_ids:
            self.all_token_ids = list(self.prompt_token_ids)
        if self.params.logprobs is not None and self.logprobs is None:
            self.logprobs = []
        if self.params.prompt_logprobs is not None and self.prompt_logprobs is None:
            self.prompt_logprobs = [None]

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_token_ids) - len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> ListView:
        """The output tokens as of now: a view into ``all_token_ids`` (O(1), no copy)."""
        return ListView(self.all_token_ids, len(self.prompt_token_ids), len(self.all_token_ids))

    def append_token(self, token_id: int) -> None:
        self.all_token_ids.append(token_id)

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.all_token_ids) - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def cache_key(self, num_elements: int) -> Sequence[Any]:
        """A sequence whose first ``num_elements`` items are this request's prefix-cache key
        (read in place, not copied): its own token ids.

        A subclass may key each page by one element instead (the simulator's block ids), for a
        cache of ``page_size`` 1 (see :mod:`tokenmill.engine.kv_manager`).
        """
        return self.all_token_ids


class ListView(Sequence):
    """Items ``[start, stop)`` of a list that only grows: O(1) to make, a stable snapshot to read.

    The engine hands these out for the cumulative fields of unfinished outputs (and for a
    request's output tokens), so a step costs no copy of everything generated so far; a reader
    on another thread sees exactly the items that existed when the view was made.
    """

    __slots__ = ("_items", "_start", "_n")

    def __init__(self, items: list[Any], start: int, stop: int) -> None:
        self._items, self._start, self._n = items, start, stop - start

    def __len__(self) -> int:
        return self._n

    @overload
    def __getitem__(self, i: int) -> Any: ...
    @overload
    def __getitem__(self, i: slice) -> list[Any]: ...
    def __getitem__(self, i):  # noqa: E301
        if isinstance(i, slice):
            a, b, step = i.indices(self._n)
            if step != 1:
                return list(self)[i]
            return self._items[self._start + a:self._start + max(a, b)]
        if not -self._n <= i < self._n:
            raise IndexError("ListView index out of range")
        return self._items[self._start + i % self._n]

    def __iter__(self) -> Iterator[Any]:
        items, start = self._items, self._start
        for j in range(start, start + self._n):
            yield items[j]

    def __eq__(self, other: object) -> bool:
        if isinstance(other, (list, tuple, ListView)):
            return len(other) == self._n and all(a == b for a, b in zip(self, other))
        return NotImplemented

    def __repr__(self) -> str:
        return repr(list(self))


@dataclass
class RequestOutput:
    """State of one request after a step (cumulative fields plus the delta since the last one).

    The cumulative ``token_ids`` and ``logprobs`` of an unfinished output are :class:`ListView`
    snapshots and ``text`` is joined only when read, so making an output costs O(new tokens);
    a finished output holds plain lists and a plain string.
    """

    request_id: str
    prompt_token_ids: list[int]
    cached_tokens: int
    token_ids: Sequence[int]
    text_view: Any                       # str, or a TextView joined on first read of .text
    new_token_ids: list[int]
    new_text: str
    logprobs: Sequence[TokenLogprob] | None
    finished: bool
    finish_reason: str | None
    stop_reason: str | int | None = None
    cached_tokens_by_tier: dict[str, int] | None = None
    new_logprobs: list[TokenLogprob] | None = None   # logprobs of new_token_ids
    num_accepted_draft_tokens: int = 0   # speculative drafts accepted over the request so far
    prompt_logprobs: list[TokenLogprob | None] | None = None  # with params.prompt_logprobs only

    @property
    def text(self) -> str:
        """All output text so far (stop strings cut)."""
        return str(self.text_view)
