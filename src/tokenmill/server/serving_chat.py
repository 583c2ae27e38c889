"""``POST /v1/chat/completions``: messages -> chat template -> engine -> response or SSE stream."""
from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse
from jinja2 import TemplateError

from tokenmill.engine.async_engine import EngineStepError
from tokenmill.server.common import (
    SSE_DONE, ClientGone, Generation, ServerState, chat_logprobs, collect, log_finished, new_id,
    parse_model, prompt_logprobs_json, resolve_max_tokens, sampling_params, sse, sse_error, usage,
)
from tokenmill.server.errors import APIError, bad_request
from tokenmill.server.protocol import (
    ChatCompletionRequest, ChatMessage, check_chat, check_common, requested_max_tokens,
)
from tokenmill.server.structured import (
    compiled, extension_constraints, response_format_constraint, single_constraint, tool_call_constraint,
)
from tokenmill.server.tool_parser import (
    ContentDelta, HermesStreamParser, HermesToolParser, ToolCall, ToolCallDelta,
)

# Prompts longer than this (in characters) are tokenized off the event loop.
_INLINE_TOKENIZE_CHARS = 16_384


def _message_dict(msg: ChatMessage) -> dict[str, Any]:
    """A message as HF chat templates expect it: string content, tool-call arguments as objects."""
    if isinstance(msg.content, list):
        content = "".join(part.text or "" for part in msg.content)
    else:
        content = msg.content or ""
    out: dict[str, Any] = {"role": msg.role, "content": content}
    if msg.name is not None:
        out["name"] = msg.name
    if msg.tool_call_id is not None:
        out["tool_call_id"] = msg.tool_call_id
    if msg.tool_calls:
        calls = []
        for call in msg.tool_calls:
            args: Any = call.function.arguments
            if isinstance(args, str):
                try:
                    args = json.loads(args)
                except ValueError:
                    pass  # templates get the text as is
            calls.append({"id": call.id, "type": "function",
                          "function": {"name": call.function.name, "arguments": args}})
        out["tool_calls"] = calls
    return out


def _template_tools(req: ChatCompletionRequest) -> list[dict[str, Any]] | None:
    if not req.tools or req.tool_choice == "none":
        return None
    tools = [t.model_dump(exclude_none=True) for t in req.tools]
    if isinstance(req.tool_choice, dict):
        name = req.tool_choice["function"]["name"]
        tools = [t for t in tools if t["function"]["name"] == name]
    return tools


def render_prompt(state: ServerState, req: ChatCompletionRequest) -> list[int]:
    """Apply the chat template (with tools) and tokenize; template errors are the client's (400)."""
    tok = state.tokenizer
    kwargs = dict(req.chat_template_kwargs or {})
    try:
        text = tok.apply_chat_template(
            [_message_dict(m) for m in req.messages], tools=_template_tools(req), tokenize=False,
            add_generation_prompt=req.add_generation_prompt, chat_template=state.config.chat_template, **kwargs,
        )
    except (TemplateError, TypeError, ValueError) as e:
        raise bad_request(f"the chat template could not render these messages: {e}", "messages",
                          code="chat_template_error") from None
    state.check_text_fits(text, "messages")
    return list(tok.encode(text, add_special_tokens=False))


async def create_chat_completion(state: ServerState, request: Request, body: dict[str, Any],
                                 session_id: str | None, arrival: float) -> Any:
    req: ChatCompletionRequest = parse_model(ChatCompletionRequest, body)
    state.check_model(req.model)
    check_common(req, max_n=state.config.max_n)
    check_chat(req)
    requested = requested_max_tokens(req.max_completion_tokens, "max_completion_tokens")
    if requested is None:
        requested = requested_max_tokens(req.max_tokens, "max_tokens")
    param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"

    chars = sum(len(m.content) if isinstance(m.content, str) else sum(len(p.text or "") for p in m.content or [])
                for m in req.messages)
    if chars > _INLINE_TOKENIZE_CHARS:
        prompt = await state.tokenizers.run(render_prompt, state, req)
    else:
        prompt = render_prompt(state, req)
    max_tokens = resolve_max_tokens(state, len(prompt), requested, param, "messages")
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    tool_parser, spec, spec_param = chat_constraint(state, req)
    await compiled(state, spec, spec_param)
    params = [sampling_params(req, max_tokens=max_tokens, logprobs=logprobs, choice=i, structured=spec,
                              prompt_logprobs=req.prompt_logprobs) for i in range(req.n)]
    parse_tools = tool_parser is not None and bool(req.tools) and req.tool_choice != "none"

    request_id = new_id("chatcmpl")
    gen = Generation(state, request_id, [prompt] * req.n, params, session_id, arrival, req.deadline_s,
                     streamed=bool(req.stream))
    await gen.start()
    if req.stream:
        try:
            await gen.wait_first(request)
        except ClientGone:
            return JSONResponse({}, status_code=499)
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return StreamingResponse(_stream(state, req, gen, prompt, include_usage, tool_parser if parse_tools else None),
                                 media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
    try:
        finals = await collect(gen, request)
    except ClientGone:
        return JSONResponse({}, status_code=499)
    return JSONResponse(_full_response(state, req, request_id, prompt, finals, tool_parser if parse_tools else None,
                                       session_id, arrival))


def chat_constraint(state: ServerState, req: ChatCompletionRequest
                    ) -> tuple[HermesToolParser | None, Any, str]:
    """(tool parser for this request, its output constraint or None, the field it came from)."""
    forced = bool(req.tools) and (req.tool_choice == "required" or isinstance(req.tool_choice, dict))
    parser = state.tool_parser_for(forced) if req.tools else None
    found = []
    rf = response_format_constraint(req.response_format)
    if rf is not None:
        found.append(("response_format", rf))
    found.extend(extension_constraints(req))
    if forced and parser is not None and req.tools:
        name = req.tool_choice["function"]["name"] if isinstance(req.tool_choice, dict) else None
        tools = [(t.function.name, t.function.parameters) for t in req.tools]
        found.append(("tool_choice", tool_call_constraint(parser, tools, name=name,
                                                          parallel=req.parallel_tool_calls is not False)))
    spec = single_constraint(found)
    return parser, spec, found[0][0] if found else ""


def _full_response(state: ServerState, req: ChatCompletionRequest, request_id: str, prompt: list[int],
                   finals: list[Any], tool_parser: HermesToolParser | None, session_id: str | None,
                   arrival: float) -> dict[str, Any]:
    choices = []
    for i, out in enumerate(finals):
        message, tool_finish = assistant_message(out.text, tool_parser)
        finish = tool_finish or out.finish_reason
        choice: dict[str, Any] = {"index": i, "message": message, "finish_reason": finish,
                                  "logprobs": None}
        if req.logprobs and out.logprobs is not None:
            choice["logprobs"] = {"content": chat_logprobs(state, out.logprobs, req.top_logprobs or 0)}
        if req.return_token_ids:
            choice["token_ids"] = list(out.token_ids)
        choices.append(choice)
    completion_tokens = sum(len(o.token_ids) for o in finals)
    cached = finals[0].cached_tokens if finals else 0
    log_finished("chat", request_id, session_id, len(prompt), cached, completion_tokens, arrival,
                 [o.finish_reason for o in finals])
    resp: dict[str, Any] = {
        "id": request_id, "object": "chat.completion", "created": int(time.time()),
        "model": req.model or state.config.model_name, "choices": choices,
        "usage": usage(len(prompt), completion_tokens, cached, [finals[0].cached_tokens_by_tier] if finals else None,
                       sum(o.num_accepted_draft_tokens for o in finals) if state.speculative else None),
    }
    if req.return_token_ids:
        resp["prompt_token_ids"] = list(prompt)
    if req.prompt_logprobs is not None and finals:
        resp["prompt_logprobs"] = prompt_logprobs_json(state, finals[0].prompt_logprobs)
    return resp


def assistant_message(text: str, parser: HermesToolParser | None) -> tuple[dict[str, Any], str | None]:
    """The response message for ``text``; the finish reason is "tool_calls" when it holds calls."""
    if parser is not None:
        parsed = parser.parse(text)
        if parsed.tool_calls:
            return ({"role": "assistant", "content": parsed.content,
                     "tool_calls": [_tool_call_json(c) for c in parsed.tool_calls]}, "tool_calls")
    return {"role": "assistant", "content": text}, None


def stream_deltas(parser: HermesStreamParser, new_text: str, finished: bool) -> list[dict[str, Any]]:
    """Chunk deltas for one step's new text: content pieces and whole tool calls."""
    events = parser.feed(new_text)
    if finished:
        events += parser.finish()
    return [_delta_of(e) for e in events]


def _tool_call_json(call: ToolCall) -> dict[str, Any]:
    return {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}


async def _stream(state: ServerState, req: ChatCompletionRequest, gen: Generation, prompt: list[int],
                  include_usage: bool, tool_parser: HermesToolParser | None) -> AsyncIterator[str]:
    created = int(time.time())
    model = req.model or state.config.model_name
    n = req.n
    parsers: list[HermesStreamParser | None] = [
        tool_parser.stream() if tool_parser is not None else None for _ in range(n)]
    completion_tokens = [0] * n
    accepted = [0] * n
    cached = [0] * n
    tiers: list[dict[str, int] | None] = [None] * n
    reasons: list[str | None] = [None] * n
    sent_prompt_logprobs = False

    def chunk(index: int, delta: dict[str, Any], finish: str | None = None, logprobs: Any = None,
              token_ids: list[int] | None = None, extra: dict[str, Any] | None = None) -> str:
        choice: dict[str, Any] = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        if token_ids is not None:
            choice["token_ids"] = token_ids
        obj: dict[str, Any] = {"id": gen.request_id, "object": "chat.completion.chunk", "created": created,
                               "model": model, "choices": [choice], **(extra or {})}
        if include_usage:
            obj["usage"] = None
        return sse(obj)

    try:
        for i in range(n):
            extra = {"prompt_token_ids": list(prompt)} if req.return_token_ids and i == 0 else None
            yield chunk(i, {"role": "assistant", "content": ""}, extra=extra)
        async for index, out in gen:
            completion_tokens[index] = len(out.token_ids)
            accepted[index] = out.num_accepted_draft_tokens
            cached[index] = out.cached_tokens
            tiers[index] = out.cached_tokens_by_tier
            logprobs = None
            if req.logprobs and out.logprobs is not None and out.new_token_ids:
                start = len(out.token_ids) - len(out.new_token_ids)
                logprobs = {"content": chat_logprobs(state, out.logprobs[start:], req.top_logprobs or 0)}
            token_ids = list(out.new_token_ids) if req.return_token_ids else None
            parser = parsers[index]
            pieces: list[dict[str, Any]] = []
            if parser is None:
                if out.new_text:
                    pieces.append({"content": out.new_text})
            else:
                pieces.extend(stream_deltas(parser, out.new_text, out.finished))
            finish = None
            if out.finished:
                finish = out.finish_reason
                if parser is not None and parser.num_calls:
                    finish = "tool_calls"
                reasons[index] = finish
            first_extra = None
            if req.prompt_logprobs is not None and index == 0 and not sent_prompt_logprobs:
                first_extra = {"prompt_logprobs": prompt_logprobs_json(state, out.prompt_logprobs)}
                sent_prompt_logprobs = True
            if not pieces and (logprobs is not None or token_ids or finish is not None or first_extra):
                pieces.append({})
            for k, delta in enumerate(pieces):
                last = k == len(pieces) - 1
                yield chunk(index, delta, finish if last else None, logprobs if last else None,
                            token_ids if last else None, extra=first_extra if k == 0 else None)
        if include_usage:
            total = sum(completion_tokens)
            yield sse({"id": gen.request_id, "object": "chat.completion.chunk", "created": created, "model": model,
                       "choices": [], "usage": usage(len(prompt), total, cached[0], tiers[:1],
                                                     sum(accepted) if state.speculative else None)})
        log_finished("chat-stream", gen.request_id, gen.session_id, len(prompt), cached[0], sum(completion_tokens),
                     gen.timers[0].arrival, reasons)
    except EngineStepError as e:
        yield sse_error(APIError(500, str(e), type="server_error", code="engine_error"))
    finally:
        await gen.close()
    yield SSE_DONE


def _delta_of(event: ContentDelta | ToolCallDelta) -> dict[str, Any]:
    if isinstance(event, ContentDelta):
        return {"content": event.text}
    return {"tool_calls": [{"index": event.index, **_tool_call_json(event.call)}]}
