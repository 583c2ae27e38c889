"""Start-up calibration of static fp8 KV scales (``--kv-cache-fp8-scales static``).

The model runner runs one prefill over :func:`calibration_tokens` (a built-in paragraph of
prose, code and numbers through the model's tokenizer, then a fixed pseudo-random tail of
token ids that reaches rare embeddings) and sets each layer's per-head scales from the largest
K / V (latent, rope key) values it wrote; see :mod:`tokenmill.layers.attention.fp8`. The tokens
are a pure function of the tokenizer and the vocabulary size, so every replica of the same
model computes the same scales (and can share fp8 pages through the KV tiers).
"""
from __future__ import annotations

import random
from typing import Any

CALIBRATION_TEXT = (
    "The quick brown fox jumps over the lazy dog. In 1969, Apollo 11 landed on the Moon; the crew "
    "returned safely on July 24. Rain is expected tomorrow, with highs of 18°C and winds from the "
    "north-west at 25 km/h.\n\n"
    "def fibonacci(n: int) -> list[int]:\n    a, b = 0, 1\n    out = []\n    for _ in range(n):\n"
    "        out.append(a)\n        a, b = b, a + b\n    return out\n\n"
    "SELECT name, COUNT(*) FROM orders WHERE total > 100 GROUP BY name ORDER BY 2 DESC;\n"
    "User: Can you summarise the main causes of the French Revolution?\nAssistant: Certainly. "
    "Fiscal crisis, food prices, Enlightenment ideas and a rigid estate system all played a part. "
    '{"id": 42, "tags": ["alpha", "beta"], "ok": true, "ratio": 0.375}\n'
    "Les données sont stockées en mémoire; 数据存储在内存中。 E = mc^2, ∑ x_i / n, 3.14159265."
)
RANDOM_TAIL = 64


def calibration_tokens(tokenizer: Any, vocab_size: int, limit: int) -> list[int]:
    """At most ``limit`` token ids: the calibration text, then a fixed pseudo-random tail."""
    ids: list[int] = []
    if tokenizer is not None:
        try:
            ids = [int(t) for t in tokenizer(CALIBRATION_TEXT).input_ids]
        except (TypeError, AttributeError, ValueError):
            ids = []
    ids = [t for t in ids if 0 <= t < vocab_size]
    rng = random.Random(0)
    ids += [rng.randrange(vocab_size) for _ in range(RANDOM_TAIL)]
    return ids[: max(1, limit)]
