"""The adaptive draft length weighs what drafts are expected to gain against what they cost: the
fitted step-cost line (time per verify row) and the proposer's own time."""
from __future__ import annotations

import pytest

from tokenmill import LLM, SamplingParams
from tokenmill.engine.request import Request
from tokenmill.engine.spec import StepTable
from tokenmill.engine.step_cost import StepCost


@pytest.fixture()
def decoder(tiny_llama):
    lm, _ = tiny_llama
    spec = LLM(loaded=lm, kv_cache_tokens=1024, speculative_method="ngram", num_speculative_tokens=4).engine.spec
    spec._steps = 1   # not a probe step
    # the engine measured its verify steps at start-up; these tests feed their own times
    assert spec.table.calibrated and spec.cost.fit() is not None
    spec.table = StepTable()
    spec.cost = StepCost(decay=0.97, min_samples=8.0)
    return spec


def _feed(decoder, t0: float, t1: float) -> None:
    """Decode-only steps of 1..5 tokens taking exactly t0 + t1 * tokens."""
    for _ in range(4):
        for n in (1, 2, 3, 5):
            decoder.cost.observe(n, t0 + t1 * n)


def _req(first: float, cont: float, rid: str = "r") -> Request:
    req = Request(rid, [1, 2, 3], SamplingParams(max_tokens=16))
    req.spec_first_rate, req.spec_continue_rate = first, cont
    return req


def test_rows_go_out_while_each_raises_tokens_per_second(decoder) -> None:
    _feed(decoder, 0.005, 0.005)   # a verify row costs half a one-token step
    # gains 0.9, 0.81, 0.73, 0.66: the fourth costs more than it brings
    assert decoder._worth_drafting([_req(0.9, 0.9)], [4], 1) == [3]
    # a poor draft does not pay for its row: nothing is drafted
    assert decoder._worth_drafting([_req(0.2, 0.5)], [4], 1) == [0]
    assert decoder.steps_off == 1
    # of two requests, the likely one drafts, and less than alone: the step already yields two
    # tokens, so a row must bring more to raise the rate
    assert decoder._worth_drafting([_req(0.9, 0.9, "a"), _req(0.2, 0.5, "b")], [4, 4], 2) == [2, 0]


def test_free_rows_draft_everything_and_a_slow_proposer_is_switched_off(decoder) -> None:
    _feed(decoder, 0.010, 0.0)     # weight-bound: extra rows cost nothing measurable
    assert decoder._worth_drafting([_req(0.3, 0.5)], [4], 1) == [4]
    decoder.propose_seconds = 0.050   # five steps: more than the ~3.1 tokens its drafts are expected to add
    assert decoder._worth_drafting([_req(0.9, 0.9)], [4], 1) == [0]
    decoder._steps = 32              # a probe would cost 5 steps: not every 32 steps ...
    assert decoder._worth_drafting([_req(0.9, 0.9)], [4], 1) == [0]
    decoder._steps = 250             # ... but every 250 (2% of the time), a short probe goes out
    assert decoder._worth_drafting([_req(0.9, 0.9)], [4], 1) == [1]


def test_without_a_cost_line_the_per_request_rule_decides(decoder) -> None:
    assert decoder.cost.fit() is None
    assert decoder._worth_drafting([_req(0.2, 0.5)], [3], 1) == [3]
    req = _req(0.5, 0.7)
    assert decoder._draft_len(req) == 4                 # 0.5 * 0.7**3 = 0.17 >= 0.15
    req.spec_first_rate, req.spec_continue_rate = 0.5, 0.3
    assert decoder._draft_len(req) == 2                 # 0.5 * 0.3 = 0.15, 0.5 * 0.09 < 0.15
    req.spec_first_rate = 0.1                           # below the floor: off, probes back off
    assert [decoder._draft_len(req) for _ in range(8)] == [0] * 7 + [1]
    assert req.spec_probe_every == 16
    assert [decoder._draft_len(req) for _ in range(16)] == [0] * 15 + [1]


def test_a_step_shaped_cost_is_weighed_per_row_count(decoder) -> None:
    # the int4 kernel's shape: one row alone is cheap, 2-4 rows cost about the same, 5 more
    for _ in range(4):
        for n, t in ((1, 0.010), (2, 0.020), (3, 0.020), (4, 0.020), (5, 0.030)):
            decoder.cost.observe(n, t)
            decoder.table.observe(n, t)
    assert decoder.step_time(4) == pytest.approx(0.020)
    # one draft alone never pays for the second row, three likely ones do; a fourth is dearer
    assert decoder._choose_rows([[0.9, 0.81, 0.73, 0.66]], 1, 0.0) == [3]
    assert decoder._choose_rows([[0.9]], 1, 0.0) == [0]
    assert decoder._choose_rows([[0.3, 0.15, 0.08, 0.04]], 1, 0.0) == [0]
    # unseen sizes are interpolated between seen ones
    decoder.table.observe(9, 0.050)
    decoder.table.observe(9, 0.050)
    assert decoder.step_time(7) == pytest.approx(0.040)


def test_ngram_reports_the_match_length_and_kinds_learn_acceptance() -> None:
    import numpy as np

    from tokenmill.engine.spec.base import KindStats
    from tokenmill.engine.spec.ngram import ngram_match

    toks = np.array([9, 1, 2, 3, 4, 5, 6, 8, 1, 2, 3, 4], dtype=np.int32)
    # "3 4" matches at length 2 (lookup 1-2) but the contexts agree over "1 2 3 4": kind 4
    assert ngram_match(toks, 1, 2, 2) == ([5, 6], 4)
    assert ngram_match(np.array([7, 1, 2, 8, 1, 2], dtype=np.int32), 2, 2, 3) == ([8, 1, 2], 2)
    assert ngram_match(np.array([1, 2, 3], dtype=np.int32), 2, 3, 3) == ([], 0)
    st = KindStats(4, first=0.5)
    assert st.gains(4)[0] == pytest.approx(0.5)
    for _ in range(20):
        st.record(4, 4)         # every draft of this kind holds
    g = st.gains(4)
    assert g[0] > 0.9 and g[3] > 0.8
    for _ in range(40):
        st.record(2, 0)         # then none does
    assert st.gains(4)[0] < 0.2


def test_incremental_ngram_index_matches_the_array_search() -> None:
    import random

    import numpy as np

    from tokenmill.engine.spec.ngram import _NgramIndex, ngram_match

    rng = random.Random(7)
    for _ in range(100):
        vocab = rng.choice([3, 5, 20])
        toks = [rng.randrange(vocab) for _ in range(rng.randint(1, 60))]
        lo = rng.randint(1, 3)
        hi = rng.randint(lo, 5)
        index = _NgramIndex(lo, hi)
        for end in range(1, len(toks) + 1, rng.randint(1, 4)):   # grows by one or more tokens
            want = ngram_match(np.array(toks[:end], dtype=np.int32), lo, hi, 6)
            assert index.lookup(toks[:end], 6) == want


def test_load_scales_calibrated_step_times_alike(decoder) -> None:
    # start-up times of the int4 shape; then the machine gets busy and the one-row steps the
    # engine keeps running take 1.4x as long. Multi-row steps must be predicted 1.4x dearer
    # too, or a draft that did not pay at start-up would look worth sending.
    for n, t in ((1, 0.0073), (2, 0.0142), (3, 0.0160), (4, 0.0175), (5, 0.0317)):
        decoder.table.calibrate(n, t)
        decoder.cost.observe(n, t)
    kind2 = [[0.4, 0.32, 0.26, 0.2]]   # the prior gains of a 2-token match
    assert decoder._choose_rows(kind2, 1, 0.0) == [0]
    for _ in range(60):
        decoder.observe_step(_decode_only(1), 1.4 * 0.0073)
    assert decoder.step_time(1) == pytest.approx(1.4 * 0.0073, rel=0.02)
    assert decoder.step_time(4) / decoder.step_time(1) == pytest.approx(0.0175 / 0.0073)
    assert decoder._choose_rows(kind2, 1, 0.0) == [0]
    # likely drafts still go out, and sizes not calibrated learn their own mean
    assert decoder._choose_rows([[0.9, 0.81, 0.73, 0.66]], 1, 0.0) == [3]
    for _ in range(3):
        decoder.table.observe(12, 0.080)
    assert decoder.step_time(12) == pytest.approx(0.080)


def _decode_only(num_tokens: int):
    """A decode-only step: one request one token behind, with ``num_tokens - 1`` drafts."""
    from tokenmill.engine.scheduler import ScheduledRequest, SchedulerOutput

    drafts = tuple(range(7, 6 + num_tokens))
    return SchedulerOutput([ScheduledRequest(_req(0.5, 0.5), 3, num_tokens, True, drafts)])
