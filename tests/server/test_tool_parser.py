"""The hermes tool-call parser and the chat assembly of its results (no server needed)."""
from __future__ import annotations

import json

import pytest
from openai.types.chat import ChatCompletionChunk, ChatCompletionMessage

from tokenmill.server.serving_chat import assistant_message, stream_deltas
from tokenmill.server.tool_parser import ContentDelta, HermesToolParser, ToolCallDelta, get_tool_parser

CALL_A = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}\n</tool_call>'
CALL_B = '<tool_call>{"name": "search", "arguments": {"q": "ünïcode"}}</tool_call>'


def test_parse_plain_text_is_content() -> None:
    out = HermesToolParser().parse("just words")
    assert out.content == "just words" and out.tool_calls == []


def test_parse_calls_and_surrounding_text() -> None:
    out = HermesToolParser().parse(f"Let me check.\n{CALL_A}\n{CALL_B}")
    assert out.content == "Let me check."
    assert [c.name for c in out.tool_calls] == ["get_weather", "search"]
    assert json.loads(out.tool_calls[0].arguments) == {"city": "Paris", "unit": "C"}
    assert json.loads(out.tool_calls[1].arguments) == {"q": "ünïcode"}
    assert len({c.id for c in out.tool_calls}) == 2


def test_parse_only_calls_has_no_content() -> None:
    out = HermesToolParser().parse(CALL_A)
    assert out.content is None and len(out.tool_calls) == 1


def test_parse_bad_json_stays_text() -> None:
    text = "<tool_call>{not json}</tool_call> tail"
    out = HermesToolParser().parse(text)
    assert out.tool_calls == [] and out.content == text


def test_parse_unclosed_block_with_whole_json_is_a_call() -> None:
    out = HermesToolParser().parse('<tool_call>{"name": "f", "arguments": {}}')
    assert [c.name for c in out.tool_calls] == ["f"] and json.loads(out.tool_calls[0].arguments) == {}


def _run_stream(text: str, piece: int) -> list[ContentDelta | ToolCallDelta]:
    sp = HermesToolParser().stream()
    events: list[ContentDelta | ToolCallDelta] = []
    for i in range(0, len(text), piece):
        events += sp.feed(text[i:i + piece])
    return events + sp.finish()


@pytest.mark.parametrize("piece", [1, 2, 3, 5, 7, 1000])
def test_stream_matches_whole_parse_for_any_split(piece: int) -> None:
    text = f"Sure <tool> is not a tag. {CALL_A} between {CALL_B} end <tool_ca"
    events = _run_stream(text, piece)
    content = "".join(e.text for e in events if isinstance(e, ContentDelta))
    calls = [e for e in events if isinstance(e, ToolCallDelta)]
    whole = HermesToolParser().parse(text)
    assert content.strip() == whole.content
    assert [(c.call.name, c.call.arguments) for c in calls] == [(c.name, c.arguments) for c in whole.tool_calls]
    assert [c.index for c in calls] == [0, 1]
    assert all("<tool_call>" not in e.text for e in events if isinstance(e, ContentDelta))


def test_stream_holds_back_a_possible_tag_start() -> None:
    sp = HermesToolParser().stream()
    assert sp.feed("abc<tool") == [ContentDelta("abc")]
    assert sp.feed("box") == [ContentDelta("<toolbox")]


def test_unknown_parser_name() -> None:
    with pytest.raises(ValueError, match="unknown tool-call parser"):
        get_tool_parser("nope")


def test_assistant_message_is_valid_openai() -> None:
    parser = HermesToolParser()
    message, finish = assistant_message(f"ok {CALL_A}", parser)
    parsed = ChatCompletionMessage.model_validate(message)
    assert finish == "tool_calls" and parsed.content == "ok"
    assert parsed.tool_calls[0].function.name == "get_weather"
    assert json.loads(parsed.tool_calls[0].function.arguments)["city"] == "Paris"
    message, finish = assistant_message("no calls here", parser)
    assert finish is None and ChatCompletionMessage.model_validate(message).tool_calls is None


def test_stream_deltas_assemble_into_tool_calls() -> None:
    """Chunks built from a token-by-token stream parse as OpenAI chunks and add up to the calls."""
    text = f"Thinking. {CALL_A}{CALL_B}"
    sp = HermesToolParser().stream()
    pieces = [text[i:i + 4] for i in range(0, len(text), 4)]
    content, calls = "", {}
    for k, piece in enumerate(pieces):
        for delta in stream_deltas(sp, piece, finished=k == len(pieces) - 1):
            chunk = ChatCompletionChunk.model_validate({
                "id": "x", "object": "chat.completion.chunk", "created": 0, "model": "m",
                "choices": [{"index": 0, "delta": delta, "finish_reason": None}]})
            d = chunk.choices[0].delta
            content += d.content or ""
            for tc in d.tool_calls or []:
                entry = calls.setdefault(tc.index, {"name": "", "arguments": "", "id": tc.id})
                entry["name"] += tc.function.name or ""
                entry["arguments"] += tc.function.arguments or ""
    assert content == "Thinking. "
    assert [calls[i]["name"] for i in sorted(calls)] == ["get_weather", "search"]
    assert json.loads(calls[1]["arguments"]) == {"q": "ünïcode"}
    assert all(c["id"].startswith("call_") for c in calls.values())
    assert sp.num_calls == 2
