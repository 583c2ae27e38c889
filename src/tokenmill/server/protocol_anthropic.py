"""Anthropic Messages API request bodies (pydantic), their translation to a chat request, and the
Anthropic error shape.

A Messages request is translated into an OpenAI-style :class:`ChatCompletionRequest` (system
prompt first, ``tool_use`` blocks as assistant tool calls, ``tool_result`` blocks as tool
messages), so the chat template, the tool-call constraint and the tool parser are shared with
``/v1/chat/completions``.
"""
from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import Field, StrictBool, StrictStr

from tokenmill.server.errors import APIError, bad_request
from tokenmill.server.protocol import ChatCompletionRequest, ProtocolModel


_Model = ProtocolModel


class ContentBlock(_Model):
    type: StrictStr
    text: StrictStr | None = None
    # tool_use
    id: StrictStr | None = None
    name: StrictStr | None = None
    input: dict[str, Any] | None = None
    # tool_result
    tool_use_id: StrictStr | None = None
    content: StrictStr | list[dict[str, Any]] | None = None
    is_error: StrictBool | None = None


class AnthropicMessage(_Model):
    role: Literal["user", "assistant"]
    content: StrictStr | list[ContentBlock]


class AnthropicTool(_Model):
    name: StrictStr
    description: StrictStr | None = None
    input_schema: dict[str, Any] = Field(default_factory=lambda: {"type": "object"})
    type: StrictStr | None = None


class AnthropicToolChoice(_Model):
    type: Literal["auto", "any", "tool", "none"]
    name: StrictStr | None = None
    disable_parallel_tool_use: StrictBool = False


class CountTokensRequest(_Model):
    model: StrictStr
    messages: list[AnthropicMessage]
    system: StrictStr | list[ContentBlock] | None = None
    tools: list[AnthropicTool] | None = None
    tool_choice: AnthropicToolChoice | None = None


class MessagesRequest(CountTokensRequest):
    max_tokens: int
    stop_sequences: list[StrictStr] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stream: StrictBool = False
    metadata: dict[str, Any] | None = None
    output_config: dict[str, Any] | None = None   # {"format": {"type": "json_schema", "schema": {...}}}
    # tokenmill extensions, as on chat completions
    seed: int | None = None
    min_p: float = 0.0
    ignore_eos: StrictBool = False
    stop_token_ids: list[int] = Field(default_factory=list)


def _text_of(blocks: StrictStr | list[Any] | None, where: str) -> str:
    if blocks is None:
        return ""
    if isinstance(blocks, str):
        return blocks
    parts = []
    for i, b in enumerate(blocks):
        kind = b.get("type") if isinstance(b, dict) else b.type
        text = b.get("text") if isinstance(b, dict) else b.text
        if kind != "text" or not isinstance(text, str):
            raise bad_request(f"{where}.{i}: only text blocks are accepted here (this model reads text only), "
                              f"got a block of type {kind!r}", f"{where}.{i}.type")
        parts.append(text)
    return "".join(parts)


def to_chat_request(req: CountTokensRequest) -> ChatCompletionRequest:
    """The equivalent chat request (messages, tools, tool_choice and, for MessagesRequest, sampling)."""
    messages: list[dict[str, Any]] = []
    if req.system:
        messages.append({"role": "system", "content": _text_of(req.system, "system")})
    if not req.messages:
        raise bad_request("messages must hold at least one message", "messages")
    for i, msg in enumerate(req.messages):
        where = f"messages.{i}.content"
        if isinstance(msg.content, str):
            messages.append({"role": msg.role, "content": msg.content})
            continue
        text: list[str] = []
        calls: list[dict[str, Any]] = []
        for j, block in enumerate(msg.content):
            if block.type == "text":
                if block.text is None:
                    raise bad_request(f"{where}.{j}: a text block needs 'text'", f"{where}.{j}.text")
                text.append(block.text)
            elif block.type == "tool_use":
                if msg.role != "assistant":
                    raise bad_request(f"{where}.{j}: tool_use blocks belong to assistant messages", f"{where}.{j}")
                if not block.id or not block.name:
                    raise bad_request(f"{where}.{j}: a tool_use block needs 'id' and 'name'", f"{where}.{j}")
                calls.append({"id": block.id, "type": "function",
                              "function": {"name": block.name, "arguments": json.dumps(block.input or {})}})
            elif block.type == "tool_result":
                if msg.role != "user":
                    raise bad_request(f"{where}.{j}: tool_result blocks belong to user messages", f"{where}.{j}")
                if not block.tool_use_id:
                    raise bad_request(f"{where}.{j}: a tool_result block needs 'tool_use_id'",
                                      f"{where}.{j}.tool_use_id")
                if text:
                    messages.append({"role": "user", "content": "".join(text)})
                    text = []
                result = _text_of(block.content, f"{where}.{j}.content")
                if block.is_error:
                    result = f"Error: {result}"
                messages.append({"role": "tool", "tool_call_id": block.tool_use_id, "content": result})
            else:
                raise bad_request(f"{where}.{j}: content blocks of type {block.type!r} are not accepted; use text, "
                                  "tool_use or tool_result", f"{where}.{j}.type")
        if calls:
            messages.append({"role": "assistant", "content": "".join(text), "tool_calls": calls})
        elif text or msg.role == "assistant":
            messages.append({"role": msg.role, "content": "".join(text)})
    body: dict[str, Any] = {"messages": messages}
    if req.tools:
        body["tools"] = [{"type": "function", "function": {
            "name": t.name, "description": t.description, "parameters": t.input_schema}} for t in req.tools]
    choice = req.tool_choice
    if choice is not None:
        if choice.type == "tool":
            if not choice.name:
                raise bad_request('tool_choice of type "tool" needs a name', "tool_choice.name")
            body["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
        else:
            body["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}[choice.type]
        if choice.disable_parallel_tool_use:
            body["parallel_tool_calls"] = False
    if isinstance(req, MessagesRequest):
        body.update(max_tokens=req.max_tokens, temperature=req.temperature, top_p=req.top_p,
                    top_k=req.top_k or 0, stop=req.stop_sequences or None, seed=req.seed, min_p=req.min_p,
                    ignore_eos=req.ignore_eos, stop_token_ids=req.stop_token_ids)
        fmt = (req.output_config or {}).get("format")
        if fmt is not None:
            if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" or "schema" not in fmt:
                raise bad_request('output_config.format must be {"type": "json_schema", "schema": {...}}',
                                  "output_config.format")
            body["response_format"] = {"type": "json_schema",
                                       "json_schema": {"name": "output", "schema": fmt["schema"]}}
    try:
        return ChatCompletionRequest.model_validate(body)
    except ValueError as e:
        raise bad_request(f"invalid request: {e}") from None


_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
                503: "overloaded_error", 529: "overloaded_error"}


def anthropic_error_body(err: APIError) -> dict[str, Any]:
    """``{"type": "error", "error": {"type", "message"}}`` as the Anthropic API sends it."""
    kind = _ERROR_TYPES.get(err.status_code, "api_error" if err.status_code >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": err.message}}
