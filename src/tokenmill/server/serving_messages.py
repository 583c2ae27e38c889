"""``POST /v1/messages`` and ``POST /v1/messages/count_tokens``: the Anthropic Messages API.

The request is translated to a chat request (server/protocol_anthropic.py) and runs through the
same template, constraint and engine path as chat completions. Output text is split by the tool
parser into ``text`` and ``tool_use`` blocks.

Usage follows Anthropic's meaning: ``input_tokens`` are the prompt tokens that were computed,
``cache_read_input_tokens`` those served from the prefix cache (their sum is the prompt length);
``cache_creation_input_tokens`` is always 0 (every computed page is cached for later turns).

Streaming sends the Anthropic event sequence: ``message_start`` (once the first output arrives,
so its usage carries the cache hit), ``ping``, then per block ``content_block_start`` /
``content_block_delta`` (``text_delta`` or ``input_json_delta``) / ``content_block_stop``, then
``message_delta`` (stop reason, output tokens) and ``message_stop``. An engine failure mid-stream
is an ``error`` event.
"""
from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from tokenmill.engine.async_engine import EngineStepError
from tokenmill.server.common import (
    ClientGone, Generation, ServerState, collect, log_finished, parse_model, resolve_max_tokens, sampling_params,
)
from tokenmill.server.errors import APIError, bad_request
from tokenmill.server.protocol import check_common
from tokenmill.server.protocol_anthropic import (
    CountTokensRequest, MessagesRequest, anthropic_error_body, to_chat_request,
)
from tokenmill.server.serving_chat import chat_constraint, render_prompt
from tokenmill.server.structured import compiled
from tokenmill.server.tool_parser import ContentDelta, HermesToolParser, ToolCall


def _tool_use_id() -> str:
    return f"toolu_{uuid.uuid4().hex[:24]}"


def _usage(prompt_len: int, cached: int, output_tokens: int) -> dict[str, Any]:
    return {"input_tokens": prompt_len - cached, "output_tokens": output_tokens,
            "cache_read_input_tokens": cached, "cache_creation_input_tokens": 0}


def _stop(finish_reason: str | None, stop_reason: Any, has_tool_calls: bool) -> tuple[str, str | None]:
    if has_tool_calls:
        return "tool_use", None
    if finish_reason == "length":
        return "max_tokens", None
    if isinstance(stop_reason, str):
        return "stop_sequence", stop_reason
    return "end_turn", None


def _tool_block(call: ToolCall) -> dict[str, Any]:
    try:
        args = json.loads(call.arguments)
    except ValueError:
        args = {}
    return {"type": "tool_use", "id": _tool_use_id(), "name": call.name,
            "input": args if isinstance(args, dict) else {"value": args}}


async def count_tokens(state: ServerState, request: Request, body: dict[str, Any],
                       session_id: str | None, arrival: float) -> Any:
    req: CountTokensRequest = parse_model(CountTokensRequest, body)  # type: ignore[arg-type]
    state.check_model(req.model)
    prompt = render_prompt(state, to_chat_request(req))
    return JSONResponse({"input_tokens": len(prompt)})


async def create_message(state: ServerState, request: Request, body: dict[str, Any],
                         session_id: str | None, arrival: float) -> Any:
    req: MessagesRequest = parse_model(MessagesRequest, body)  # type: ignore[arg-type]
    state.check_model(req.model)
    if req.max_tokens < 1:
        raise bad_request(f"max_tokens must be at least 1, got {req.max_tokens}", "max_tokens")
    if req.top_k is not None and req.top_k < 0:
        raise bad_request(f"top_k must be >= 0, got {req.top_k}", "top_k")
    chat = to_chat_request(req)
    check_common(chat, max_n=1)
    prompt = render_prompt(state, chat)
    max_tokens = resolve_max_tokens(state, len(prompt), req.max_tokens, "max_tokens", "messages")
    parser, spec, spec_param = chat_constraint(state, chat)
    await compiled(state, spec, spec_param)
    params = [sampling_params(chat, max_tokens=max_tokens, logprobs=None, choice=0, structured=spec)]
    if not (chat.tools and chat.tool_choice != "none"):
        parser = None
    message_id = f"msg_{uuid.uuid4().hex[:24]}"
    gen = Generation(state, message_id, [prompt], params, session_id, arrival, streamed=bool(req.stream))
    await gen.start()
    model = req.model
    if req.stream:
        return StreamingResponse(_stream(state, gen, model, prompt, parser), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})
    try:
        finals = await collect(gen, request)
    except ClientGone:
        return JSONResponse({}, status_code=499)
    out = finals[0]
    content: list[dict[str, Any]] = []
    calls: list[ToolCall] = []
    text: str | None = out.text
    if parser is not None:
        parsed = parser.parse(out.text)
        text, calls = parsed.content, parsed.tool_calls
    if text:
        content.append({"type": "text", "text": text})
    content.extend(_tool_block(c) for c in calls)
    stop_reason, stop_sequence = _stop(out.finish_reason, out.stop_reason, bool(calls))
    log_finished("messages", message_id, session_id, len(prompt), out.cached_tokens, len(out.token_ids), arrival,
                 [out.finish_reason])
    return JSONResponse({
        "id": message_id, "type": "message", "role": "assistant", "model": model, "content": content,
        "stop_reason": stop_reason, "stop_sequence": stop_sequence,
        "usage": _usage(len(prompt), out.cached_tokens, len(out.token_ids)),
    })


def _event(kind: str, data: dict[str, Any]) -> str:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **data}, ensure_ascii=False, separators=(',', ':'))}\n\n"


async def _stream(state: ServerState, gen: Generation, model: str, prompt: list[int],
                  parser: HermesToolParser | None) -> AsyncIterator[str]:
    stream_parser = parser.stream() if parser is not None else None
    started = False
    index = -1          # index of the current content block
    text_open = False
    num_calls = 0
    cached = 0
    output_tokens = 0

    def start(cached_tokens: int) -> str:
        message = {"id": gen.request_id, "type": "message", "role": "assistant", "model": model, "content": [],
                   "stop_reason": None, "stop_sequence": None, "usage": _usage(len(prompt), cached_tokens, 0)}
        return _event("message_start", {"message": message}) + _event("ping", {})

    try:
        async for _, out in gen:
            if not started:
                started = True
                cached = out.cached_tokens
                yield start(cached)
            output_tokens = len(out.token_ids)
            events: list[Any]
            if stream_parser is None:
                events = [ContentDelta(out.new_text)] if out.new_text else []
            else:
                events = stream_parser.feed(out.new_text)
                if out.finished:
                    events += stream_parser.finish()
            for ev in events:
                if isinstance(ev, ContentDelta):
                    if not ev.text:
                        continue
                    if not text_open:
                        index += 1
                        text_open = True
                        yield _event("content_block_start", {"index": index,
                                                             "content_block": {"type": "text", "text": ""}})
                    yield _event("content_block_delta", {"index": index,
                                                         "delta": {"type": "text_delta", "text": ev.text}})
                else:
                    if text_open:
                        yield _event("content_block_stop", {"index": index})
                        text_open = False
                    index += 1
                    num_calls += 1
                    block = _tool_block(ev.call)
                    yield _event("content_block_start", {"index": index, "content_block": {**block, "input": {}}})
                    yield _event("content_block_delta", {"index": index, "delta": {
                        "type": "input_json_delta", "partial_json": json.dumps(block["input"], ensure_ascii=False)}})
                    yield _event("content_block_stop", {"index": index})
            if out.finished:
                if text_open:
                    yield _event("content_block_stop", {"index": index})
                    text_open = False
                stop_reason, stop_sequence = _stop(out.finish_reason, out.stop_reason, num_calls > 0)
                yield _event("message_delta", {"delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
                                               "usage": {"output_tokens": output_tokens}})
                yield _event("message_stop", {})
                log_finished("messages-stream", gen.request_id, gen.session_id, len(prompt), cached, output_tokens,
                             gen.timers[0].arrival, [out.finish_reason])
    except EngineStepError as e:
        yield _event("error", {"error": anthropic_error_body(APIError(500, str(e), type="server_error"))["error"]})
    finally:
        await gen.close()

