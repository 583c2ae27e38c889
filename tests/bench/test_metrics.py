"""Metrics on hand-made timestamps with known answers."""
from __future__ import annotations

import math

import pytest

from tokenmill.bench.metrics import (RequestRecord, cache_hit_rate, compute_run_metrics, littles_law_concurrency,
                                     measurement_window, percentile, summarize)


def rec(send: float, first: float, chunks: list[float], end: float, *, prompt: int = 100, cached: int | None = 0,
        out: int | None = None, error: str | None = None, warmup: bool = False) -> RequestRecord:
    return RequestRecord(session_id="s", turn=0, branch=0, send_time=send, end_time=None if error else end,
                         first_token_time=first, chunk_times=chunks, chunk_tokens=[1] * len(chunks),
                         prompt_tokens=prompt, cached_tokens=cached,
                         output_tokens=len(chunks) if out is None else out, planned_output_tokens=len(chunks),
                         error=error, warmup=warmup)


def test_percentile_linear_interpolation() -> None:
    xs = [1.0, 2.0, 3.0, 4.0]
    assert percentile(xs, 0) == 1.0
    assert percentile(xs, 100) == 4.0
    assert percentile(xs, 50) == pytest.approx(2.5)
    assert percentile(xs, 90) == pytest.approx(3.7)        # pos 2.7 -> 3 + 0.7
    assert percentile(list(range(1, 101)), 99) == pytest.approx(99.01)
    assert percentile([5.0], 99) == 5.0
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0          # unsorted input
    with pytest.raises(ValueError):
        percentile([], 50)
    with pytest.raises(ValueError):
        percentile([1.0], 101)


def test_percentile_matches_numpy() -> None:
    np = pytest.importorskip("numpy")
    rng = np.random.default_rng(0)
    xs = rng.lognormal(size=37).tolist()
    for q in (1, 50, 90, 99):
        assert percentile(xs, q) == pytest.approx(float(np.percentile(xs, q)))


def test_summarize() -> None:
    s = summarize([1.0, 2.0, 3.0, 4.0, 10.0])
    assert s.count == 5 and s.mean == pytest.approx(4.0) and s.p50 == 3.0
    assert s.p90 == pytest.approx(4 + 0.6 * 6)
    assert summarize([]).mean is None


def test_request_record_derived_times() -> None:
    r = rec(10.0, 10.5, [10.5, 10.7, 11.0, 11.5], 11.5)
    assert r.ttft == pytest.approx(0.5)
    assert r.e2e == pytest.approx(1.5)
    assert r.tpot == pytest.approx(1.0 / 3)               # (11.5 - 10.5) / (4 - 1)
    assert r.itls() == pytest.approx([0.2, 0.3, 0.5])
    one = rec(0.0, 1.0, [1.0], 1.0)
    assert one.tpot is None                                # needs >= 2 output tokens


def test_run_metrics_known_answers() -> None:
    # two requests, concurrency 2, window 0..4 s
    a = rec(0.0, 1.0, [1.0, 1.5, 2.0], 2.0, prompt=100, cached=50)      # tpot 0.5, e2e 2
    b = rec(1.0, 1.5, [1.5, 2.5, 3.5, 4.0], 4.0, prompt=300, cached=0)  # tpot 2.5/3, e2e 3
    m = compute_run_metrics([a, b], concurrency=2, devices=2, theoretical_hit_rate=0.6)
    assert m["duration_s"] == pytest.approx(4.0)
    assert m["ttft_mean_s"] == pytest.approx(0.75)
    assert m["ttft_p50_s"] == pytest.approx(0.75)
    assert m["e2e_latency_mean_s"] == pytest.approx(2.5)
    mean_tpot = (0.5 + 2.5 / 3) / 2
    assert m["tpot_mean_s"] == pytest.approx(mean_tpot)
    assert m["itl_p50_s"] == pytest.approx(0.5)           # gaps [.5,.5,1,1,.5] -> sorted .5 .5 .5 1 1
    # interactivity, both definitions
    assert m["output_tokens_per_s_per_user"] == pytest.approx(1 / mean_tpot)
    assert m["output_tokens_per_s"] == pytest.approx(7 / 4)
    assert m["output_tokens_per_s_per_user_by_concurrency"] == pytest.approx(7 / 4 / 2)
    assert m["input_tokens_per_s"] == pytest.approx(400 / 4)
    assert m["total_tokens_per_s"] == pytest.approx(407 / 4)
    assert m["total_tokens_per_s_per_device"] == pytest.approx(407 / 8)
    assert m["cache_hit_rate"] == pytest.approx(50 / 400)
    assert m["cache_hit_rate_theoretical"] == 0.6
    # Little: 2 requests / 4 s * 2.5 s mean latency
    assert m["littles_law_concurrency"] == pytest.approx(1.25)
    assert m["errors"] == 0 and m["valid"] is True


def test_littles_law_closed_loop_saturated() -> None:
    # 3 back-to-back requests of 1 s each on one stream: L = 3/3 * 1 = 1
    recs = [rec(float(i), i + 0.2, [i + 0.2, i + 1.0], i + 1.0) for i in range(3)]
    m = compute_run_metrics(recs, concurrency=1)
    assert m["littles_law_concurrency"] == pytest.approx(1.0)
    assert littles_law_concurrency(10, 5.0, 0.5) == pytest.approx(1.0)
    with pytest.raises(ValueError):
        littles_law_concurrency(1, 0.0, 1.0)


def test_warmup_excluded_and_window_start() -> None:
    w = rec(0.0, 5.0, [5.0, 6.0], 6.0, prompt=1000, warmup=True)
    a = rec(2.0, 2.5, [2.5, 3.0], 4.0, prompt=10)
    m = compute_run_metrics([w, a], concurrency=1, window_start=1.0)
    assert m["warmup_requests"] == 1 and m["num_requests"] == 1
    assert m["duration_s"] == pytest.approx(3.0)          # 1.0 .. 4.0
    assert m["input_tokens_per_s"] == pytest.approx(10 / 3)
    assert measurement_window([a]) == pytest.approx(2.0)


def test_errors_mark_run_invalid_above_one_percent() -> None:
    good = [rec(float(i), i + 0.1, [i + 0.1, i + 0.2], i + 0.2) for i in range(99)]
    bad = rec(0.0, 0.0, [], 0.0, error="HTTP 500: boom")
    m = compute_run_metrics([*good, bad], concurrency=4)
    assert m["errors"] == 1 and m["error_rate"] == pytest.approx(0.01) and m["valid"] is True
    m2 = compute_run_metrics([*good[:50], bad], concurrency=4)
    assert m2["errors"] == 1 and m2["valid"] is False
    assert m2["error_examples"] == ["HTTP 500: boom"]
    # an all-error run is invalid and has no latency numbers
    m3 = compute_run_metrics([bad], concurrency=1)
    assert m3["valid"] is False and m3["ttft_mean_s"] is None and m3["output_tokens_per_s"] == 0.0


def test_cache_hit_rate_ignores_unreported_and_failed() -> None:
    a = rec(0, 0.1, [0.1], 0.2, prompt=100, cached=80)
    b = rec(0, 0.1, [0.1], 0.2, prompt=100, cached=None)   # server did not report
    c = rec(0, 0.1, [0.1], 0.2, prompt=100, cached=100, error="x")
    assert cache_hit_rate([a, b, c]) == pytest.approx(0.8)
    assert cache_hit_rate([b]) is None
    m = compute_run_metrics([b], concurrency=1)
    assert m["cache_hit_rate"] is None


def test_bad_arguments() -> None:
    with pytest.raises(ValueError):
        compute_run_metrics([], concurrency=0)
    m = compute_run_metrics([], concurrency=1)
    assert m["valid"] is False and m["num_requests"] == 0
    assert not math.isnan(m["output_tokens_per_s"])


def test_acceptance_length_from_accepted_drafts() -> None:
    from tokenmill.bench.metrics import acceptance_length

    def rec(out: int, accepted: int | None) -> RequestRecord:
        r = RequestRecord(session_id="s", turn=0, branch=0, send_time=0.0, end_time=1.0)
        r.output_tokens, r.accepted_draft_tokens = out, accepted
        return r

    assert acceptance_length([rec(30, None)]) is None          # the server does not speculate
    assert acceptance_length([rec(30, 20), rec(10, 0)]) == pytest.approx(40 / 20)
    assert compute_run_metrics([rec(30, 15)], concurrency=1)["acceptance_length"] == pytest.approx(2.0)
