"""Quantized weight formats behind the linear-method interface (``tokenmill.layers.linear``).

- ``packed``: the two kernel layouts (:class:`Int8Linear`, :class:`Int4Linear`) and their matmul.
- ``gguf``: GGUF block types (Q8_0, Q4_0, Q4_1, Q4_K; Q6_K via int8) repacked into those layouts.
- ``methods``: ``--quantization {none,int8,int4}`` for checkpoints loaded in fp32.
"""
from __future__ import annotations
