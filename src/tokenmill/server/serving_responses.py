"""``POST /v1/responses``, ``GET /v1/responses/{id}``, ``DELETE /v1/responses/{id}``: the OpenAI
Responses API.

The input items (plus the stored conversation of ``previous_response_id``, plus
``instructions``) become chat messages and run through the chat path: same template, tool-call
constraint (``tool_choice``), structured output (``text.format``) and tool parser. Output text
becomes a ``message`` item and ``function_call`` items.

Responses created with ``store`` (the default) are kept in a bounded in-memory store
(``--max-stored-responses``, oldest dropped first) with the conversation that produced them, so
a follow-up request can name them in ``previous_response_id``; the rebuilt prompt starts with
the previous prompt's tokens, which the prefix cache still holds.

Streaming sends ``response.created``, ``response.in_progress``, then per output item
``response.output_item.added``, for text ``response.content_part.added`` /
``response.output_text.delta`` / ``response.output_text.done`` / ``response.content_part.done``,
for calls ``response.function_call_arguments.delta`` / ``.done``, then
``response.output_item.done``, and finally ``response.completed`` (or ``response.incomplete``
when ``max_output_tokens`` cut it, ``response.failed`` on an engine error).
"""
from __future__ import annotations

import json
import time
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
from tokenmill.server.protocol import ChatCompletionRequest, check_chat, check_common, requested_max_tokens
from tokenmill.server.protocol_responses import ResponsesRequest, StoredResponse, input_messages
from tokenmill.server.serving_chat import chat_constraint, render_prompt
from tokenmill.server.structured import compiled, response_format_constraint
from tokenmill.server.tool_parser import ContentDelta, HermesToolParser, ToolCall


def _item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _chat_request(state: ServerState, req: ResponsesRequest) -> tuple[ChatCompletionRequest, list[dict[str, Any]]]:
    """The equivalent chat request, and the conversation (without instructions) it carries."""
    history: list[dict[str, Any]] = []
    if req.previous_response_id is not None:
        prev = state.responses.get(req.previous_response_id)
        if prev is None:
            raise APIError(404, f"previous response {req.previous_response_id!r} is not stored on this server (it "
                                f"was never stored, or older than the last {state.responses.capacity} kept)",
                           param="previous_response_id", code="previous_response_not_found")
        history = [dict(m) for m in prev.messages]
    conversation = history + input_messages(req.input)
    messages = ([{"role": "system", "content": req.instructions}] if req.instructions else []) + conversation
    body: dict[str, Any] = {
        "messages": messages, "max_tokens": req.max_output_tokens, "temperature": req.temperature,
        "top_p": req.top_p, "seed": req.seed, "top_k": req.top_k, "min_p": req.min_p, "stop": req.stop,
        "stop_token_ids": req.stop_token_ids, "ignore_eos": req.ignore_eos,
        "parallel_tool_calls": req.parallel_tool_calls,
    }
    if req.tools:
        for i, t in enumerate(req.tools):
            if t.type != "function":
                raise bad_request(f"tools.{i}: only function tools are served here, got type {t.type!r}",
                                  f"tools.{i}.type")
        body["tools"] = [{"type": "function", "function": {"name": t.name, "description": t.description,
                                                           "parameters": t.parameters}} for t in req.tools]
    choice = req.tool_choice
    if isinstance(choice, dict):
        if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
            raise bad_request('tool_choice must be "none", "auto", "required" or {"type": "function", "name": ...}',
                              "tool_choice")
        body["tool_choice"] = {"type": "function", "function": {"name": choice["name"]}}
    elif choice is not None:
        body["tool_choice"] = choice
    fmt = req.text.format if req.text is not None else None
    if fmt is not None:
        response_format_constraint(fmt, "text.format")  # errors name the Responses field
        body["response_format"] = fmt
    try:
        chat = ChatCompletionRequest.model_validate(body)
    except ValueError as e:
        raise bad_request(f"invalid request: {e}") from None
    return chat, conversation


def _output_items(text: str, parser: HermesToolParser | None) -> tuple[list[dict[str, Any]], list[ToolCall]]:
    calls: list[ToolCall] = []
    content: str | None = text
    if parser is not None:
        parsed = parser.parse(text)
        content, calls = parsed.content, parsed.tool_calls
    items: list[dict[str, Any]] = []
    if content:
        items.append(_message_item(_item_id("msg"), content, "completed"))
    items.extend(_call_item(_item_id("fc"), c, "completed") for c in calls)
    return items, calls


def _message_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    return {"type": "message", "id": item_id, "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}


def _call_item(item_id: str, call: ToolCall, status: str, arguments: str | None = None) -> dict[str, Any]:
    return {"type": "function_call", "id": item_id, "call_id": call.id, "name": call.name,
            "arguments": call.arguments if arguments is None else arguments, "status": status}


def _usage(prompt_len: int, cached: int, output_tokens: int) -> dict[str, Any]:
    return {"input_tokens": prompt_len, "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
            "output_tokens": output_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": prompt_len + output_tokens}


def _assistant_message(output: list[dict[str, Any]]) -> dict[str, Any]:
    """The response's output as the assistant turn of the stored conversation."""
    text = "".join(part["text"] for item in output if item["type"] == "message" for part in item["content"])
    msg: dict[str, Any] = {"role": "assistant", "content": text}
    calls = []
    for item in output:
        if item["type"] == "function_call":
            try:
                args: Any = json.loads(item["arguments"])
            except ValueError:
                args = item["arguments"]
            calls.append({"id": item["call_id"], "type": "function",
                          "function": {"name": item["name"], "arguments": args}})
    if calls:
        msg["tool_calls"] = calls
    return msg


class _Shell:
    """The fields of a response object that do not depend on the output."""

    def __init__(self, state: ServerState, req: ResponsesRequest, response_id: str) -> None:
        self.state, self.req, self.id = state, req, response_id
        self.created = int(time.time())

    def build(self, status: str, output: list[dict[str, Any]], usage: dict[str, Any] | None,
              finish_reason: str | None = None, error: dict[str, Any] | None = None) -> dict[str, Any]:
        req = self.req
        return {
            "id": self.id, "object": "response", "created_at": self.created, "status": status,
            "completed_at": int(time.time()) if status == "completed" else None,
            "error": error,
            "incomplete_details": {"reason": "max_output_tokens"} if finish_reason == "length" else None,
            "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
            "model": req.model or self.state.config.model_name, "output": output,
            "parallel_tool_calls": req.parallel_tool_calls, "previous_response_id": req.previous_response_id,
            "temperature": req.temperature, "top_p": req.top_p,
            "text": {"format": (req.text.format if req.text and req.text.format else {"type": "text"})},
            "tool_choice": req.tool_choice or "auto",
            "tools": [t.model_dump(exclude_none=True) for t in req.tools or []],
            "store": req.store, "metadata": req.metadata or {}, "usage": usage,
        }


async def create_response(state: ServerState, request: Request, body: dict[str, Any],
                          session_id: str | None, arrival: float) -> Any:
    req: ResponsesRequest = parse_model(ResponsesRequest, body)  # type: ignore[arg-type]
    state.check_model(req.model)
    requested_max_tokens(req.max_output_tokens, "max_output_tokens")
    chat, conversation = _chat_request(state, req)
    check_common(chat, max_n=1)
    check_chat(chat)
    prompt = render_prompt(state, chat)
    max_tokens = resolve_max_tokens(state, len(prompt), req.max_output_tokens, "max_output_tokens", "input")
    parser, spec, spec_param = chat_constraint(state, chat)
    await compiled(state, spec, "text.format" if spec_param == "response_format" else spec_param)
    params = [sampling_params(chat, max_tokens=max_tokens, logprobs=None, choice=0, structured=spec)]
    if not (chat.tools and chat.tool_choice != "none"):
        parser = None
    shell = _Shell(state, req, _item_id("resp"))
    gen = Generation(state, shell.id, [prompt], params, session_id, arrival, streamed=bool(req.stream))
    await gen.start()
    if req.stream:
        return StreamingResponse(_stream(state, shell, gen, prompt, parser, conversation),
                                 media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
    try:
        finals = await collect(gen, request)
    except ClientGone:
        return JSONResponse({}, status_code=499)
    out = finals[0]
    output, _ = _output_items(out.text, parser)
    status = "incomplete" if out.finish_reason == "length" else "completed"
    resp = shell.build(status, output, _usage(len(prompt), out.cached_tokens, len(out.token_ids)), out.finish_reason)
    _store(state, req, resp, conversation)
    log_finished("responses", shell.id, session_id, len(prompt), out.cached_tokens, len(out.token_ids), arrival,
                 [out.finish_reason])
    return JSONResponse(resp)


def _store(state: ServerState, req: ResponsesRequest, resp: dict[str, Any], conversation: list[dict[str, Any]]) -> None:
    if req.store:
        state.responses.put(resp["id"], StoredResponse(resp, conversation + [_assistant_message(resp["output"])]))


async def retrieve_response(state: ServerState, response_id: str) -> Any:
    item = state.responses.get(response_id)
    if item is None:
        raise APIError(404, f"no stored response with id {response_id!r}", param="response_id",
                       code="response_not_found")
    return JSONResponse(item.response)


async def delete_response(state: ServerState, response_id: str) -> Any:
    if not state.responses.delete(response_id):
        raise APIError(404, f"no stored response with id {response_id!r}", param="response_id",
                       code="response_not_found")
    return JSONResponse({"id": response_id, "object": "response.deleted", "deleted": True})


async def _stream(state: ServerState, shell: _Shell, gen: Generation, prompt: list[int],
                  parser: HermesToolParser | None, conversation: list[dict[str, Any]]) -> AsyncIterator[str]:
    seq = 0

    def event(kind: str, **data: Any) -> str:
        nonlocal seq
        payload = {"type": kind, "sequence_number": seq, **data}
        seq += 1
        return f"event: {kind}\ndata: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n"

    stream_parser = parser.stream() if parser is not None else None
    output: list[dict[str, Any]] = []
    text_item: dict[str, Any] | None = None
    text = ""

    def close_text() -> list[str]:
        nonlocal text_item, text
        if text_item is None:
            return []
        idx = output.index(text_item)
        done = _message_item(text_item["id"], text, "completed")
        output[idx] = done
        part = done["content"][0]
        events = [event("response.output_text.done", item_id=done["id"], output_index=idx, content_index=0,
                        text=text, logprobs=[]),
                  event("response.content_part.done", item_id=done["id"], output_index=idx, content_index=0,
                        part=part),
                  event("response.output_item.done", output_index=idx, item=done)]
        text_item, text = None, ""
        return events

    yield event("response.created", response=shell.build("in_progress", [], None))
    yield event("response.in_progress", response=shell.build("in_progress", [], None))
    try:
        async for _, out in gen:
            pieces: list[Any]
            if stream_parser is None:
                pieces = [ContentDelta(out.new_text)] if out.new_text else []
            else:
                pieces = stream_parser.feed(out.new_text)
                if out.finished:
                    pieces += stream_parser.finish()
            for piece in pieces:
                if isinstance(piece, ContentDelta):
                    if not piece.text:
                        continue
                    if text_item is None:
                        text_item = _message_item(_item_id("msg"), "", "in_progress")
                        text_item["content"] = []
                        output.append(text_item)
                        idx = len(output) - 1
                        yield event("response.output_item.added", output_index=idx, item=text_item)
                        yield event("response.content_part.added", item_id=text_item["id"], output_index=idx,
                                    content_index=0, part={"type": "output_text", "text": "", "annotations": [],
                                                           "logprobs": []})
                    text += piece.text
                    yield event("response.output_text.delta", item_id=text_item["id"],
                                output_index=output.index(text_item), content_index=0, delta=piece.text, logprobs=[])
                else:
                    for e in close_text():
                        yield e
                    call = piece.call
                    item_id = _item_id("fc")
                    output.append(_call_item(item_id, call, "in_progress", arguments=""))
                    idx = len(output) - 1
                    yield event("response.output_item.added", output_index=idx, item=output[idx])
                    yield event("response.function_call_arguments.delta", item_id=item_id, output_index=idx,
                                delta=call.arguments)
                    yield event("response.function_call_arguments.done", item_id=item_id, output_index=idx,
                                name=call.name, arguments=call.arguments)
                    output[idx] = _call_item(item_id, call, "completed")
                    yield event("response.output_item.done", output_index=idx, item=output[idx])
            if out.finished:
                for e in close_text():
                    yield e
                status = "incomplete" if out.finish_reason == "length" else "completed"
                resp = shell.build(status, output, _usage(len(prompt), out.cached_tokens, len(out.token_ids)),
                                   out.finish_reason)
                _store(state, shell.req, resp, conversation)
                yield event("response.incomplete" if status == "incomplete" else "response.completed", response=resp)
                log_finished("responses-stream", shell.id, gen.session_id, len(prompt), out.cached_tokens,
                             len(out.token_ids), gen.timers[0].arrival, [out.finish_reason])
    except EngineStepError as e:
        yield event("response.failed", response=shell.build("failed", output, None,
                                                             error={"code": "server_error", "message": str(e)}))
    finally:
        await gen.close()
