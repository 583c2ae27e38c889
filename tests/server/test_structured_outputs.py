"""Structured outputs, forced tool calls and prompt logprobs through a real server (tiny random
Llama, hermes tool parser), with the official openai client."""
from __future__ import annotations

import asyncio
import json
import re
import uuid

import httpx
import jsonschema
import openai
import pytest
import torch

from tests.server.conftest import MODEL_NAME

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 9},
        "tags": {"type": "array", "items": {"type": "string", "pattern": "^[a-z]{0,4}$"}, "maxItems": 2},
    },
    "required": ["city", "days", "tags"],
    "additionalProperties": False,
}

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "pattern": "^[a-z]{1,8}$"},
                                                    "unit": {"enum": ["c", "f"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"type": "integer", "minimum": -12,
                                                                                 "maximum": 12}},
                                       "required": ["zone"], "additionalProperties": False}}}


def _msgs() -> list[dict]:
    return [{"role": "user", "content": f"plan a trip {uuid.uuid4().hex[:8]}"}]


def test_json_schema_response_format(client: openai.OpenAI) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "trip", "schema": SCHEMA, "strict": True}}
    for seed in range(3):
        resp = client.chat.completions.create(model=MODEL_NAME, messages=_msgs(), max_tokens=80, seed=seed,
                                              response_format=fmt)
        assert resp.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(resp.choices[0].message.content), SCHEMA)


def test_json_object_and_completions_endpoint(client: openai.OpenAI) -> None:
    resp = client.chat.completions.create(model=MODEL_NAME, messages=_msgs(), max_tokens=60, temperature=0,
                                          response_format={"type": "json_object"})
    text = resp.choices[0].message.content
    if resp.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)
    assert text.startswith("{")
    comp = client.completions.create(model=MODEL_NAME, prompt="Answer:", max_tokens=20, seed=1,
                                     extra_body={"choice": ["yes", "no", "maybe"]})
    assert comp.choices[0].text in ("yes", "no", "maybe")


def test_regex_and_choice(client: openai.OpenAI) -> None:
    for seed in range(3):
        r = client.chat.completions.create(model=MODEL_NAME, messages=_msgs(), max_tokens=20, seed=seed,
                                           extra_body={"regex": r"[A-Z]{3}-\d{2}"})
        assert re.fullmatch(r"[A-Z]{3}-\d{2}", r.choices[0].message.content)
        c = client.chat.completions.create(model=MODEL_NAME, messages=_msgs(), max_tokens=20, seed=seed,
                                           extra_body={"choice": ["alpha", "beta"]})
        assert c.choices[0].message.content in ("alpha", "beta")


@pytest.mark.parametrize("body, needle", [
    ({"response_format": {"type": "bogus"}}, "response_format.type"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "schema is required"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
     "not a valid JSON schema"),
    ({"regex": "[a-", "max_tokens": 4}, "invalid regex"),
    ({"grammar": "root ::= missing"}, "invalid grammar"),
    ({"regex": "a+", "choice": ["a"]}, "only one output constraint"),
    ({"response_format": {"type": "json_object"}, "grammar": 'root ::= "a"'}, "only one output constraint"),
])
def test_bad_constraints_get_400_naming_the_problem(http: httpx.Client, body: dict, needle: str) -> None:
    r = http.post("/v1/chat/completions", json={"model": MODEL_NAME, "messages": _msgs(), **body})
    assert r.status_code == 400, r.text
    assert needle in r.json()["error"]["message"], r.text
    assert http.get("/health").status_code == 200


def test_required_tool_call_parses_every_time(client: openai.OpenAI) -> None:
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
    for seed in range(4):
        resp = client.chat.completions.create(model=MODEL_NAME, messages=_msgs(), max_tokens=100, seed=seed,
                                              tools=[WEATHER, TIME], tool_choice="required",
                                              parallel_tool_calls=False)
        choice = resp.choices[0]
        assert choice.finish_reason == "tool_calls", choice
        assert choice.message.tool_calls and len(choice.message.tool_calls) == 1
        for call in choice.message.tool_calls:
            jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])


def test_named_tool_call_streams_deltas(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model=MODEL_NAME, messages=_msgs(), max_tokens=100, seed=7, stream=True, tools=[WEATHER, TIME],
        tool_choice={"type": "function", "function": {"name": "get_time"}})
    calls, finish = [], None
    for chunk in stream:
        delta = chunk.choices[0].delta
        calls += delta.tool_calls or []
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls"
    assert calls and all(c.function.name == "get_time" for c in calls)
    for c in calls:
        jsonschema.validate(json.loads(c.function.arguments), TIME["function"]["parameters"])


def test_auto_tool_choice_stays_unconstrained(client: openai.OpenAI) -> None:
    resp = client.chat.completions.create(model=MODEL_NAME, messages=_msgs(), max_tokens=8, temperature=0,
                                          tools=[WEATHER], tool_choice="auto", extra_body={"ignore_eos": True})
    assert resp.choices[0].finish_reason == "length"   # nothing forced a call or an end


def test_constrained_and_plain_requests_share_the_batch(server) -> None:
    async def run() -> list:
        # a client of this event loop (a session-wide async client would outlive the loop)
        async_client = openai.AsyncOpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0,
                                          timeout=120)
        plain = [async_client.chat.completions.create(model=MODEL_NAME, messages=_msgs(), max_tokens=12,
                                                      temperature=0, extra_body={"ignore_eos": True})
                 for _ in range(3)]
        fmt = {"type": "json_schema", "json_schema": {"name": "trip", "schema": SCHEMA}}
        constrained = [async_client.chat.completions.create(model=MODEL_NAME, messages=_msgs(), max_tokens=80,
                                                            seed=s, response_format=fmt) for s in range(3)]
        try:
            return await asyncio.gather(*plain, *constrained)
        finally:
            await async_client.close()

    results = asyncio.run(run())
    for r in results[:3]:
        assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 12
    for r in results[3:]:
        jsonschema.validate(json.loads(r.choices[0].message.content), SCHEMA)


def test_echo_logprobs_match_hf(client: openai.OpenAI, tiny_checkpoint, tiny_tokenizer) -> None:
    from transformers import AutoModelForCausalLM

    prompt = f"The quick brown fox {uuid.uuid4().hex[:6]} jumps over the lazy dog"
    ids = tiny_tokenizer.encode(prompt)
    resp = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=2, temperature=0, echo=True,
                                     logprobs=2, extra_body={"prompt_logprobs": 1})
    lp = resp.choices[0].logprobs
    assert resp.choices[0].text.startswith(tiny_tokenizer.decode(ids))
    assert len(lp.tokens) == len(ids) + 2 and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    ref = AutoModelForCausalLM.from_pretrained(str(tiny_checkpoint), torch_dtype=torch.float32).eval()
    with torch.no_grad():
        want = torch.log_softmax(ref(torch.tensor([ids])).logits[0].float(), dim=-1)
    want_prompt = want[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]
    got = torch.tensor(lp.token_logprobs[1:len(ids)])
    assert torch.allclose(got, want_prompt, atol=1e-4), (got, want_prompt)
    extension = resp.choices[0].prompt_logprobs
    assert extension[0] is None and [e["token_id"] for e in extension[1:]] == ids[1:]
    assert torch.allclose(torch.tensor([e["logprob"] for e in extension[1:]]), want_prompt, atol=1e-4)
    assert [e["top_logprobs"][0]["token_id"] for e in extension[1:]] == want[:-1].argmax(-1).tolist()


def test_echo_logprobs_stream_and_chat_prompt_logprobs(client: openai.OpenAI, tiny_tokenizer) -> None:
    prompt = f"stream me {uuid.uuid4().hex[:6]}"
    ids = tiny_tokenizer.encode(prompt)
    chunks = list(client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=3, temperature=0,
                                            echo=True, logprobs=0, stream=True, extra_body={"ignore_eos": True}))
    first = chunks[0].choices[0]
    assert first.text == tiny_tokenizer.decode(ids)
    assert len(first.logprobs.tokens) == len(ids) and first.logprobs.token_logprobs[0] is None
    resp = client.chat.completions.create(model=MODEL_NAME, messages=_msgs(), max_tokens=2,
                                          extra_body={"prompt_logprobs": 0, "return_token_ids": True})
    plp = resp.prompt_logprobs
    assert len(plp) == len(resp.prompt_token_ids) and plp[0] is None
    assert all(e["logprob"] <= 0 for e in plp[1:])
