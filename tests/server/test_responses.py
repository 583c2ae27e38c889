"""The OpenAI Responses API through the official openai SDK (``client.responses``) against the real
server (tiny random Llama, hermes tool parser)."""
from __future__ import annotations

import json
import uuid

import jsonschema
import openai
import pytest

from tests.server.conftest import MODEL_NAME
from tokenmill.server.protocol_responses import ResponseStore, StoredResponse

INSTRUCTIONS = ("You are the build assistant of a large monorepo. Keep answers short, call tools for facts about "
                "files, and never guess the contents of a file you have not read.")
READ_FILE = {"type": "function", "name": "read_file", "description": "read a file",
             "parameters": {"type": "object", "properties": {"path": {"type": "string", "pattern": "^[a-z./]{1,12}$"}},
                            "required": ["path"], "additionalProperties": False}}


def _q() -> str:
    return f"what does the build do? {uuid.uuid4().hex[:8]}"


def test_create_and_retrieve(client: openai.OpenAI) -> None:
    resp = client.responses.create(model=MODEL_NAME, input=_q(), max_output_tokens=6, temperature=0,
                                   extra_body={"ignore_eos": True})
    assert resp.object == "response" and resp.id.startswith("resp_")
    assert resp.status == "incomplete" and resp.incomplete_details.reason == "max_output_tokens"
    assert resp.output[0].type == "message" and resp.output_text
    assert resp.usage.output_tokens == 6 and resp.usage.input_tokens > 0
    again = client.responses.retrieve(resp.id)
    assert again.id == resp.id and again.output_text == resp.output_text
    client.responses.delete(resp.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(resp.id)


def test_store_false_is_not_kept(client: openai.OpenAI) -> None:
    resp = client.responses.create(model=MODEL_NAME, input=_q(), max_output_tokens=2, store=False)
    assert resp.status in ("completed", "incomplete")
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(resp.id)


def test_two_turns_through_previous_response_id_hit_the_cache(client: openai.OpenAI) -> None:
    first = client.responses.create(model=MODEL_NAME, instructions=INSTRUCTIONS, input=_q(), max_output_tokens=5,
                                    temperature=0, extra_body={"ignore_eos": True})
    second = client.responses.create(model=MODEL_NAME, instructions=INSTRUCTIONS, previous_response_id=first.id,
                                     input="and the tests?", max_output_tokens=4, temperature=0)
    assert second.previous_response_id == first.id
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    assert second.usage.input_tokens_details.cached_tokens > 0
    assert second.usage.input_tokens_details.cached_tokens >= (first.usage.input_tokens // 16) * 16 - 16


def test_stream_event_sequence(client: openai.OpenAI) -> None:
    q = _q()
    full = client.responses.create(model=MODEL_NAME, input=q, max_output_tokens=8, temperature=0,
                                   extra_body={"ignore_eos": True})
    events = list(client.responses.create(model=MODEL_NAME, input=q, max_output_tokens=8, temperature=0,
                                          stream=True, extra_body={"ignore_eos": True}))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == "response.incomplete"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    for kind in ("response.output_item.added", "response.content_part.added", "response.output_text.delta",
                 "response.output_text.done", "response.content_part.done", "response.output_item.done"):
        assert kind in kinds, kinds
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == full.output_text == events[-1].response.output_text
    assert client.responses.retrieve(events[-1].response.id).output_text == text


def test_function_call_round_trip(client: openai.OpenAI) -> None:
    first = client.responses.create(model=MODEL_NAME, instructions=INSTRUCTIONS, input=_q(), tools=[READ_FILE],
                                    tool_choice="required", max_output_tokens=100, parallel_tool_calls=False)
    calls = [item for item in first.output if item.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "read_file" and calls[0].status == "completed"
    jsonschema.validate(json.loads(calls[0].arguments), READ_FILE["parameters"])
    second = client.responses.create(
        model=MODEL_NAME, instructions=INSTRUCTIONS, previous_response_id=first.id, tools=[READ_FILE],
        input=[{"type": "function_call_output", "call_id": calls[0].call_id, "output": "all: test"}],
        max_output_tokens=4)
    assert second.usage.input_tokens_details.cached_tokens > 0
    events = list(client.responses.create(
        model=MODEL_NAME, input=_q(), tools=[READ_FILE], stream=True, max_output_tokens=100,
        tool_choice={"type": "function", "name": "read_file"}))
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert done and json.loads(done[0].arguments)["path"] is not None


def test_text_format_json_schema(client: openai.OpenAI) -> None:
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}, "files": {
        "type": "array", "items": {"enum": ["a.py", "b.py"]}, "maxItems": 2}}, "required": ["ok", "files"],
        "additionalProperties": False}
    resp = client.responses.create(model=MODEL_NAME, input=_q(), max_output_tokens=40, extra_body={"seed": 3},
                                   text={"format": {"type": "json_schema", "name": "out", "schema": schema,
                                                    "strict": True}})
    assert resp.status == "completed"
    jsonschema.validate(json.loads(resp.output_text), schema)


def test_errors(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError, match="previous response"):
        client.responses.create(model=MODEL_NAME, input="hi", previous_response_id="resp_missing")
    with pytest.raises(openai.BadRequestError, match="text.format"):
        client.responses.create(model=MODEL_NAME, input="hi", text={"format": {"type": "bogus"}})
    with pytest.raises(openai.BadRequestError, match="input.0"):
        client.responses.create(model=MODEL_NAME, input=[{"type": "input_image", "image_url": "x"}])


def test_store_is_bounded() -> None:
    store = ResponseStore(2)
    for i in range(3):
        store.put(f"r{i}", StoredResponse({"id": f"r{i}"}, []))
    assert store.get("r0") is None and store.get("r1") is not None and len(store) == 2
    assert ResponseStore(0).get("x") is None
