"""A simulated replica and a real Engine make the same decisions, step by step.

Both are driven with the same requests at the same steps: a real Engine on the tiny random-weight
model (greedy, ignore_eos), then a SimReplica whose requests carry the page keys of the tokens the
Engine saw (prompt + the outputs it generated). Every step must schedule the same requests with
the same start positions and token counts, preempt the same ones, and every request must get the
same prefix-cache hit at admission.

With the engine's prefill bound on (``decode_slowdown``), the bound follows a fit of measured step
times; the simulated replica's fit is fed the times the engine measured, step for step, so that
both fits, and so both schedulers' budgets, are the same.
"""
from __future__ import annotations

import random

import pytest

from tokenmill.sim.profiles import DecodeModel, PrefillModel, ReplicaProfile
from tokenmill.sim.replica import SimReplica, SimRequest

PAGE = 16
POOL_PAGES = 16
MAX_RUNNING = 4


def _trace() -> list[tuple[int, list[int], int, int | None]]:
    """(arrival step, prompt, max_tokens, follow-up of request i or None) per request."""
    rng = random.Random(5)
    system = [rng.randrange(10, 1000) for _ in range(40)]

    def toks(n: int) -> list[int]:
        return [rng.randrange(10, 1000) for _ in range(n)]

    return [
        (0, system + toks(30), 12, None),
        (0, system + toks(50), 8, None),
        (1, toks(150), 10, None),            # chunked: 150 tokens, budget 64
        (2, system + toks(9), 20, None),
        (-1, toks(20), 6, 0),                # a second turn of request 0: its prompt + output + 20
        (6, system + toks(60), 60, None),    # the pool fills up: preemption
        (7, toks(140), 50, None),
        (-1, toks(33), 5, 3),
    ]


def _run_engine(checkpoint: str, budget: int, slowdown: float | None):
    from tokenmill.contracts.sampling import SamplingParams
    from tokenmill.engine.config import EngineConfig
    from tokenmill.engine.engine import Engine

    engine = Engine(EngineConfig(model=checkpoint, page_size=PAGE, kv_cache_tokens=POOL_PAGES * PAGE,
                                 max_batch_tokens=budget, max_running_requests=MAX_RUNNING,
                                 session_retention_s=0.0, num_threads=1, decode_slowdown=slowdown))
    times: list[tuple[int, int, float]] = []
    if engine.step_cost is not None:
        observe = engine.step_cost.observe

        def recording_observe(num_tokens: int, seconds: float, pairs: int = 0) -> None:
            times.append((num_tokens, pairs, seconds))
            observe(num_tokens, seconds, pairs)

        engine.step_cost.observe = recording_observe  # type: ignore[method-assign]
    steps: list[tuple[list[tuple[str, int, int, bool]], list[str]]] = []
    schedule = engine.scheduler.schedule

    def recording_schedule():
        out = schedule()
        if not out.is_empty:
            steps.append(([(s.request.request_id, s.start, s.num_tokens, s.samples) for s in out.scheduled],
                          [r.request_id for r in out.preempted]))
        return out

    engine.scheduler.schedule = recording_schedule  # observe what the real scheduler decides
    trace = _trace()
    prompts: dict[int, list[int]] = {}
    arrived_at: dict[int, int] = {}
    finished: dict[int, tuple[list[int], int]] = {}   # request -> (prompt + output, cached tokens)
    step = 0
    while len(finished) < len(trace):
        for i, (at, new, max_tokens, parent) in enumerate(trace):
            if i in arrived_at:
                continue
            if parent is None and at <= step:
                prompt = new
            elif parent is not None and parent in finished:
                prompt = finished[parent][0] + new
            else:
                continue
            prompts[i], arrived_at[i] = prompt, len(steps)
            engine.add_request(str(i), prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                                              ignore_eos=True))
        for o in engine.step():
            if o.finished:
                finished[int(o.request_id)] = (prompts[int(o.request_id)] + o.token_ids, o.cached_tokens)
        step += 1
        assert step < 1000
    engine.check_pages()
    split_rows = engine.step_cost.split_rows if engine.step_cost is not None else None
    return steps, arrived_at, prompts, finished, engine.num_preemptions, (times, split_rows)


def _engine_finish_slowdown() -> float | None:
    from tokenmill.engine.config import EngineConfig

    return EngineConfig.prefill_finish_slowdown   # the engine's default, which _run_engine keeps


def _run_sim(arrived_at, prompts, finished, budget: int, slowdown: float | None,
             timing: tuple[list[tuple[int, int, float]], int | None]):
    times, split_rows = timing
    prof = ReplicaProfile(name="tiny-test", kv_capacity_tokens=POOL_PAGES * PAGE, max_running_requests=MAX_RUNNING,
                          page_size=PAGE, max_prefill_tokens=budget, decode_slowdown=slowdown,
                          prefill_finish_slowdown=_engine_finish_slowdown() if slowdown else None,
                          prefill=PrefillModel(fixed_s=0.003, per_token_s=2e-5),
                          decode=DecodeModel(fixed_s=0.002, per_request_s=0.001))
    now = [0.0]
    rep = SimReplica("r0", prof, PAGE, lambda: now[0], session_retention_s=0.0, fast_forward=False)
    sc = rep.scheduler.step_cost
    if sc is not None:
        sc.split_rows = split_rows   # the engine's kinds of step (its fused decode stack's row limit)
        measured = iter(times)
        observe = sc.observe

        def replay(num_tokens: int, seconds: float, pairs: int = 0) -> None:
            n, p, t = next(measured)
            assert (n, p) == (num_tokens, pairs)
            observe(n, t, p)

        sc.observe = replay  # type: ignore[method-assign]
    reqs: dict[int, SimRequest] = {}
    for i, (tokens, _) in finished.items():
        keys = [tuple(tokens[j * PAGE:(j + 1) * PAGE]) for j in range(len(tokens) // PAGE)]
        reqs[i] = SimRequest(i, None, keys, len(prompts[i]), len(tokens) - len(prompts[i]), 0.0)
    steps: list[tuple[list[tuple[str, int, int, bool]], list[str]]] = []
    done: list[SimRequest] = []
    k = 0
    while len(done) < len(reqs):
        for i, at in arrived_at.items():
            if at == k:
                rep.submit(reqs[i], now[0])
        done += rep.on_event(now[0])
        out = rep.last_output
        if out is not None:
            steps.append(([(s.request.request_id, s.start, s.num_tokens, s.samples) for s in out.scheduled],
                          [r.request_id for r in out.preempted]))
        rep.check_invariants()
        t = rep.next_event_time()
        if t is None:
            break
        now[0] = t
        k += 1
    return steps, reqs, rep


@pytest.mark.parametrize("budget,slowdown", [(64, None), (256, 1.05)])
def test_sim_replica_and_engine_agree_step_by_step(tiny_checkpoint, budget, slowdown):
    """(256, 1.05): a budget that holds whole prompts, cut down by the prefill bound while
    decodes run (to chunks of a few tokens on this machine)."""
    eng_steps, arrived_at, prompts, finished, eng_preemptions, times = _run_engine(tiny_checkpoint, budget, slowdown)
    sim_steps, reqs, rep = _run_sim(arrived_at, prompts, finished, budget, slowdown, times)
    for n, (e, s) in enumerate(zip(eng_steps, sim_steps)):
        assert s == e, f"step {n}: engine {e}, sim {s}"
    assert len(sim_steps) == len(eng_steps)
    for i, (_, cached) in finished.items():
        assert reqs[i].cached_tokens == cached, f"request {i}"
    assert rep.num_preemptions == eng_preemptions
    # the trace exercises what it is meant to: chunking, prefix hits, preemption
    if budget < 150:
        assert any(n < 150 and start == 0 for step in eng_steps for rid, start, n, _ in step[0] if rid == "2")
    assert sum(c for _, c in finished.values()) >= 3 * PAGE
    assert eng_preemptions > 0


def test_engine_request_ids_are_sim_request_ids():
    req = SimRequest(41, "s", [1, 2, 3], 40, 5, 0.0)
    er = req.make_engine_request(16)
    assert er.request_id == "41" and er.num_prompt_tokens == 40 and er.num_tokens == 40
    assert er.params.max_tokens == 5 and er.params.ignore_eos
    assert list(er.cache_key(2)[:2]) == [1, 2]
    key = er.cache_key(4)                     # pages past the caller's keys get keys of their own
    assert len(key) >= 4 and key[3] not in (1, 2, 3) and key[3] != SimRequest(42, "s", [], 40, 5, 0.0).make_engine_request(16).cache_key(4)[3]
    assert er.all_token_ids[:16] == er.prompt_token_ids[:16]
