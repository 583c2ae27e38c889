"""Benchmark metrics: pure functions over per-request timestamps (no I/O).

Definitions (all times in seconds, measured at the client):
- TTFT: first content token received - request sent.
- ITL: gap between consecutive content chunks of one request (pooled over requests).
- TPOT: (end - first token) / (output tokens - 1), per request with at least 2 output tokens.
- e2e latency: end - sent.
- ``output_tokens_per_s_per_user`` = 1 / mean TPOT (interactivity as a user sees decode speed).
- ``output_tokens_per_s_per_user_by_concurrency`` = output throughput / concurrency (the other
  common definition, which also charges prefill and think time to the user).
- throughputs = tokens of measured requests / measurement window.
- ``cache_hit_rate`` = sum(cached_tokens) / sum(prompt_tokens) over requests whose server
  reported cached tokens (None when none did).
- ``littles_law_concurrency`` = arrival rate x mean e2e latency: the mean number of requests in
  flight. In a closed loop with think times it is below the set concurrency (sessions think).
- a run is ``valid`` when at most ``max_error_rate`` (1%) of its requests failed.
"""
from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

MAX_ERROR_RATE = 0.01
PERCENTILES = (50, 90, 99)


@dataclass
class RequestRecord:
    """What the client saw of one request.

    ``chunk_times`` are the arrival times of content chunks and ``chunk_tokens`` the number of
    output tokens each carried (1 when the server does not say). ``cached_tokens`` is None when
    the server does not report ``usage.prompt_tokens_details.cached_tokens``.
    """

    session_id: str | None
    turn: int
    branch: int
    send_time: float
    end_time: float | None = None
    first_token_time: float | None = None
    chunk_times: list[float] = field(default_factory=list)
    chunk_tokens: list[int] = field(default_factory=list)
    prompt_tokens: int = 0
    cached_tokens: int | None = None
    accepted_draft_tokens: int | None = None   # usage.accepted_draft_tokens (speculating servers)
    output_tokens: int = 0
    planned_output_tokens: int = 0
    error: str | None = None
    warmup: bool = False
    session_echoed: bool | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.end_time is not None

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.send_time

    @property
    def e2e(self) -> float | None:
        return None if self.end_time is None else self.end_time - self.send_time

    @property
    def tpot(self) -> float | None:
        if self.first_token_time is None or self.end_time is None or self.output_tokens < 2:
            return None
        return (self.end_time - self.first_token_time) / (self.output_tokens - 1)

    def itls(self) -> list[float]:
        return [b - a for a, b in zip(self.chunk_times, self.chunk_times[1:])]

    def to_dict(self) -> dict[str, Any]:
        from dataclasses import asdict

        return asdict(self)


class Summary(NamedTuple):
    count: int
    mean: float | None
    p50: float | None
    p90: float | None
    p99: float | None


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) with linear interpolation between closest ranks
    (numpy's default ``linear`` method). Raises ValueError on an empty sequence."""
    if not values:
        raise ValueError("percentile of no values")
    if not 0 <= q <= 100:
        raise ValueError(f"q must be in [0, 100], got {q}")
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def summarize(values: Iterable[float]) -> Summary:
    xs = [float(v) for v in values]
    if not xs:
        return Summary(0, None, None, None, None)
    return Summary(len(xs), sum(xs) / len(xs), *(percentile(xs, q) for q in PERCENTILES))


def cache_hit_rate(records: Iterable[RequestRecord]) -> float | None:
    """sum(cached) / sum(prompt) over successful requests that reported cached tokens."""
    cached = prompt = 0
    for r in records:
        if r.ok and r.cached_tokens is not None:
            cached += r.cached_tokens
            prompt += r.prompt_tokens
    return cached / prompt if prompt else None


def acceptance_length(records: Iterable[RequestRecord]) -> float | None:
    """Output tokens per decode step with speculative decoding: sum(output) / sum(output -
    accepted drafts), over successful requests whose server reported accepted drafts."""
    out = steps = 0
    for r in records:
        if r.ok and r.accepted_draft_tokens is not None and r.output_tokens:
            out += r.output_tokens
            steps += max(r.output_tokens - r.accepted_draft_tokens, 1)
    return out / steps if steps else None


def littles_law_concurrency(num_requests: int, window_s: float, mean_latency_s: float) -> float:
    """L = lambda * W with lambda = num_requests / window_s."""
    if window_s <= 0:
        raise ValueError(f"window must be > 0, got {window_s}")
    return num_requests / window_s * mean_latency_s


def measurement_window(records: Sequence[RequestRecord], start: float | None = None) -> float:
    """From ``start`` (default: first send) to the last end among ``records``."""
    ends = [r.end_time for r in records if r.end_time is not None]
    if not records or not ends:
        return 0.0
    t0 = min(r.send_time for r in records) if start is None else start
    return max(ends) - t0


def _flat(prefix: str, s: Summary) -> dict[str, float | None]:
    return {f"{prefix}_mean_s": s.mean, f"{prefix}_p50_s": s.p50, f"{prefix}_p90_s": s.p90,
            f"{prefix}_p99_s": s.p99}


def compute_run_metrics(records: Sequence[RequestRecord], *, concurrency: int, devices: int = 1,
                        window_start: float | None = None, theoretical_hit_rate: float | None = None,
                        max_error_rate: float = MAX_ERROR_RATE) -> dict[str, Any]:
    """All metrics of one concurrency level. Warm-up records are excluded; ``window_start``
    (default: first measured send) opens the measurement window."""
    if concurrency < 1 or devices < 1:
        raise ValueError("concurrency and devices must be >= 1")
    measured = [r for r in records if not r.warmup]
    ok = [r for r in measured if r.ok]
    errors = len(measured) - len(ok)
    window = measurement_window(measured, window_start)
    ttft = summarize(r.ttft for r in ok if r.ttft is not None)
    tpot = summarize(r.tpot for r in ok if r.tpot is not None)
    e2e = summarize(r.e2e for r in ok if r.e2e is not None)
    itl = summarize(x for r in ok for x in r.itls())
    out_tok = sum(r.output_tokens for r in ok)
    in_tok = sum(r.prompt_tokens for r in ok)
    per_s = (lambda n: n / window) if window > 0 else (lambda n: 0.0)
    out_tps, in_tps = per_s(out_tok), per_s(in_tok)
    echoes = [r.session_echoed for r in ok if r.session_echoed is not None]
    error_rate = errors / len(measured) if measured else 0.0
    return {
        "concurrency": concurrency,
        "num_requests": len(measured),
        "num_ok": len(ok),
        "warmup_requests": len(records) - len(measured),
        "duration_s": window,
        **_flat("ttft", ttft), **_flat("itl", itl), **_flat("tpot", tpot), **_flat("e2e_latency", e2e),
        "output_tokens_per_s_per_user": (1.0 / tpot.mean) if tpot.mean else None,
        "output_tokens_per_s_per_user_by_concurrency": out_tps / concurrency,
        "output_tokens_per_s": out_tps,
        "input_tokens_per_s": in_tps,
        "total_tokens_per_s": out_tps + in_tps,
        "total_tokens_per_s_per_device": (out_tps + in_tps) / devices,
        "devices": devices,
        "prompt_tokens": in_tok,
        "output_tokens": out_tok,
        "planned_output_tokens": sum(r.planned_output_tokens for r in ok),
        "cache_hit_rate": cache_hit_rate(ok),
        "cache_hit_rate_theoretical": theoretical_hit_rate,
        "acceptance_length": acceptance_length(ok),
        "littles_law_concurrency": (littles_law_concurrency(len(ok), window, e2e.mean)
                                    if window > 0 and e2e.mean is not None else None),
        "session_header_echo_rate": (sum(echoes) / len(echoes)) if echoes else None,
        "errors": errors,
        "error_rate": error_rate,
        "valid": bool(measured) and error_rate <= max_error_rate,
        "error_examples": sorted({r.error for r in measured if r.error})[:5],
    }
