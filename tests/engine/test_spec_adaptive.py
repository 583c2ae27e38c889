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



def test_a_calibrated_size_learns_its_shape_and_keeps_it_under_load(decoder) -> None:
    # start-up says a 4-row step costs 2x a one-row step; at the workload's context it costs 3x.
    # The table must learn the 3x from the 4-row steps it runs, and then keep the 3x when the
    # machine gets busy and every step takes 1.5x as long (the load factor moves, not the shape).
    for n, t in ((1, 0.010), (4, 0.020)):
        decoder.table.calibrate(n, t)
    for _ in range(80):
        decoder.observe_step(_decode_only(1), 0.010)
        decoder.observe_step(_decode_only(4), 0.030)
    assert decoder.step_time(1) == pytest.approx(0.010, rel=0.02)
    assert decoder.step_time(4) == pytest.approx(0.030, rel=0.02)
    for _ in range(80):
        decoder.observe_step(_decode_only(1), 0.015)
        decoder.observe_step(_decode_only(4), 0.045)
    assert decoder.step_time(1) == pytest.approx(0.015, rel=0.02)
    assert decoder.step_time(4) / decoder.step_time(1) == pytest.approx(3.0, rel=0.02)
    # the load alone, seen on one-row steps only, scales the learnt shape
    for _ in range(60):
        decoder.observe_step(_decode_only(1), 0.020)
    assert decoder.step_time(4) == pytest.approx(0.060, rel=0.03)

def _decode_only(num_tokens: int):
    """A decode-only step: one request one token behind, with ``num_tokens - 1`` drafts."""
    from tokenmill.engine.scheduler import ScheduledRequest, SchedulerOutput

    drafts = tuple(range(7, 6 + num_tokens))
    return SchedulerOutput([ScheduledRequest(_req(0.5, 0.5), 3, num_tokens, True, drafts)])


# -- the draft gate: per-token confidences, calibrated, cut against the step times -------------
# a step of 1..9 rows on the int4 kernels' shape (ms): the second row doubles a step, rows 3-4
# add little, the fifth starts another block
INT4_SHAPE = (10.0, 20.0, 21.0, 22.0, 30.0, 31.0, 32.0, 33.0, 40.0)


def _gate(decoder):
    from tokenmill.engine.spec.base import ConfidenceCalibration

    for n, t in enumerate(INT4_SHAPE, start=1):
        decoder.table.calibrate(n, t / 1000)
        decoder.cost.observe(n, t / 1000)
    decoder.calibration = ConfidenceCalibration()
    assert decoder.gate
    return decoder


def _cut(decoder, *confidences: list[float]) -> list[int]:
    from tokenmill.engine.spec.base import Draft

    drafts = [Draft(list(range(10, 10 + len(c))), kind=2, confidence=c) for c in confidences]
    return decoder._cut([_req(0.5, 0.5, f"r{i}") for i in range(len(drafts))], drafts, len(drafts))


def test_gate_sends_the_prefix_with_the_most_tokens_per_second(decoder) -> None:
    from tokenmill.engine.spec.base import ConfidenceCalibration

    gate = _gate(decoder)
    assert ConfidenceCalibration().gains([0.9, 0.5]) == pytest.approx([0.9, 0.45])   # nothing seen: as stated
    # 0.9 each: cumulative gains .9 .81 .729 .656 .590 .531 .478 .430; tokens per ms of
    # 1 + sum over R rows / T(R + 1): R=0 .100, 1 .095, 2 .129, 3 .156, 4 .137, 5 .151,
    # 6 .163, 7 .173, 8 .153: seven rows
    assert _cut(gate, [0.9] * 8) == [7]
    # two likely tokens and a coin flip: the coin flip's row is cheap (22 ms against 21) and
    # adds .45 (3.35 / 22 = .152 against 2.85 / 21 = .136); after a 0.05 token nothing pays
    # for the next row (2.85 + .045 + .041 over 30 ms)
    assert _cut(gate, [0.95, 0.95, 0.5]) == [3]
    assert _cut(gate, [0.95, 0.95, 0.05, 0.9]) == [2]
    # a lone draft never pays for the second row, however sure; weak drafts are dropped
    assert _cut(gate, [0.95]) == [0]
    assert _cut(gate, [0.3] * 8) == [0]
    assert gate.steps_off == 2
    # the margin: rows that raise the rate by 2% (1 + .68 + .4624 = 2.1424 / 21 ms = 1.02 x 1/10)
    # go out without it and not with the gate's 3%
    assert gate._choose_rows([[0.68, 0.4624]], 1, 0.0) == [2]
    assert _cut(gate, [0.68, 0.68]) == [0]


def test_gate_keeps_likely_drafts_and_drops_unlikely_ones_across_requests(decoder) -> None:
    gate = _gate(decoder)
    # two requests share the step: the likely draft's rows go out, the unlikely one's do not
    # (2 decodes: 2 tokens / 20 ms; the sure rows bring 3.52 for 31 ms; the doubtful one's
    # first row .25 for 1 ms more, the next .06 for 1 ms more: one of its rows goes out)
    sure, doubtful = [0.95] * 4, [0.25] * 4
    assert _cut(gate, sure, doubtful) == [4, 1]
    assert _cut(gate, doubtful, sure) == [1, 4]
    assert _cut(gate, sure, [0.05] * 4) == [4, 0]


def test_calibration_moves_towards_observed_acceptance(decoder) -> None:
    from tokenmill.engine.spec.base import ConfidenceCalibration

    cal = ConfidenceCalibration()
    for _ in range(30):            # a proposer too sure: its 0.9 tokens fail at once
        cal.record([0.9, 0.9, 0.9], 3, 0)
    assert cal.rate(0.9) < 0.3
    assert cal.rate(0.5) < 0.5     # the shared scale lowers every confidence ...
    low = ConfidenceCalibration()
    for _ in range(30):            # ... and a shy one is raised: 0.3 tokens that always hold
        low.record([0.3, 0.3], 2, 2)
    assert low.rate(0.3) > 0.7
    assert ConfidenceCalibration().rate(0.3) == pytest.approx(0.3)
    # only reached tokens count: a draft rejected at its first token says nothing of the second
    part = ConfidenceCalibration()
    part.record([0.9, 0.2], 2, 0)
    assert part.reached[2] == 0.0 and part.reached[9] == 1.0
    # the gate follows: a draft it sent while trusted is dropped once such drafts fail
    gate = _gate(decoder)
    assert _cut(gate, [0.9] * 8) == [7]
    for _ in range(20):
        gate.calibration.record([0.9] * 7, 7, 0)
    assert _cut(gate, [0.9] * 8) == [0]


def test_model_free_proposers_state_a_confidence_per_token() -> None:
    from tokenmill.engine.spec.base import match_confidence
    from tokenmill.engine.spec.ngram import NgramProposer
    from tokenmill.engine.spec.suffix import SuffixProposer

    req = Request("r", [9, 1, 2, 3, 4, 5, 6, 8, 1, 2, 3, 4], SamplingParams(max_tokens=16))
    d = NgramProposer(1, 2).propose([req], [3])[0]
    # "1 2 3 4" matched (kind 4): each next token rides on a match one longer
    assert d.token_ids == [5, 6, 8] and d.kind == 4
    assert d.confidence == pytest.approx([match_confidence(4), match_confidence(5), match_confidence(6)])
    assert match_confidence(1) < match_confidence(4) < match_confidence(8) == match_confidence(20)
    # suffix: "1 2" was followed by 3 twice and by 7 once; after 3, by 4 both times
    req = Request("s", [1, 2, 3, 4, 1, 2, 3, 4, 1, 2, 7, 0, 1, 2], SamplingParams(max_tokens=16))
    d = SuffixProposer(max_depth=8).propose([req], [2])[0]
    assert d.token_ids == [3, 4]
    m = d.kind
    assert d.confidence == pytest.approx([match_confidence(m) * 2 / 3, match_confidence(m + 1) * 1.0])


def test_copied_control_tokens_get_a_low_confidence() -> None:
    from tokenmill.engine.spec.base import CONTROL_CONFIDENCE, match_confidence
    from tokenmill.engine.spec.ngram import NgramProposer

    # the prompt restates "5 6" and then ends its turn (2): copying the end marker is unlikely
    req = Request("r", [1, 5, 6, 7, 2, 1, 3, 5, 6], SamplingParams(max_tokens=16))
    prop = NgramProposer(2, 2)
    assert prop.propose([req], [3])[0].confidence == pytest.approx([match_confidence(k) for k in (2, 3, 4)])
    prop.control_token_ids = frozenset({1, 2})
    d = prop.propose([req], [3])[0]
    assert d.token_ids == [7, 2, 1]
    assert d.confidence == pytest.approx([match_confidence(2), CONTROL_CONFIDENCE, CONTROL_CONFIDENCE])
