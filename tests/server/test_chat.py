"""/v1/chat/completions against a real server on a tiny random Llama, through the openai client."""
from __future__ import annotations

import uuid

import openai

from tests.server.conftest import MODEL_NAME, PAGE_SIZE


def _messages(text: str | None = None) -> list[dict]:
    return [{"role": "user", "content": text or f"hello {uuid.uuid4().hex}"}]


def test_chat_non_streamed_uses_template_and_counts(client: openai.OpenAI, tiny_tokenizer) -> None:
    msgs = _messages()
    resp = client.chat.completions.create(model=MODEL_NAME, messages=msgs, max_tokens=6, temperature=0,
                                          extra_body={"return_token_ids": True, "ignore_eos": True})
    assert resp.object == "chat.completion" and resp.model == MODEL_NAME
    choice = resp.choices[0]
    assert choice.finish_reason == "length" and choice.message.role == "assistant"
    assert isinstance(choice.message.content, str) and choice.message.content
    expected_prompt = tiny_tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    assert resp.prompt_token_ids == tiny_tokenizer.encode(expected_prompt, add_special_tokens=False)
    assert len(choice.token_ids) == 6
    assert tiny_tokenizer.decode(choice.token_ids, skip_special_tokens=True) == choice.message.content
    assert resp.usage.prompt_tokens == len(resp.prompt_token_ids)
    assert resp.usage.completion_tokens == 6
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + 6


def test_chat_stream_equals_non_stream_and_reports_usage(client: openai.OpenAI) -> None:
    msgs = _messages()
    full = client.chat.completions.create(model=MODEL_NAME, messages=msgs, max_tokens=8, temperature=0,
                                          extra_body={"ignore_eos": True})
    stream = client.chat.completions.create(model=MODEL_NAME, messages=msgs, max_tokens=8, temperature=0,
                                            stream=True, stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True, "return_token_ids": True})
    text, finish, usage, roles, ids = "", None, None, [], []
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
            assert chunk.choices == []
            continue
        delta = chunk.choices[0].delta
        roles.append(delta.role)
        text += delta.content or ""
        ids += getattr(chunk.choices[0], "token_ids", None) or []
        finish = chunk.choices[0].finish_reason or finish
    assert roles[0] == "assistant"
    assert text == full.choices[0].message.content
    assert finish == "length"
    assert len(ids) == 8
    assert usage is not None and usage.completion_tokens == 8
    assert usage.prompt_tokens == full.usage.prompt_tokens


def test_max_completion_tokens_wins(client: openai.OpenAI) -> None:
    resp = client.chat.completions.create(model=MODEL_NAME, messages=_messages(), max_completion_tokens=3,
                                          extra_body={"ignore_eos": True})
    assert resp.usage.completion_tokens == 3 and resp.choices[0].finish_reason == "length"


def test_stop_string_cuts_output(client: openai.OpenAI) -> None:
    msgs = _messages()
    base = client.chat.completions.create(model=MODEL_NAME, messages=msgs, max_tokens=12, temperature=0,
                                          extra_body={"ignore_eos": True}).choices[0].message.content
    assert len(base) > 6
    cut = len(base) // 2
    stop = base[cut:cut + 3]
    expected = base[:base.find(stop)]
    for stream in (False, True):
        if stream:
            chunks = list(client.chat.completions.create(model=MODEL_NAME, messages=msgs, max_tokens=12,
                                                         temperature=0, stop=[stop], stream=True,
                                                         extra_body={"ignore_eos": True}))
            text = "".join(c.choices[0].delta.content or "" for c in chunks)
            finish = chunks[-1].choices[0].finish_reason
        else:
            resp = client.chat.completions.create(model=MODEL_NAME, messages=msgs, max_tokens=12, temperature=0,
                                                  stop=stop, extra_body={"ignore_eos": True})
            text, finish = resp.choices[0].message.content, resp.choices[0].finish_reason
        assert text == expected
        assert finish == "stop"


def test_logprobs_and_top_logprobs(client: openai.OpenAI) -> None:
    resp = client.chat.completions.create(model=MODEL_NAME, messages=_messages(), max_tokens=5, temperature=0,
                                          logprobs=True, top_logprobs=3, extra_body={"ignore_eos": True})
    content = resp.choices[0].logprobs.content
    assert len(content) == 5
    assert "".join(e.token for e in content) == resp.choices[0].message.content
    for entry in content:
        assert entry.logprob <= 0.0
        tops = [t.logprob for t in entry.top_logprobs]
        assert len(tops) == 3 and tops == sorted(tops, reverse=True)
        # greedy: the chosen token is the most likely one
        assert entry.top_logprobs[0].token == entry.token
        assert abs(entry.top_logprobs[0].logprob - entry.logprob) < 1e-5
        assert bytes(entry.bytes).decode("utf-8", errors="replace") == entry.token


def test_logprobs_in_stream(client: openai.OpenAI) -> None:
    chunks = list(client.chat.completions.create(model=MODEL_NAME, messages=_messages(), max_tokens=4,
                                                 logprobs=True, top_logprobs=2, stream=True,
                                                 extra_body={"ignore_eos": True}))
    entries = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert len(entries) == 4
    assert all(len(e.top_logprobs) == 2 for e in entries)


def test_seeded_sampling_repeats(client: openai.OpenAI) -> None:
    msgs = _messages()

    def sample(seed: int) -> str:
        return client.chat.completions.create(model=MODEL_NAME, messages=msgs, max_tokens=10, temperature=1.0,
                                              top_p=0.95, seed=seed,
                                              extra_body={"ignore_eos": True}).choices[0].message.content

    first = sample(1234)
    assert sample(1234) == first
    assert sample(99) != first   # 10 draws from a 49k vocabulary: a collision is ~impossible


def test_n_choices_are_distinct_and_repeatable(client: openai.OpenAI) -> None:
    msgs = _messages()
    resp = client.chat.completions.create(model=MODEL_NAME, messages=msgs, max_tokens=6, n=3, seed=7,
                                          extra_body={"ignore_eos": True})
    assert [c.index for c in resp.choices] == [0, 1, 2]
    texts = [c.message.content for c in resp.choices]
    assert len(set(texts)) == 3
    assert resp.usage.completion_tokens == 18
    again = client.chat.completions.create(model=MODEL_NAME, messages=msgs, max_tokens=6, n=3, seed=7,
                                           extra_body={"ignore_eos": True})
    assert [c.message.content for c in again.choices] == texts


def test_second_turn_hits_what_the_first_turn_left(client: openai.OpenAI) -> None:
    """cached_tokens of turn 2 = whole pages of the longest prefix turn 1 left in the cache.

    Turn 1 leaves prompt + output in the cache, except the last output token, whose K/V is never
    computed. Turn 2 can use the common prefix of its prompt with that, in whole pages, and must
    compute at least its own last prompt token.
    """
    msgs = [{"role": "system", "content": "You are a careful assistant. " * 3},
            {"role": "user", "content": f"first question {uuid.uuid4().hex}"}]
    t1 = client.chat.completions.create(model=MODEL_NAME, messages=msgs, max_tokens=20, temperature=0,
                                        extra_body={"return_token_ids": True, "ignore_eos": True})
    p1, o1 = t1.prompt_token_ids, t1.choices[0].token_ids
    assert t1.usage.prompt_tokens_details.cached_tokens == 0
    msgs2 = msgs + [{"role": "assistant", "content": t1.choices[0].message.content},
                    {"role": "user", "content": "and a follow-up question"}]
    t2 = client.chat.completions.create(model=MODEL_NAME, messages=msgs2, max_tokens=2,
                                        extra_body={"return_token_ids": True})
    p2 = t2.prompt_token_ids
    left = p1 + o1[:-1]          # tokens whose K/V turn 1 computed
    common = 0
    while common < min(len(left), len(p2)) and left[common] == p2[common]:
        common += 1
    expected = min(common, len(p2) - 1) // PAGE_SIZE * PAGE_SIZE
    assert common >= len(p1)     # the first turn's whole prompt is a prefix of the second's
    assert expected >= len(p1) // PAGE_SIZE * PAGE_SIZE > 0
    assert t2.usage.prompt_tokens_details.cached_tokens == expected
    assert t2.usage.prompt_tokens == len(p2)


def test_session_id_is_echoed(client: openai.OpenAI) -> None:
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL_NAME, messages=_messages(), max_tokens=1, extra_headers={"X-Session-ID": "sess-42"})
    assert raw.headers["x-session-id"] == "sess-42"
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL_NAME, messages=_messages(), max_tokens=1, extra_headers={"X-Claude-Code-Session-Id": "cc-7"})
    assert raw.headers["x-session-id"] == "cc-7"
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL_NAME, messages=_messages(), max_tokens=1, user="user-body-id")
    assert raw.headers["x-session-id"] == "user-body-id"
    raw = client.chat.completions.with_raw_response.create(model=MODEL_NAME, messages=_messages(), max_tokens=1)
    assert "x-session-id" not in raw.headers
    with client.chat.completions.with_streaming_response.create(
            model=MODEL_NAME, messages=_messages(), max_tokens=2, stream=True,
            extra_body={"prompt_cache_key": "pck-1"}) as resp:
        assert resp.headers["x-session-id"] == "pck-1"
        assert b"[DONE]" in b"".join(resp.iter_bytes())


def test_content_parts_are_flattened(client: openai.OpenAI, tiny_tokenizer) -> None:
    parts = [{"type": "text", "text": "part one, "}, {"type": "text", "text": "part two"}]
    resp = client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": parts}],
                                          max_tokens=1, extra_body={"return_token_ids": True})
    expected = tiny_tokenizer.apply_chat_template([{"role": "user", "content": "part one, part two"}],
                                                  add_generation_prompt=True, tokenize=False)
    assert resp.prompt_token_ids == tiny_tokenizer.encode(expected, add_special_tokens=False)


def test_explicit_nulls_take_defaults(http) -> None:
    body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "x", "name": None}], "n": None,
            "stop": None, "temperature": None, "top_p": None, "max_tokens": None, "max_completion_tokens": 2,
            "logprobs": None, "stream": None, "tools": None, "ignore_eos": True}
    resp = http.post("/v1/chat/completions", json=body)
    assert resp.status_code == 200, resp.text
    assert len(resp.json()["choices"]) == 1 and resp.json()["usage"]["completion_tokens"] == 2
