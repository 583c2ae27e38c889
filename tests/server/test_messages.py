"""The Anthropic Messages API through the official ``anthropic`` SDK against the real server (tiny
random Llama, hermes tool parser)."""
from __future__ import annotations

import json
import uuid

import anthropic
import httpx
import jsonschema
import pytest

from tests.server.conftest import MODEL_NAME
from tokenmill.utils.proc import ServiceProcess

SYSTEM = ("You are a careful assistant for a travel agency. Answer briefly, use the tools when they help, "
          "and never invent facts about the weather in any city.")
WEATHER = {"name": "get_weather", "description": "current weather of a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string", "pattern": "^[A-Za-z]{1,10}$"}},
                            "required": ["city"], "additionalProperties": False}}


@pytest.fixture(scope="module")
def claude(server: ServiceProcess) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.base_url, api_key="unused", max_retries=0, timeout=120)


def _user(text: str | None = None) -> list[dict]:
    return [{"role": "user", "content": text or f"hello {uuid.uuid4().hex[:8]}"}]


def test_message_non_streamed(claude: anthropic.Anthropic) -> None:
    msgs = _user()
    msg = claude.messages.create(model=MODEL_NAME, max_tokens=6, system=SYSTEM, messages=msgs,
                                 extra_body={"temperature": 0})
    assert msg.type == "message" and msg.role == "assistant" and msg.id.startswith("msg_")
    assert msg.stop_reason in ("end_turn", "max_tokens")
    assert all(b.type == "text" for b in msg.content)
    assert 1 <= msg.usage.output_tokens <= 6
    counted = claude.messages.count_tokens(model=MODEL_NAME, system=SYSTEM, messages=msgs)
    assert msg.usage.input_tokens + msg.usage.cache_read_input_tokens == counted.input_tokens


def test_message_stream_event_sequence(claude: anthropic.Anthropic) -> None:
    msgs = _user()
    full = claude.messages.create(model=MODEL_NAME, max_tokens=8, messages=msgs, extra_body={"temperature": 0})
    kinds = []
    with claude.messages.stream(model=MODEL_NAME, max_tokens=8, messages=msgs,
                                extra_body={"temperature": 0}) as stream:
        for event in stream:
            kinds.append(event.type)
        final = stream.get_final_message()
    text = "".join(b.text for b in final.content if b.type == "text")
    assert text == "".join(b.text for b in full.content if b.type == "text")
    assert final.stop_reason == full.stop_reason and final.usage.output_tokens == full.usage.output_tokens
    forced = claude.messages.create(model=MODEL_NAME, max_tokens=8, messages=msgs,
                                    extra_body={"ignore_eos": True, "seed": 5})
    assert forced.stop_reason == "max_tokens" and forced.usage.output_tokens == 8
    raw = [k for k in kinds if k in ("message_start", "content_block_start", "content_block_delta",
                                     "content_block_stop", "message_delta", "message_stop")]
    assert raw[0] == "message_start" and raw[-2:] == ["message_delta", "message_stop"]
    if text:
        assert raw[1] == "content_block_start" and raw[-3] == "content_block_stop"
        assert "content_block_delta" in raw


def test_stop_sequence(claude: anthropic.Anthropic) -> None:
    msgs = _user()
    free = claude.messages.create(model=MODEL_NAME, max_tokens=12, messages=msgs,
                                  extra_body={"temperature": 0, "ignore_eos": True})
    text = free.content[0].text
    # a 3-character stop sequence from the middle on, free of spaces, whose first occurrence is there
    at = next((i for i in range(len(text) // 2, len(text) - 3)
               if " " not in text[i:i + 3] and text[i:i + 3].strip() == text[i:i + 3] and text.find(text[i:i + 3]) == i),
              None)
    if at is None:
        pytest.skip(f"no clean stop sequence in {text!r}")
    stop = text[at:at + 3]
    cut = claude.messages.create(model=MODEL_NAME, max_tokens=12, messages=msgs, stop_sequences=[stop],
                                 extra_body={"temperature": 0})
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == stop
    assert cut.content[0].text == text[:at]


def test_tool_use_round_trip_and_cache_read(claude: anthropic.Anthropic) -> None:
    session = uuid.uuid4().hex
    turn1 = _user(f"What is the weather in Paris? ({session})")
    first = claude.messages.create(model=MODEL_NAME, max_tokens=100, system=SYSTEM, messages=turn1, tools=[WEATHER],
                                   tool_choice={"type": "any"}, metadata={"user_id": session})
    assert first.stop_reason == "tool_use"
    uses = [b for b in first.content if b.type == "tool_use"]
    assert uses and uses[0].name == "get_weather" and uses[0].id.startswith("toolu_")
    jsonschema.validate(uses[0].input, WEATHER["input_schema"])
    turn2 = turn1 + [
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": uses[0].id,
                                      "content": "sunny, 21 degrees"}]},
    ]
    second = claude.messages.create(model=MODEL_NAME, max_tokens=6, system=SYSTEM, messages=turn2, tools=[WEATHER],
                                    metadata={"user_id": session})
    assert second.usage.cache_read_input_tokens > 0
    with_result = claude.messages.count_tokens(model=MODEL_NAME, system=SYSTEM, messages=turn2, tools=[WEATHER])
    assert second.usage.input_tokens + second.usage.cache_read_input_tokens == with_result.input_tokens
    assert with_result.input_tokens > claude.messages.count_tokens(model=MODEL_NAME, system=SYSTEM, messages=turn1,
                                                                   tools=[WEATHER]).input_tokens


def test_named_tool_streams_input_json(claude: anthropic.Anthropic) -> None:
    with claude.messages.stream(model=MODEL_NAME, max_tokens=100, messages=_user(), tools=[WEATHER],
                                tool_choice={"type": "tool", "name": "get_weather"}) as stream:
        final = stream.get_final_message()
    assert final.stop_reason == "tool_use"
    use = next(b for b in final.content if b.type == "tool_use")
    jsonschema.validate(use.input, WEATHER["input_schema"])


def test_output_config_json_schema(claude: anthropic.Anthropic) -> None:
    schema = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}, "score": {
        "type": "integer", "minimum": 0, "maximum": 5}}, "required": ["answer", "score"], "additionalProperties": False}
    msg = claude.messages.create(model=MODEL_NAME, max_tokens=40, messages=_user(),
                                 output_config={"format": {"type": "json_schema", "schema": schema}})
    assert msg.stop_reason == "end_turn"
    jsonschema.validate(json.loads(msg.content[0].text), schema)


def test_errors_have_the_anthropic_shape(claude: anthropic.Anthropic, server: ServiceProcess) -> None:
    with pytest.raises(anthropic.BadRequestError) as e:
        claude.messages.create(model=MODEL_NAME, max_tokens=4,
                               messages=[{"role": "user", "content": [{"type": "image", "source": {}}]}])
    assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "invalid_request_error"
    assert "image" in e.value.body["error"]["message"]
    with pytest.raises(anthropic.NotFoundError):
        claude.messages.create(model="no-such-model", max_tokens=4, messages=_user())
    r = httpx.post(server.base_url + "/v1/messages", json={"model": MODEL_NAME, "messages": _user()}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    assert "max_tokens" in r.json()["error"]["message"]
    r = httpx.post(server.base_url + "/v1/messages", content=b"{nope", timeout=30)
    assert r.status_code == 400 and r.json()["type"] == "error"
    assert json.loads(httpx.get(server.base_url + "/health").text)["status"] == "ok"
