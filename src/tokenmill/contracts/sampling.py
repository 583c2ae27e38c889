"""Per-request sampling parameters (validated on construction).

Semantics, applied in this order by :class:`tokenmill.layers.sampling.Sampler`:

1. penalties on the raw logits: ``repetition_penalty`` (HF style, over prompt and output tokens:
   a positive logit is divided by it, a negative one multiplied), then ``presence_penalty`` and
   ``frequency_penalty`` (OpenAI style, over output tokens: ``logit -= presence * [count > 0] +
   frequency * count``);
2. ``temperature == 0`` means greedy (argmax); otherwise logits are divided by ``temperature``;
3. truncation: ``top_k`` (0 = off), ``top_p`` (1.0 = off), ``min_p`` (0.0 = off; drops tokens
   whose probability is below ``min_p`` times the most likely token's);
4. one draw from what is left, using the request's own random stream (``seed``), so a seeded
   request gives the same tokens whatever else is in the batch.

``logprobs`` (None: none; 0: the chosen token only; N: chosen plus the top N) are the log-softmax
of the logits after step 1 and 2 (penalties and temperature), before truncation.

``structured`` constrains the output to a grammar (:class:`StructuredOutputs`); its token mask is
applied to the raw logits before step 1, so logprobs are those of the constrained distribution.
``prompt_logprobs`` (None, or N >= 0 like ``logprobs``) asks for the log-softmax of the raw logits
at every prompt position (the first prompt token has none); such a request bypasses the prefix
cache for its prompt so that every prompt row is computed.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

MAX_LOGPROBS = 20

STRUCTURED_KINDS = ("json_schema", "json_object", "regex", "choice", "grammar", "structural_tag")


@dataclass(frozen=True)
class StructuredOutputs:
    """One output constraint: ``kind`` and its canonical text ``spec`` (hashable: the grammar
    cache key).

    * ``json_schema``: a JSON schema (JSON text); ``json_object``: any JSON object (spec "");
    * ``regex``: a regular expression the whole output must match;
    * ``choice``: a JSON list of strings, the output is exactly one of them;
    * ``grammar``: an EBNF grammar (GBNF dialect, start rule ``root``);
    * ``structural_tag``: an xgrammar structural tag (JSON text), used for tool calls.
    """

    kind: str
    spec: str = ""

    def __post_init__(self) -> None:
        if self.kind not in STRUCTURED_KINDS:
            raise ValueError(f"unknown structured output kind {self.kind!r}; expected one of {STRUCTURED_KINDS}")
        if not isinstance(self.spec, str):
            raise ValueError(f"structured output spec must be text, got {type(self.spec).__name__}")
        if self.kind != "json_object" and not self.spec:
            raise ValueError(f"structured output of kind {self.kind!r} needs a non-empty spec")

    @classmethod
    def json(cls, schema: dict[str, Any] | str) -> StructuredOutputs:
        text = schema if isinstance(schema, str) else json.dumps(schema, sort_keys=True, ensure_ascii=False)
        return cls("json_schema", text)

    @classmethod
    def choice(cls, options: list[str]) -> StructuredOutputs:
        return cls("choice", json.dumps(list(options), ensure_ascii=False))


@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    structured: StructuredOutputs | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop)
        self.stop_token_ids = [int(t) for t in self.stop_token_ids]
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not self.temperature >= 0.0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 disables it), got {self.top_k!r}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.seed is not None and not isinstance(self.seed, int):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise ValueError(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise ValueError(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        if not self.repetition_penalty > 0.0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError(f"stop strings must be non-empty strings, got {self.stop!r}")
        if any(t < 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be >= 0, got {self.stop_token_ids}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise ValueError(f"logprobs must be between 0 and {MAX_LOGPROBS}, got {self.logprobs}")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= MAX_LOGPROBS:
            raise ValueError(f"prompt_logprobs must be between 0 and {MAX_LOGPROBS}, got {self.prompt_logprobs}")
        if self.structured is not None and not isinstance(self.structured, StructuredOutputs):
            raise ValueError(f"structured must be StructuredOutputs, got {type(self.structured).__name__}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def uses_penalties(self) -> bool:
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0)
