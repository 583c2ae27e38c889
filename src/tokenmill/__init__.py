"""tokenmill: an LLM serving stack for coding agents.

``LLM``, ``SamplingParams`` and ``StructuredOutputs`` are imported on first use so that ``import tokenmill`` stays
light (no torch) for the parts that do not need a model.
"""
from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

# oneDNN (the fp32 matmuls of layers/linear.py, the packed MoE experts, the quantized formats'
# prefill GEMM) caches one primitive per weight shape and batch size, up to about 1.5 MB each, and by
# default keeps 1,024 of them: a server's RSS then grows by hundreds of MB as new batch sizes
# appear (the soak caught it). 64 keeps the shapes of a step and bounds the growth to about
# 100 MB; both variables are read at oneDNN's first use, and a value set by the user wins.
for _var in ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY"):
    os.environ.setdefault(_var, "64")

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
