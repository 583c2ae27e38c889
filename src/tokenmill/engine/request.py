"""Request state inside the engine, and what the engine hands back per step.

A request's progress is two counters over one token list (``all_token_ids`` = prompt + output):

* ``num_computed_tokens``: leading tokens whose K/V sit in the request's pages;
* ``num_tokens``: the length of ``all_token_ids``.

Everything else is derived: a request still prefilling has ``num_tokens - num_computed_tokens > 1``;
a decoding one has exactly 1 (its last sampled token, whose K/V is written by the next step).
A step that brings ``num_computed_tokens`` up to ``num_tokens`` samples one new token.
After preemption ``num_computed_tokens`` drops back (to the cached prefix, or 0) and the same rule
recomputes prompt + output so far.

Page ownership (``page_table``)::

    page_table: [ p0 p1 ... p(k-1) | pk ... ]
                  ^ num_tree_pages: owned by the radix cache, locked through cache_node
                                   ^ the rest: owned by this request alone, freed when it leaves
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from tokenmill.engine.sampling_params import SamplingParams


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
    num_cached_tokens: int | None = None  # prefix-cache hit at first admission
    num_preemptions: int = 0
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    logprobs: list[TokenLogprob] | None = None
    deadline: float | None = None     # time.monotonic() by which it must finish (engine/admission.py)
    queue_deadline: float | None = None  # time.monotonic() by which it must first be admitted
    generator: Any = None             # the request's random stream (owned by the model runner)
    detokenizer: Any = None           # incremental detokenizer (owned by the engine)

    def __post_init__(self) -> None:
        if not self.all_token_ids:
            self.all_token_ids = list(self.prompt_token_ids)
        if self.params.logprobs is not None and self.logprobs is None:
            self.logprobs = []

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
    def output_token_ids(self) -> list[int]:
        return self.all_token_ids[len(self.prompt_token_ids):]

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.all_token_ids) - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED


@dataclass
class RequestOutput:
    """State of one request after a step (cumulative fields plus the delta since the last one)."""

    request_id: str
    prompt_token_ids: list[int]
    cached_tokens: int
    token_ids: list[int]
    text: str
    new_token_ids: list[int]
    new_text: str
    logprobs: list[TokenLogprob] | None
    finished: bool
    finish_reason: str | None
    stop_reason: str | int | None = None
