"""How long a step takes, learned online, and the prefill budget that keeps decodes moving.

Every prefill token in a step that also carries decodes delays those decodes' next token. The
scheduler therefore gives prefill chunks only as many tokens as keep the step within
``slowdown`` times the time of the decodes alone (see :meth:`StepCost.prefill_budget`).

The model is a line, ``seconds = a + b * tokens``, fitted by exponentially weighted least
squares over recent steps (older steps fade with ``decay``). On a CPU a small step costs about
the weight read (``a``) and each extra token about its share of the FLOPs (``b``), so the line is
a fair local fit; because the scheduler's choices feed the next observations, the fit follows
whatever region the engine runs in. Until enough steps of different sizes have been seen, the
budget is ``warmup_tokens``.

Pure Python and no I/O: the engine feeds it wall time; the simulator can feed it modelled time.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class StepCost:
    slowdown: float = 2.0          # a mixed step may take this many times the decodes-only step
    min_tokens: int = 16           # never give prefill less than this while decodes run
    warmup_tokens: int = 64        # budget before the fit is trustworthy
    decay: float = 0.95            # weight kept by each older observation
    min_samples: float = 3.0       # effective observations needed before trusting the fit

    def __post_init__(self) -> None:
        if not self.slowdown > 1.0:
            raise ValueError(f"slowdown must be > 1, got {self.slowdown}")
        if self.min_tokens < 1 or self.warmup_tokens < 1:
            raise ValueError("min_tokens and warmup_tokens must be >= 1")
        if not 0.0 < self.decay < 1.0:
            raise ValueError(f"decay must be in (0, 1), got {self.decay}")
        self._w = self._x = self._y = self._xx = self._xy = 0.0

    def observe(self, num_tokens: int, seconds: float) -> None:
        """One finished step of ``num_tokens`` tokens that took ``seconds``."""
        if num_tokens <= 0 or not seconds > 0.0:
            return
        d = self.decay
        x, y = float(num_tokens), float(seconds)
        self._w = self._w * d + 1.0
        self._x = self._x * d + x
        self._y = self._y * d + y
        self._xx = self._xx * d + x * x
        self._xy = self._xy * d + x * y

    def fit(self) -> tuple[float, float] | None:
        """``(a, b)`` of the current line, or None while the observations cannot define one."""
        if self._w < self.min_samples:
            return None
        mean_x, mean_y = self._x / self._w, self._y / self._w
        var = self._xx / self._w - mean_x * mean_x
        if var <= 1e-9 * max(1.0, mean_x * mean_x):
            return None
        b = (self._xy / self._w - mean_x * mean_y) / var
        a = mean_y - b * mean_x
        return a, b

    def predict(self, num_tokens: int) -> float | None:
        f = self.fit()
        return None if f is None else f[0] + f[1] * num_tokens

    def prefill_budget(self, num_decode_tokens: int, limit: int) -> int:
        """Prefill tokens to add to a step that already has ``num_decode_tokens`` decodes.

        At most ``limit`` (what is left of the step's token budget); with no decodes the
        caller does not ask.
        """
        f = self.fit()
        if f is None:
            budget = self.warmup_tokens
        else:
            a, b = f
            if b <= 0.0:   # extra tokens look free: the step is bound by the weight read
                return limit
            alone = max(a + b * num_decode_tokens, 0.0)
            budget = int((self.slowdown - 1.0) * alone / b)
        return max(min(budget, limit), min(self.min_tokens, limit))
