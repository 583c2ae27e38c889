"""Stop conditions, streaming deltas, request validation, abort, prefix cache, stats, CLI."""
from __future__ import annotations

import subprocess
import sys

import pytest
from transformers import AutoTokenizer

from engine_oracle import random_prompts
from tokenmill import LLM, SamplingParams
from tokenmill.engine.config import EngineConfig
from tokenmill.engine.detokenizer import IncrementalDetokenizer
from tokenmill.engine.engine import Engine

GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_llama) -> LLM:
    lm, _ = tiny_llama
    return LLM(loaded=lm, kv_cache_tokens=1024, debug_checks=True)


@pytest.fixture(scope="module")
def tokenizer(tiny_dir):
    return AutoTokenizer.from_pretrained(str(tiny_dir("LlamaForCausalLM")))


# -- detokenizer ---------------------------------------------------------------------------------
def test_streamed_deltas_equal_the_decoded_whole(tokenizer) -> None:
    text = "Hello wörld 😀, naïve café — done.\n  indented"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    detok = IncrementalDetokenizer(tokenizer, tokenizer("Say:")["input_ids"])
    parts = []
    for t in ids:
        assert detok.add_token(t) is None
        parts.append(detok.take_new_text(finished=False))
    assert "".join(parts) == tokenizer.decode(ids) == text


def test_flush_keeps_a_trailing_partial_character(tokenizer) -> None:
    """Output that ends inside a multi-byte character still equals decoding the whole output."""
    ids = tokenizer("ok 😀", add_special_tokens=False)["input_ids"]
    cut = next(k for k in range(1, len(ids)) if tokenizer.decode(ids[:k]).endswith("\ufffd"))
    detok = IncrementalDetokenizer(tokenizer, [])
    for t in ids[:cut]:
        detok.add_token(t)
    assert detok.take_new_text(finished=False) == "ok"  # the partial character is not emitted yet
    detok.flush()
    assert detok.take_new_text(finished=True) == tokenizer.decode(ids[:cut])[len("ok"):]
    assert detok.emitted_text == tokenizer.decode(ids[:cut])


def test_stop_string_split_across_tokens_is_cut_and_held_back(tokenizer) -> None:
    text = "alpha beta gamma delta"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert [tokenizer.decode([t]) for t in ids] == ["alpha", " beta", " gamma", " delta"]
    stop = "ma del"  # starts inside " gamma", ends inside " delta"
    detok = IncrementalDetokenizer(tokenizer, [], stop=[stop])
    emitted = []
    for t in ids[:3]:
        assert detok.add_token(t) is None
        emitted.append(detok.take_new_text(finished=False))
    assert emitted == ["alpha", " beta", " gam"]  # "ma" may start the stop string: held back
    assert detok.add_token(ids[3]) == stop
    assert detok.take_new_text(finished=True) == "" and detok.text == "alpha beta gam"
    # without a stop string nothing is held back
    plain = IncrementalDetokenizer(tokenizer, [])
    for t in ids[:3]:
        plain.add_token(t)
    assert plain.take_new_text(finished=False) == "alpha beta gamma"


# -- stop conditions in the engine ---------------------------------------------------------------
def test_stop_string_and_stop_token_ids(llm: LLM, tokenizer) -> None:
    prompt = random_prompts([12], seed=3)[0]
    full = llm.generate([prompt], GREEDY)[0]
    assert full.finish_reason == "length" and len(full.token_ids) == 16
    # a stop token id: the first occurrence of the 5th output token
    tok = full.token_ids[4]
    k = full.token_ids.index(tok)
    out = llm.generate([prompt], SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True,
                                                stop_token_ids=[tok]))[0]
    assert out.token_ids == full.token_ids[:k + 1]
    assert (out.finish_reason, out.stop_reason) == ("stop", tok)
    assert out.text == tokenizer.decode(full.token_ids[:k], skip_special_tokens=True)
    # a stop string: three characters from the middle of the greedy text
    text = full.text
    mid = len(text) // 2
    stop = text[mid:mid + 3]
    cut = text.index(stop)
    out = llm.generate([prompt], SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, stop=[stop]))[0]
    assert (out.finish_reason, out.stop_reason) == ("stop", stop)
    assert out.text == text[:cut]
    assert full.token_ids[:len(out.token_ids)] == out.token_ids


def test_step_outputs_stream_consistent_deltas(tiny_llama) -> None:
    lm, _ = tiny_llama
    engine = Engine(EngineConfig(kv_cache_tokens=512), loaded=lm)
    prompt = random_prompts([20], seed=4)[0]
    engine.add_request("s", prompt, SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True))
    ids, text, last = [], "", None
    while engine.has_unfinished_requests():
        for out in engine.step():
            ids += out.new_token_ids
            text += out.new_text
            last = out
    assert last is not None and last.finished and last.finish_reason == "length"
    assert ids == last.token_ids and text == last.text and len(ids) == 10


# -- validation ----------------------------------------------------------------------------------
def test_bad_requests_are_rejected_with_clear_errors(tiny_llama) -> None:
    lm, _ = tiny_llama
    engine = Engine(EngineConfig(kv_cache_tokens=256, max_model_len=200), loaded=lm)
    ok = SamplingParams(max_tokens=4)
    with pytest.raises(ValueError, match="empty"):
        engine.add_request("a", [], ok)
    with pytest.raises(ValueError, match="vocabulary"):
        engine.add_request("a", [1, 10**6], ok)
    with pytest.raises(ValueError, match="integers"):
        engine.add_request("a", [1, 2.5], ok)  # type: ignore[list-item]
    with pytest.raises(ValueError, match="maximum context length 200"):
        engine.add_request("a", [5] * 190, SamplingParams(max_tokens=20))
    engine2 = Engine(EngineConfig(kv_cache_tokens=64), loaded=lm)
    with pytest.raises(ValueError, match="KV cache capacity of 64"):
        engine2.add_request("a", [5] * 60, SamplingParams(max_tokens=8))
    engine.add_request("a", [5, 6], ok)
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("a", [5, 6], ok)
    with pytest.raises(ValueError, match="exceeds the model's context length"):
        Engine(EngineConfig(max_model_len=10**7, kv_cache_tokens=64), loaded=lm)


@pytest.mark.parametrize("kwargs,match", [
    (dict(max_tokens=0), "max_tokens"), (dict(temperature=-1.0), "temperature"),
    (dict(top_p=0.0), "top_p"), (dict(top_k=-1), "top_k"), (dict(min_p=1.5), "min_p"),
    (dict(presence_penalty=3.0), "presence_penalty"), (dict(repetition_penalty=0.0), "repetition_penalty"),
    (dict(stop=[""]), "stop strings"), (dict(logprobs=99), "logprobs")])
def test_sampling_params_validate(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("kwargs,match", [
    (dict(page_size=0), "page_size"), (dict(kv_cache_tokens=100, kv_cache_memory_gib=1.0), "at most one"),
    (dict(max_batch_tokens=0), "max_batch_tokens"), (dict(dtype="int8"), "dtype")])
def test_engine_config_validates(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        EngineConfig(**kwargs)


# -- abort, prefix cache, stats ------------------------------------------------------------------
def test_abort_frees_pages_and_leaves_others_intact(tiny_llama) -> None:
    lm, _ = tiny_llama
    engine = Engine(EngineConfig(kv_cache_tokens=512, debug_checks=True), loaded=lm)
    a, b = random_prompts([30, 25], seed=6)
    engine.add_request("a", a, GREEDY)
    engine.add_request("b", b, GREEDY)
    engine.step()
    engine.step()
    assert engine.stats().num_running == 2
    engine.abort_request("a")
    engine.abort_request("nope")  # unknown ids are ignored
    engine.check_pages()
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    assert {o.request_id for o in outs} == {"b"}
    solo = LLM(loaded=lm, kv_cache_tokens=512, enable_prefix_cache=False).generate([b], GREEDY)[0]
    assert outs[-1].token_ids == solo.token_ids
    assert engine.stats().kv_pages_free + engine.stats().kv_pages_cached == engine.stats().kv_pages_total


def test_prefix_cache_hits_multi_turn_and_keeps_outputs(tiny_llama) -> None:
    lm, _ = tiny_llama
    cached = LLM(loaded=lm, kv_cache_tokens=1024, debug_checks=True)
    plain = LLM(loaded=lm, kv_cache_tokens=1024, enable_prefix_cache=False)
    turn1 = random_prompts([45], seed=9)[0]
    p = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    out1 = cached.generate([turn1], p, session_ids=["s1"])[0]
    assert out1.cached_tokens == 0
    # 45 + 12 tokens, the last sampled one without KV: 56 computed -> 3 whole pages cached
    turn2 = turn1 + out1.token_ids + random_prompts([10], seed=10)[0]
    out2 = cached.generate([turn2], p, session_ids=["s1"])[0]
    assert out2.cached_tokens == 48
    assert out2.token_ids == plain.generate([turn2], p)[0].token_ids
    again = cached.generate([turn1], p)[0]
    assert again.cached_tokens == 32 and again.token_ids == out1.token_ids  # match on prompt[:-1]
    s = cached.engine.stats()
    assert s.prompt_tokens_total == 45 + len(turn2) + 45
    assert s.cached_tokens_total == 48 + 32 and s.generation_tokens_total == 36
    assert 0 < s.cache_hit_rate < 1 and s.kv_pages_cached > 0 and s.kv_cache_usage == 0.0
    assert plain.engine.stats().cached_tokens_total == 0
    assert cached.engine.flush_cache()
    s = cached.engine.stats()
    assert s.kv_pages_cached == 0 and s.kv_pages_free == s.kv_pages_total


def test_flush_cache_is_refused_while_requests_run(llm: LLM) -> None:
    engine = llm.engine
    engine.add_request("busy", [5, 6, 7], GREEDY)
    assert engine.flush_cache() is False
    engine.abort_request("busy")
    assert engine.flush_cache() is True


# -- offline API and CLI -------------------------------------------------------------------------
def test_llm_accepts_token_ids_strings_and_per_prompt_params(llm: LLM) -> None:
    ids = random_prompts([8], seed=11)[0]
    one = llm.generate(ids, GREEDY)  # a single prompt given as token ids
    assert len(one) == 1 and len(one[0].token_ids) == 16
    outs = llm.generate(["hello there", ids], [SamplingParams(max_tokens=3, temperature=0.0),
                                               SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)])
    assert len(outs[1].token_ids) == 5 and outs[1].token_ids == one[0].token_ids[:5]
    assert outs[0].prompt_token_ids == llm.tokenizer("hello there")["input_ids"]
    with pytest.raises(ValueError, match="2 prompts but 1 SamplingParams"):
        llm.generate(["a", "b"], [GREEDY])
    chat = llm.chat([{"role": "user", "content": "Hi"}], SamplingParams(max_tokens=4, temperature=0.0))
    assert chat[0].prompt_token_ids[-3:] == llm.tokenizer("<|im_start|>assistant\n", add_special_tokens=False)["input_ids"][-3:]


def test_generate_cli_prints_the_completion(tiny_dir, llm: LLM) -> None:
    model = str(tiny_dir("LlamaForCausalLM"))
    expected = llm.generate(["Write a haiku"], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))[0]
    run = subprocess.run([sys.executable, "-m", "tokenmill.cli", "generate", "--model", model, "--prompt",
                          "Write a haiku", "--max-tokens", "6", "--ignore-eos", "--kv-cache-tokens", "256"],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert run.stdout == expected.text + "\n"
    bad = subprocess.run([sys.executable, "-m", "tokenmill.cli", "generate", "--model", model, "--prompt",
                          "x", "--max-tokens", "0"], capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and "max_tokens must be an integer >= 1" in bad.stderr
