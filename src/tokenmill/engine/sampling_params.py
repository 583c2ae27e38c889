"""Per-request sampling parameters; defined in :mod:`tokenmill.contracts.sampling`."""
from __future__ import annotations

from tokenmill.contracts.sampling import MAX_LOGPROBS, STRUCTURED_KINDS, SamplingParams, StructuredOutputs

__all__ = ["MAX_LOGPROBS", "STRUCTURED_KINDS", "SamplingParams", "StructuredOutputs"]
