"""OpenAI Responses API request bodies (pydantic), the translation of input items to chat messages,
and the bounded store of recent responses behind ``previous_response_id``.

Input items: a string (one user message), or a list of

* ``{"type": "message", "role": "user"|"assistant"|"system"|"developer", "content": str | parts}``
  (``type`` may be left out; parts are ``input_text`` / ``output_text``),
* ``{"type": "function_call", "call_id", "name", "arguments"}`` (a call the model made),
* ``{"type": "function_call_output", "call_id", "output"}`` (its result).

Consecutive function calls become one assistant message with ``tool_calls``; outputs become
``tool`` messages. ``instructions`` is a system message in front; as in OpenAI's API, the
instructions of a previous response are not carried over.
"""
from __future__ import annotations

import json
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import Field, StrictBool, StrictStr

from tokenmill.server.errors import bad_request
from tokenmill.server.protocol import ProtocolModel


_Model = ProtocolModel


class FunctionTool(_Model):
    type: StrictStr = "function"
    name: StrictStr
    description: StrictStr | None = None
    parameters: dict[str, Any] | None = None
    strict: StrictBool | None = None


class TextConfig(_Model):
    format: dict[str, Any] | None = None


class ResponsesRequest(_Model):
    model: StrictStr | None = None
    input: StrictStr | list[dict[str, Any]]
    instructions: StrictStr | None = None
    previous_response_id: StrictStr | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: StrictBool = True
    text: TextConfig | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: StrictBool = False
    store: StrictBool = True
    metadata: dict[str, Any] | None = None
    user: StrictStr | None = None
    prompt_cache_key: StrictStr | None = None
    # tokenmill extensions, as on chat completions
    seed: int | None = None
    top_k: int = 0
    min_p: float = 0.0
    stop: StrictStr | list[StrictStr] | None = None
    stop_token_ids: list[int] = Field(default_factory=list)
    ignore_eos: StrictBool = False


def _content_text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"{where} must be a string or a list of text parts", where)
    parts = []
    for i, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in ("input_text", "output_text", "text") or not isinstance(part.get("text"), str):
            raise bad_request(f"{where}.{i}: only input_text/output_text parts are accepted (this model reads text "
                              f"only), got {kind!r}", f"{where}.{i}.type")
        parts.append(part["text"])
    return "".join(parts)


def input_messages(items: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Chat messages (HF template shape) for the request's ``input``."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    if not items:
        raise bad_request("input must not be empty", "input")
    messages: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        kind = item.get("type", "message")
        where = f"input.{i}"
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise bad_request(f"{where}.role must be user, assistant, system or developer, got {role!r}",
                                  f"{where}.role")
            messages.append({"role": "system" if role == "developer" else role,
                             "content": _content_text(item.get("content", ""), f"{where}.content")})
        elif kind == "function_call":
            call_id, name, args = item.get("call_id"), item.get("name"), item.get("arguments", "{}")
            if not isinstance(call_id, str) or not isinstance(name, str) or not isinstance(args, str):
                raise bad_request(f"{where}: a function_call item needs string call_id, name and arguments", where)
            try:
                parsed: Any = json.loads(args)
            except ValueError:
                parsed = args
            call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": parsed}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and "tool_calls" in last:
                last["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            call_id, output = item.get("call_id"), item.get("output")
            if not isinstance(call_id, str):
                raise bad_request(f"{where}.call_id must be a string", f"{where}.call_id")
            text = output if isinstance(output, str) else _content_text(output, f"{where}.output")
            messages.append({"role": "tool", "tool_call_id": call_id, "content": text})
        else:
            raise bad_request(f"{where}: input items of type {kind!r} are not accepted; use message, function_call "
                              "or function_call_output", f"{where}.type")
    return messages


@dataclass
class StoredResponse:
    response: dict[str, Any]           # the response object, as GET /v1/responses/{id} returns it
    messages: list[dict[str, Any]]     # the conversation without instructions, output included


class ResponseStore:
    """The most recent ``capacity`` stored responses (thread-safe; oldest dropped first)."""

    def __init__(self, capacity: int) -> None:
        if capacity < 0:
            raise ValueError(f"capacity must be >= 0, got {capacity}")
        self.capacity = capacity
        self._items: OrderedDict[str, StoredResponse] = OrderedDict()
        self._lock = threading.Lock()

    def put(self, response_id: str, item: StoredResponse) -> None:
        if self.capacity == 0:
            return
        with self._lock:
            self._items[response_id] = item
            self._items.move_to_end(response_id)
            while len(self._items) > self.capacity:
                self._items.popitem(last=False)

    def get(self, response_id: str) -> StoredResponse | None:
        with self._lock:
            return self._items.get(response_id)

    def delete(self, response_id: str) -> bool:
        with self._lock:
            return self._items.pop(response_id, None) is not None

    def __len__(self) -> int:
        return len(self._items)
