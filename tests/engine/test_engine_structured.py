"""Structured outputs in the engine (grammar masks, the compile wait room) and prompt logprobs."""
from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch

from engine_oracle import hf_logits, random_prompts
from tokenmill import LLM, SamplingParams
from tokenmill.contracts.sampling import StructuredOutputs
from tokenmill.engine.structured import GrammarError

SCHEMA = {
    "type": "object",
    "properties": {
        "kind": {"type": "string", "enum": ["a", "b", "c"]},
        "n": {"type": "integer", "minimum": 0, "maximum": 99},
        "flags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3},
    },
    "required": ["kind", "n", "flags"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def llm(tiny_llama) -> LLM:
    lm, _ = tiny_llama
    return LLM(loaded=lm, kv_cache_tokens=4096, max_batch_tokens=64, debug_checks=True)


def _params(spec: StructuredOutputs, **kw) -> SamplingParams:
    return SamplingParams(**{"max_tokens": 64, "temperature": 1.0, **kw}, structured=spec)


def test_json_schema_outputs_validate(llm: LLM) -> None:
    prompts = random_prompts([5, 9, 17, 30], seed=1)
    spec = StructuredOutputs.json(SCHEMA)
    outs = llm.generate(prompts, [_params(spec, seed=i) for i in range(len(prompts))])
    for out in outs:
        assert out.finish_reason == "stop", out
        jsonschema.validate(json.loads(out.text), SCHEMA)


def test_regex_and_choice(llm: LLM) -> None:
    prompts = random_prompts([7, 7], seed=2)
    regex = StructuredOutputs("regex", r"[a-z]{2,5}-[0-9]{3}")
    choice = StructuredOutputs.choice(["red", "green", "blue sky"])
    outs = llm.generate(prompts * 3, [_params(regex, seed=i) for i in range(2)]
                        + [_params(choice, seed=i) for i in range(2)] + [_params(regex, temperature=0)] * 2)
    for out in outs[:2] + outs[4:]:
        assert re.fullmatch(r"[a-z]{2,5}-[0-9]{3}", out.text), out.text
    for out in outs[2:4]:
        assert out.text in ("red", "green", "blue sky"), out.text


def test_grammar_that_can_only_end_with_eos_ends_there(llm: LLM) -> None:
    eos = sorted(llm.engine.eos_token_ids)
    out = llm.generate([random_prompts([6], seed=3)[0]],
                       _params(StructuredOutputs("grammar", 'root ::= "ok" " done"'), temperature=0))[0]
    assert out.text == "ok done"
    assert out.finish_reason == "stop"
    assert out.token_ids[-1] in eos  # the grammar left EOS as the only choice


def test_constrained_and_unconstrained_in_one_batch(llm: LLM) -> None:
    prompts = random_prompts([12, 20, 8], seed=4)
    plain = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    alone = llm.generate(prompts, plain)
    spec = StructuredOutputs.json(SCHEMA)
    mixed = llm.generate(prompts + prompts, [plain] * 3 + [_params(spec, temperature=0)] * 3)
    assert [o.token_ids for o in mixed[:3]] == [o.token_ids for o in alone]
    for out in mixed[3:]:
        jsonschema.validate(json.loads(out.text), SCHEMA)


def test_invalid_constraints_are_named(llm: LLM) -> None:
    compiler = llm.engine.grammar_compiler
    with pytest.raises(GrammarError, match="json_schema"):
        compiler.compile_now(StructuredOutputs("json_schema", '{"type": "object", "properties": 3}'))
    with pytest.raises(GrammarError, match="not valid JSON"):
        compiler.compile_now(StructuredOutputs("json_schema", "{nope"))
    with pytest.raises(GrammarError):
        compiler.compile_now(StructuredOutputs("grammar", "root ::= undefined_rule"))
    # through the engine: a failed compile finishes that request only, with the reason
    bad = StructuredOutputs("regex", "([a-z")
    outs = llm.generate(random_prompts([5, 5], seed=5), [_params(bad), SamplingParams(max_tokens=3, temperature=0)])
    assert outs[0].finish_reason == "abort" and "regex" in str(outs[0].stop_reason)
    assert len(outs[1].token_ids) >= 1


def test_grammar_is_compiled_once_per_spec(llm: LLM) -> None:
    compiler = llm.engine.grammar_compiler
    spec = StructuredOutputs("regex", r"x{1,3}y")
    before = compiler.num_compiled
    llm.generate(random_prompts([4, 4, 4], seed=6), _params(spec))
    llm.generate(random_prompts([4], seed=7), _params(spec))
    assert compiler.num_compiled == before + 1


def test_matcher_tests_a_draft_and_rolls_back(llm: LLM) -> None:
    compiler = llm.engine.grammar_compiler
    tok = llm.engine.tokenizer
    state = compiler.matcher(compiler.compile_now(StructuredOutputs.choice(["hello world"])))
    good = tok.encode("hello world", add_special_tokens=False)
    draft = good[:1] + tok.encode(" nope", add_special_tokens=False)
    assert state.accept_tokens(draft) == 1          # the grammar stops the draft after one token
    state.rollback(1)
    assert state.accept_tokens(good) == len(good)
    state.rollback(len(good))
    assert state.num_accepted == 0 and state.accept_tokens(good) == len(good)


@pytest.mark.parametrize("chunk", [64, 7])
def test_prompt_logprobs_match_hf(tiny_llama, chunk: int) -> None:
    lm, ref = tiny_llama
    llm = LLM(loaded=lm, kv_cache_tokens=4096, max_batch_tokens=chunk, debug_checks=True)
    prompts = random_prompts([40, 19], seed=8)
    plain = SamplingParams(max_tokens=2, temperature=0)
    llm.generate(prompts, plain)  # now cached: the logprob requests must still compute every row
    outs = llm.generate(prompts, SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=3))
    for ids, out in zip(prompts, outs):
        assert out.cached_tokens == 0
        got = out.prompt_logprobs
        assert got is not None and len(got) == len(ids) and got[0] is None
        ref_lp = torch.log_softmax(hf_logits(ref, ids), dim=-1)
        want = ref_lp[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]
        assert [e.token_id for e in got[1:]] == ids[1:]
        assert torch.allclose(torch.tensor([e.logprob for e in got[1:]]), want, atol=1e-4)
        for p, e in enumerate(got[1:]):
            top = ref_lp[p].topk(3)
            assert [t.token_id for t in e.top_logprobs] == top.indices.tolist()
            assert torch.allclose(torch.tensor([t.logprob for t in e.top_logprobs]), top.values, atol=1e-4)


def test_a_compiling_grammar_does_not_hold_up_the_batch(tiny_llama) -> None:
    import threading

    from tokenmill.engine.config import EngineConfig
    from tokenmill.engine.engine import Engine

    lm, _ = tiny_llama
    engine = Engine(EngineConfig(kv_cache_tokens=2048, debug_checks=True), loaded=lm)
    compiler = engine.grammar_compiler
    gate = threading.Event()
    compiler._pool.submit(gate.wait)   # occupy the compile worker: the next compile has to wait
    prompts = random_prompts([6, 6], seed=9)
    engine.add_request("free", prompts[0], SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))
    engine.add_request("bound", prompts[1], _params(StructuredOutputs("regex", r"q{2,4}"), temperature=0))
    progressed = []
    for _ in range(5):
        progressed += [o.request_id for o in engine.step()]
    assert progressed == ["free"] * 5          # the free request ran to its end meanwhile
    assert engine.has_unfinished_requests()    # the constrained one is still waiting for its grammar
    gate.set()
    final = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            final[o.request_id] = o
    assert final["bound"].finish_reason == "stop" and re.fullmatch(r"q{2,4}", final["bound"].text)


@pytest.mark.parametrize("fused_decode", [True, False])
def test_constrained_requests_survive_preemption(tiny_llama, fused_decode: bool) -> None:
    lm, _ = tiny_llama
    llm = LLM(loaded=lm, kv_cache_tokens=128, max_batch_tokens=64, debug_checks=True, fused_decode=fused_decode)
    spec = StructuredOutputs.json(SCHEMA)
    outs = llm.generate(random_prompts([40, 44, 48, 52], seed=10),
                        [_params(spec, seed=i, max_tokens=60) for i in range(4)])
    assert llm.engine.num_preemptions > 0
    for out in outs:
        jsonschema.validate(json.loads(out.text), SCHEMA)
