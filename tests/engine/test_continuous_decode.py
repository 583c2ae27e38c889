"""Chained greedy decode steps (``EngineConfig.num_continuous_decode_steps``): the same outputs as
one step at a time, chains only where every running request decodes greedily and nothing waits,
every stop condition inside a chain, and no page left behind."""
from __future__ import annotations

import pytest

from engine_oracle import random_prompts
from tokenmill import LLM, SamplingParams
from tokenmill._native import attention as attention_kernel
from tokenmill._native import quant as native
from tokenmill.engine.config import EngineConfig
from tokenmill.engine.model_runner import ModelRunner
from tokenmill.engine.spec.base import Draft, Proposer
from tokenmill.loader import load_model

pytestmark = pytest.mark.skipif(not (native.available() and attention_kernel.available()),
                                reason=str(native.unavailable_reason() or attention_kernel.unavailable_reason()))


@pytest.fixture(scope="module")
def int4(tiny_dir):
    return load_model(str(tiny_dir("LlamaForCausalLM")), quantization="int4")


class _Chains:
    """Counts the runner's steps by their chain length while a test runs."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.lengths: list[int] = []
        orig = ModelRunner.execute

        def execute(runner, out, decode_steps: int = 1):
            self.lengths.append(decode_steps)
            return orig(runner, out, decode_steps)

        monkeypatch.setattr(ModelRunner, "execute", execute)


def _llm(lm, steps: int) -> LLM:
    llm = LLM(loaded=lm, kv_cache_tokens=2048, debug_checks=True, num_continuous_decode_steps=steps)
    llm.engine._decode_step_s.clear()
    return llm


def _run(llm: LLM, prompts, params):
    outs = llm.generate(prompts, params)
    eng = llm.engine
    assert not eng.has_unfinished_requests()
    eng.scheduler.check_pages()
    # every page is free or held by the prefix cache alone (nothing leaked by a chain's end)
    assert eng.kv.pool.num_free() + (eng.kv.cache.num_cached_pages if eng.kv.cache is not None else 0) == eng.kv.pool.num_pages
    return [(o.token_ids, o.finish_reason, o.text) for o in outs]


def test_chained_steps_give_the_outputs_of_single_steps(int4, monkeypatch):
    """Greedy batches of 1 and 3 requests, max_tokens not a multiple of the chain: the same tokens,
    texts and finish reasons with chains of up to 6 steps as with none, and the chains ran."""
    prompts = random_prompts([5, 17, 9], seed=4)
    params = SamplingParams(max_tokens=23, temperature=0.0, ignore_eos=True)
    want = _run(_llm(int4, 1), prompts, params)
    want1 = _run(_llm(int4, 1), prompts[:1], params)
    chains = _Chains(monkeypatch)
    llm = _llm(int4, 6)
    assert _run(llm, prompts, params) == want
    assert _run(_llm(int4, 6), prompts[:1], params) == want1
    assert max(chains.lengths) == 6 and len(chains.lengths) <= 2 * 6   # 23 tokens in 6 steps, not 23
    st = llm.engine.stats()   # 21 decode tokens after the prefill and the timed step: chains 6, 6, 6, 3
    assert (st.decode_chains_total, st.decode_chain_steps_total) == (4, 21)


def test_a_stop_inside_a_chain_ends_the_request_there(int4, monkeypatch):
    """A stop token id, a stop string and max_tokens that fall inside a chain end each request at
    the same token as without chains; the chain's K/V past the stop is not kept (page check)."""
    prompts = random_prompts([6, 11], seed=9)
    free = _run(_llm(int4, 1), prompts, SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True))
    toks, _, text = free[0]
    cases = [SamplingParams(max_tokens=30, temperature=0.0, stop_token_ids=[toks[9]]),
             SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True, stop=[text[len(text) // 2:][:3]]),
             SamplingParams(max_tokens=13, temperature=0.0, ignore_eos=True)]
    for params in cases:
        want = _run(_llm(int4, 1), prompts, params)
        chains = _Chains(monkeypatch)
        got = _run(_llm(int4, 8), prompts, params)
        assert got == want
        assert max(chains.lengths) > 1
    assert want[0][1] == "length" and len(want[0][0]) == 13


def test_no_chain_beside_a_sampled_or_penalised_request(int4, monkeypatch):
    """A request that samples (seeded), uses a penalty or asks for logprobs keeps every step of
    the batch single: the greedy request beside it and the sampled one both get what they get
    without chains. Once it is alone, a greedy request chains."""
    prompts = random_prompts([7, 8], seed=2)
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    for other in (SamplingParams(max_tokens=12, temperature=0.8, seed=5, ignore_eos=True),
                  SamplingParams(max_tokens=12, temperature=0.0, repetition_penalty=1.3, ignore_eos=True),
                  SamplingParams(max_tokens=12, temperature=0.0, logprobs=2, ignore_eos=True)):
        want = _run(_llm(int4, 1), prompts, [greedy, other])
        chains = _Chains(monkeypatch)
        assert _run(_llm(int4, 8), prompts, [greedy, other]) == want
        assert chains.lengths and set(chains.lengths) == {1}
    chains = _Chains(monkeypatch)
    _run(_llm(int4, 8), prompts[:1], greedy)
    assert max(chains.lengths) > 1


class _FixedStepTime(dict):
    """A decode step time table that reads ``seconds`` for every batch size and learns nothing."""

    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.seconds = seconds

    def get(self, rows, default=None):
        return self.seconds

    def __setitem__(self, rows, seconds) -> None:
        pass


def test_chain_length_follows_the_time_budget(int4, monkeypatch):
    """A chain runs for at most CHAIN_BUDGET_S at the measured decode step time (and at most
    num_continuous_decode_steps): a budget of 3.5 step times gives chains of 3, one below a step
    time none, an unbounded one the configured 8."""
    import tokenmill.engine.engine as engine_mod

    llm = _llm(int4, 8)
    monkeypatch.setattr(llm.engine, "_decode_step_s", _FixedStepTime(0.01))
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    for budget, want in ((0.035, {1, 3}), (0.009, {1}), (1e9, {1, 8, 3})):
        monkeypatch.setattr(engine_mod, "CHAIN_BUDGET_S", budget)
        chains = _Chains(monkeypatch)
        llm.generate(random_prompts([5], seed=1), params)
        assert set(chains.lengths) == want, (budget, chains.lengths)


def test_config_refuses_zero_steps():
    with pytest.raises(ValueError, match="num_continuous_decode_steps must be >= 1"):
        EngineConfig(num_continuous_decode_steps=0)


class _Sometimes(Proposer):
    """Drafts the known continuation (3 tokens) at every 12th output position and nothing
    elsewhere: a speculative engine with verify steps and steps without drafts."""

    name = "sometimes"

    def __init__(self, continuations: dict[tuple[int, ...], list[int]]) -> None:
        self.continuations = continuations

    def propose(self, requests, num_tokens):
        out = []
        for req, k in zip(requests, num_tokens):
            done = req.num_output_tokens
            full = self.continuations[tuple(req.prompt_token_ids)]
            out.append(Draft(list(full[done:done + min(k, 3)]) if done % 12 == 1 else []))
        return out


def test_speculation_chains_the_steps_without_drafts(int4, monkeypatch):
    """With speculation on, steps whose requests have no drafts chain and verify steps do not; the
    outputs are those of plain greedy decoding one step at a time."""
    prompts = random_prompts([12, 7], seed=6)
    params = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
    want = _run(_llm(int4, 1), prompts, params)
    seen: list[tuple[int, bool]] = []
    orig = ModelRunner.execute

    def execute(runner, out, decode_steps: int = 1):
        seen.append((decode_steps, any(s.num_draft for s in out.scheduled)))
        return orig(runner, out, decode_steps)

    monkeypatch.setattr(ModelRunner, "execute", execute)
    llm = LLM(loaded=int4, kv_cache_tokens=2048, debug_checks=True, num_continuous_decode_steps=8,
              speculative_method="ngram", speculative_adaptive=False)
    llm.engine.spec.proposer = _Sometimes({tuple(p): list(t) + [5] * 8 for p, (t, _, _) in zip(prompts, want)})
    assert _run(llm, prompts, params) == want
    assert any(d for _, d in seen), "no verify step"
    assert any(n > 1 for n, _ in seen), "no chain"
    assert not any(n > 1 and d for n, d in seen)
    assert llm.engine.stats().spec.accepted > 0


def test_interrupt_chain_cuts_chains_to_a_step(int4, monkeypatch):
    """Engine.interrupt_chain (what AsyncEngine calls when a command arrives) makes every chain
    stop after its first step until it is turned off: the same outputs, one token per step."""
    prompts = random_prompts([9], seed=3)
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    want = _run(_llm(int4, 1), prompts, params)
    llm = _llm(int4, 8)
    tokens: list[int] = []
    orig = ModelRunner.execute

    def execute(runner, out, decode_steps: int = 1):
        result = orig(runner, out, decode_steps)
        if decode_steps > 1:
            tokens.append(len(result.sampled[0].token_ids))
        return result

    monkeypatch.setattr(ModelRunner, "execute", execute)
    llm.engine.interrupt_chain(True)
    assert _run(llm, prompts, params) == want
    assert tokens and set(tokens) == {1}
    llm.engine.interrupt_chain(False)
    tokens.clear()
    assert _run(llm, prompts, params) == want
    assert max(tokens) > 1


def test_async_engine_interrupts_a_chain_when_a_request_arrives(int4, monkeypatch):
    """AsyncEngine sets the chain's stop flag whenever it queues a command and clears it before it
    hands the engine its commands; a request submitted while another streams in chains gets
    in, and both outputs are those without chains."""
    import asyncio

    from tokenmill.engine.async_engine import AsyncEngine
    from tokenmill.engine.engine import Engine

    prompts = random_prompts([9, 6], seed=8)
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    want = _run(_llm(int4, 1), prompts, params)
    calls: list[bool] = []
    orig = Engine.interrupt_chain
    monkeypatch.setattr(Engine, "interrupt_chain", lambda self, on=True: (calls.append(on), orig(self, on))[1])
    engine = Engine(EngineConfig(model=str(int4.source), kv_cache_tokens=2048, num_continuous_decode_steps=8),
                    loaded=int4)
    ae = AsyncEngine(engine)

    async def one(i: int, after: asyncio.Event | None, started: asyncio.Event | None):
        if after is not None:
            await after.wait()
        toks = []
        async for out in ae.generate(f"r{i}", prompts[i], params):
            toks.extend(out.new_token_ids)
            if started is not None and len(toks) >= 5:
                started.set()
        return toks

    async def main():
        started = asyncio.Event()
        return await asyncio.gather(one(0, None, started), one(1, started, None))

    try:
        got = asyncio.run(main())
    finally:
        ae.shutdown()
    assert [list(t) for t in got] == [list(w[0]) for w in want]
    # each submission set the flag, and a drain after it cleared it
    assert calls.count(True) >= 2 and calls[-1] is False
    assert all(False in calls[i + 1:] for i, on in enumerate(calls) if on)
