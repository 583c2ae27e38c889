"""Tool-call parsers: model text -> OpenAI ``tool_calls``.

``hermes`` (Hermes 2 Pro, Qwen 2.5/3 and most ChatML tool models) writes each call as

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

A block whose body is not a JSON object with a string ``name`` stays in the content as text.

Three entry points:

* :meth:`HermesToolParser.parse` on a whole completion (non-streamed responses);
* :meth:`HermesToolParser.stream` returns a :class:`HermesStreamParser` that is fed text deltas
  and yields content deltas and complete tool calls as soon as each ``</tool_call>`` arrives.
  Text that could be the start of ``<tool_call>`` is held back until it is resolved, so no tag
  fragment ever leaks into the content;
* :meth:`HermesToolParser.call_constraint` gives the structured-output constraint that forces
  the model to write one or more calls in this format (``tool_choice`` "required" or named),
  each call's arguments valid under that tool's JSON schema.
"""
from __future__ import annotations

import json
import uuid
from collections.abc import Sequence
from typing import Any, NamedTuple

from tokenmill.contracts.sampling import StructuredOutputs

START = "<tool_call>"
END = "</tool_call>"


class ToolCall(NamedTuple):
    id: str
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ParsedOutput(NamedTuple):
    content: str | None   # None when nothing but tool calls (and whitespace) was generated
    tool_calls: list[ToolCall]


class ContentDelta(NamedTuple):
    text: str


class ToolCallDelta(NamedTuple):
    index: int
    call: ToolCall


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _parse_call(body: str) -> ToolCall | None:
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        arguments = args
    else:
        arguments = json.dumps(args, ensure_ascii=False)
    return ToolCall(new_call_id(), obj["name"], arguments)


def _partial_start(text: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``<tool_call>``."""
    for k in range(min(len(START) - 1, len(text)), 0, -1):
        if text.endswith(START[:k]):
            return k
    return 0


class HermesToolParser:
    name = "hermes"

    def parse(self, text: str) -> ParsedOutput:
        calls: list[ToolCall] = []
        content: list[str] = []
        pos = 0
        while True:
            start = text.find(START, pos)
            if start < 0:
                content.append(text[pos:])
                break
            end = text.find(END, start + len(START))
            body_end = len(text) if end < 0 else end
            call = _parse_call(text[start + len(START):body_end])
            if call is None:  # not a call after all: keep it as text
                stop = len(text) if end < 0 else end + len(END)
                content.append(text[pos:stop])
                pos = stop
                if end < 0:
                    break
                continue
            content.append(text[pos:start])
            calls.append(call)
            if end < 0:
                break
            pos = end + len(END)
        joined = "".join(content)
        if calls and not joined.strip():
            return ParsedOutput(None, calls)
        return ParsedOutput(joined if not calls else joined.strip(), calls)

    def stream(self) -> HermesStreamParser:
        return HermesStreamParser(self)

    def call_constraint(self, tools: Sequence[tuple[str, dict[str, Any] | None]], *,
                        parallel: bool = True) -> StructuredOutputs:
        """Constraint for ``<tool_call>`` blocks (one, or several separated by newlines when
        ``parallel``) calling one of ``tools`` ((name, parameters schema) pairs)."""
        tags = [{
            "type": "tag",
            "begin": f'{START}\n{{"name": {json.dumps(name, ensure_ascii=False)}, "arguments": ',
            "content": {"type": "json_schema", "json_schema": schema if schema else {"type": "object"},
                        "max_whitespace_cnt": 2},
            "end": f"}}\n{END}",
        } for name, schema in tools]
        fmt = {"type": "tags_with_separator", "tags": tags, "separator": "\n", "at_least_one": True,
               "stop_after_first": not parallel}
        return StructuredOutputs("structural_tag", json.dumps({"type": "structural_tag", "format": fmt},
                                                              sort_keys=True, ensure_ascii=False))


class HermesStreamParser:
    """Incremental form of :meth:`HermesToolParser.parse` (see the module docstring)."""

    def __init__(self, parser: HermesToolParser) -> None:
        self._parser = parser
        self._buf = ""           # text not yet emitted
        self._in_call = False    # inside <tool_call> ... waiting for </tool_call>
        self.num_calls = 0

    def feed(self, delta: str) -> list[ContentDelta | ToolCallDelta]:
        self._buf += delta
        events: list[ContentDelta | ToolCallDelta] = []
        while True:
            if self._in_call:
                end = self._buf.find(END)
                if end < 0:
                    return events
                body = self._buf[len(START):end]
                call = _parse_call(body)
                if call is None:
                    events.append(ContentDelta(self._buf[:end + len(END)]))
                else:
                    events.append(ToolCallDelta(self.num_calls, call))
                    self.num_calls += 1
                self._buf = self._buf[end + len(END):]
                self._in_call = False
                continue
            start = self._buf.find(START)
            if start >= 0:
                if start:
                    events.append(ContentDelta(self._buf[:start]))
                self._buf = self._buf[start:]
                self._in_call = True
                continue
            keep = _partial_start(self._buf)
            out = self._buf[:len(self._buf) - keep]
            if out:
                events.append(ContentDelta(out))
            self._buf = self._buf[len(self._buf) - keep:]
            return events

    def finish(self) -> list[ContentDelta | ToolCallDelta]:
        """Flush at the end of the output: an unclosed block becomes a call if its JSON is whole."""
        events: list[ContentDelta | ToolCallDelta] = []
        if self._in_call:
            call = _parse_call(self._buf[len(START):])
            if call is not None:
                events.append(ToolCallDelta(self.num_calls, call))
                self.num_calls += 1
                self._buf = ""
        if self._buf:
            events.append(ContentDelta(self._buf))
        self._buf = ""
        self._in_call = False
        return events


TOOL_PARSERS: dict[str, type[HermesToolParser]] = {"hermes": HermesToolParser}


def get_tool_parser(name: str) -> HermesToolParser:
    try:
        return TOOL_PARSERS[name]()
    except KeyError:
        raise ValueError(f"unknown tool-call parser {name!r}; choose from {sorted(TOOL_PARSERS)}") from None
