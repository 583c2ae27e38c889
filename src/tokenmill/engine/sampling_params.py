"""Per-request sampling parameters; defined in :mod:`tokenmill.contracts.sampling`."""
from __future__ import annotations

from tokenmill.contracts.sampling import MAX_LOGPROBS, SamplingParams

__all__ = ["MAX_LOGPROBS", "SamplingParams"]
