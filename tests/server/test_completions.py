"""/v1/completions: every prompt shape, echo, logprobs, streaming."""
from __future__ import annotations

import openai

from tests.server.conftest import MODEL_NAME


def test_string_prompt(client: openai.OpenAI, tiny_tokenizer) -> None:
    prompt = "The quick brown fox"
    resp = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=5,
                                     extra_body={"return_token_ids": True, "ignore_eos": True})
    choice = resp.choices[0]
    assert resp.object == "text_completion" and choice.finish_reason == "length"
    assert choice.prompt_token_ids == tiny_tokenizer.encode(prompt)
    assert len(choice.token_ids) == 5 and tiny_tokenizer.decode(choice.token_ids, skip_special_tokens=True) == choice.text
    assert resp.usage.prompt_tokens == len(choice.prompt_token_ids) and resp.usage.completion_tokens == 5


def test_default_max_tokens_is_16(client: openai.OpenAI) -> None:
    resp = client.completions.create(model=MODEL_NAME, prompt="count", extra_body={"ignore_eos": True})
    assert resp.usage.completion_tokens == 16


def test_list_of_strings_and_n(client: openai.OpenAI) -> None:
    resp = client.completions.create(model=MODEL_NAME, prompt=["one two", "three four five"], max_tokens=3, n=2,
                                     seed=3, extra_body={"return_token_ids": True, "ignore_eos": True})
    assert [c.index for c in resp.choices] == [0, 1, 2, 3]
    assert resp.choices[0].prompt_token_ids == resp.choices[1].prompt_token_ids
    assert resp.choices[2].prompt_token_ids == resp.choices[3].prompt_token_ids
    assert resp.choices[0].prompt_token_ids != resp.choices[2].prompt_token_ids
    assert resp.usage.prompt_tokens == len(resp.choices[0].prompt_token_ids) + len(resp.choices[2].prompt_token_ids)
    assert resp.usage.completion_tokens == 12


def test_token_id_prompts(client: openai.OpenAI) -> None:
    ids = [504, 2365, 6354, 16438, 27003]
    single = client.completions.create(model=MODEL_NAME, prompt=ids, max_tokens=4, temperature=0,
                                       extra_body={"return_token_ids": True, "ignore_eos": True})
    assert single.choices[0].prompt_token_ids == ids and single.usage.prompt_tokens == 5
    batch = client.completions.create(model=MODEL_NAME, prompt=[ids, ids[:3]], max_tokens=4, temperature=0,
                                      extra_body={"return_token_ids": True, "ignore_eos": True})
    assert [c.prompt_token_ids for c in batch.choices] == [ids, ids[:3]]
    # the same greedy request gives the same tokens, alone or in a batch
    assert batch.choices[0].token_ids == single.choices[0].token_ids


def test_echo(client: openai.OpenAI, tiny_tokenizer) -> None:
    prompt = "Echo this prompt"
    plain = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=4, temperature=0,
                                      extra_body={"ignore_eos": True})
    echoed = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=4, temperature=0, echo=True,
                                       extra_body={"ignore_eos": True})
    assert echoed.choices[0].text == tiny_tokenizer.decode(tiny_tokenizer.encode(prompt)) + plain.choices[0].text
    chunks = list(client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=4, temperature=0,
                                            echo=True, stream=True, extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in chunks) == echoed.choices[0].text


def test_logprobs(client: openai.OpenAI) -> None:
    resp = client.completions.create(model=MODEL_NAME, prompt="log probs", max_tokens=5, temperature=0, logprobs=2,
                                     extra_body={"ignore_eos": True})
    lp = resp.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 5
    assert "".join(lp.tokens) == resp.choices[0].text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(5)]
    for tok, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert len(top) == 2 and logprob <= 0
        assert max(top, key=top.get) == tok  # greedy picks the most likely token


def test_stream_equals_non_stream(client: openai.OpenAI) -> None:
    kwargs = dict(model=MODEL_NAME, prompt="stream me", max_tokens=9, temperature=0, extra_body={"ignore_eos": True})
    full = client.completions.create(**kwargs)
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 9


def test_stop_string(client: openai.OpenAI) -> None:
    kwargs = dict(model=MODEL_NAME, prompt="stop somewhere", max_tokens=12, temperature=0,
                  extra_body={"ignore_eos": True})
    base = client.completions.create(**kwargs).choices[0].text
    stop = base[len(base) // 2:len(base) // 2 + 2]
    resp = client.completions.create(stop=stop, **kwargs)
    assert resp.choices[0].text == base[:base.find(stop)]
    assert resp.choices[0].finish_reason == "stop"


def test_streamed_token_ids_are_complete(client: openai.OpenAI) -> None:
    """Chunks whose text is held back (split UTF-8, possible stop string) still carry their ids."""
    # Random weights emit many byte-level tokens, so some steps decode to no text yet.
    kwargs = dict(model=MODEL_NAME, prompt="Stream ids", max_tokens=24, temperature=0,
                  extra_body={"return_token_ids": True, "ignore_eos": True})
    whole = client.completions.create(**kwargs)
    chunks = list(client.completions.create(stream=True, **kwargs))
    streamed = [t for c in chunks for ch in c.choices for t in (getattr(ch, "token_ids", None) or [])]
    assert streamed == whole.choices[0].token_ids
    assert len(streamed) == 24
