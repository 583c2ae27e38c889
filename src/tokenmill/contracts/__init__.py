"""Contracts shared across layers: the leaf of the package.

Nothing here imports from the rest of tokenmill, and nothing imports torch at module level, so
torch-free parts (the scheduler, the radix cache, the simulator, the planner) can use these
types too. Modules:

* :mod:`.batch`: :class:`ForwardBatch`, one engine step's tokens and page tables.
* :mod:`.kv`: :class:`KVCacheSpec` and its per-layer entries (what a model stores per token).
* :mod:`.sampling`: :class:`SamplingParams`, :class:`StructuredOutputs` (an output constraint).
* :mod:`.errors`: :class:`ModelLoadError`.
"""
from __future__ import annotations

from tokenmill.contracts.batch import ForwardBatch
from tokenmill.contracts.errors import ModelLoadError
from tokenmill.contracts.kv import KV_DTYPE_BYTES, KVCacheSpec, LatentKV, LinearState, PagedKV
from tokenmill.contracts.sampling import MAX_LOGPROBS, SamplingParams, StructuredOutputs

__all__ = ["ForwardBatch", "KVCacheSpec", "KV_DTYPE_BYTES", "LatentKV", "LinearState", "MAX_LOGPROBS",
           "ModelLoadError", "PagedKV", "SamplingParams", "StructuredOutputs"]
