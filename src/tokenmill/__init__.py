"""tokenmill: an LLM serving stack for coding agents.

``LLM``, ``SamplingParams`` and ``StructuredOutputs`` are imported on first use so that ``import tokenmill`` stays
light (no torch) for the parts that do not need a model.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "StructuredOutputs", "__version__"]

if TYPE_CHECKING:
    from tokenmill.engine.llm import LLM
    from tokenmill.contracts.sampling import SamplingParams, StructuredOutputs


def __getattr__(name: str) -> Any:
    if name == "LLM":
        from tokenmill.engine.llm import LLM

        return LLM
    if name == "SamplingParams":
        from tokenmill.contracts.sampling import SamplingParams

        return SamplingParams
    if name == "StructuredOutputs":
        from tokenmill.contracts.sampling import StructuredOutputs

        return StructuredOutputs
    raise AttributeError(f"module 'tokenmill' has no attribute {name!r}")
