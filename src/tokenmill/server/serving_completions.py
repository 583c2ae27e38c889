"""``POST /v1/completions``: raw prompts (text or token ids, one or many) -> engine -> response or SSE.

With several prompts and ``n`` choices each, choice ``p * n + j`` is the j-th sample of prompt p.
``echo`` with ``logprobs`` returns the prompt tokens' logprobs ahead of the completion's (the
first prompt token's is null), computed by the engine from the prompt rows (prompt logprobs).
"""
from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from tokenmill.engine.async_engine import EngineStepError
from tokenmill.server.common import (
    SSE_DONE, ClientGone, Generation, ServerState, check_token_ids, collect, completion_logprobs, log_finished,
    new_id, parse_model, prompt_logprobs_json, resolve_max_tokens, sampling_params, sse, sse_error, usage,
)
from tokenmill.server.structured import (
    compiled, extension_constraints, response_format_constraint, single_constraint,
)
from tokenmill.server.errors import APIError
from tokenmill.server.protocol import CompletionRequest, check_common, check_completion, requested_max_tokens


def tokenize_prompts(state: ServerState, req: CompletionRequest) -> list[list[int]]:
    p = req.prompt
    if isinstance(p, str):
        state.check_text_fits(p, "prompt")
        return [list(state.tokenizer.encode(p))]
    if all(isinstance(x, str) for x in p):
        for i, x in enumerate(p):
            state.check_text_fits(x, f"prompt.{i}")  # type: ignore[arg-type]
        return [list(state.tokenizer.encode(x)) for x in p]  # type: ignore[arg-type]
    if all(isinstance(x, int) for x in p):
        ids = [list(p)]  # type: ignore[arg-type]
    else:
        ids = [list(x) for x in p]  # type: ignore[union-attr]
    for i, one in enumerate(ids):
        check_token_ids(state, one, "prompt" if len(ids) == 1 else f"prompt.{i}")
    return ids  # type: ignore[return-value]


async def create_completion(state: ServerState, request: Request, body: dict[str, Any],
                            session_id: str | None, arrival: float) -> Any:
    req: CompletionRequest = parse_model(CompletionRequest, body)
    state.check_model(req.model)
    check_common(req, max_n=state.config.max_n)
    check_completion(req)
    requested = requested_max_tokens(req.max_tokens, "max_tokens")
    # Text prompts are tokenized on a worker thread (with its own tokenizer copy), so a long
    # prompt neither blocks the event loop nor waits behind another request's tokenization.
    text = isinstance(req.prompt, str) or any(isinstance(x, str) for x in req.prompt)
    prompts = await state.tokenizers.run(tokenize_prompts, state, req) if text else tokenize_prompts(state, req)
    if any(not p for p in prompts):
        raise APIError(400, "prompt must hold at least one token", param="prompt", code="empty_prompt")
    found = []
    rf = response_format_constraint(req.response_format)
    if rf is not None:
        found.append(("response_format", rf))
    found.extend(extension_constraints(req))
    spec = single_constraint(found)
    await compiled(state, spec, found[0][0] if found else "")
    echo_logprobs = req.echo and req.logprobs is not None
    prompt_lp = req.prompt_logprobs
    if echo_logprobs:
        prompt_lp = max(prompt_lp or 0, req.logprobs or 0)
    flat_prompts: list[list[int]] = []
    params = []
    for p in prompts:
        max_tokens = resolve_max_tokens(state, len(p), requested, "max_tokens", "prompt")
        for j in range(req.n):
            flat_prompts.append(p)
            params.append(sampling_params(req, max_tokens=max_tokens, logprobs=req.logprobs, choice=j,
                                          structured=spec, prompt_logprobs=prompt_lp))

    request_id = new_id("cmpl")
    gen = Generation(state, request_id, flat_prompts, params, session_id, arrival, req.deadline_s,
                     streamed=bool(req.stream))
    await gen.start()
    echo_texts = [state.tokenizer.decode(p) if req.echo else "" for p in prompts]
    if req.stream:
        try:
            await gen.wait_first(request)
        except ClientGone:
            return JSONResponse({}, status_code=499)
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return StreamingResponse(_stream(state, req, gen, prompts, echo_texts, include_usage),
                                 media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
    try:
        finals = await collect(gen, request)
    except ClientGone:
        return JSONResponse({}, status_code=499)
    choices = []
    for i, out in enumerate(finals):
        echo = echo_texts[i // req.n]
        choice: dict[str, Any] = {"index": i, "text": echo + out.text, "finish_reason": out.finish_reason,
                                  "logprobs": None}
        if echo_logprobs and out.logprobs is not None:
            choice["logprobs"] = completion_logprobs(state, out.logprobs, req.logprobs or 0, 0,
                                                     prompt=out.prompt_logprobs, first_prompt_token=flat_prompts[i][0])
        elif req.logprobs is not None and out.logprobs is not None:
            choice["logprobs"] = completion_logprobs(state, out.logprobs, req.logprobs, len(echo))
        if req.prompt_logprobs is not None:
            choice["prompt_logprobs"] = prompt_logprobs_json(state, out.prompt_logprobs)
        if req.return_token_ids:
            choice["prompt_token_ids"] = list(flat_prompts[i])
            choice["token_ids"] = list(out.token_ids)
        choices.append(choice)
    prompt_tokens = sum(len(p) for p in prompts)
    cached = sum(finals[k * req.n].cached_tokens for k in range(len(prompts)))
    completion_tokens = sum(len(o.token_ids) for o in finals)
    log_finished("completion", request_id, session_id, prompt_tokens, cached, completion_tokens, arrival,
                 [o.finish_reason for o in finals])
    return JSONResponse({
        "id": request_id, "object": "text_completion", "created": int(time.time()),
        "model": req.model or state.config.model_name, "choices": choices,
        "usage": usage(prompt_tokens, completion_tokens, cached,
                       [finals[k * req.n].cached_tokens_by_tier for k in range(len(prompts))],
                       sum(o.num_accepted_draft_tokens for o in finals) if state.speculative else None),
    })


async def _stream(state: ServerState, req: CompletionRequest, gen: Generation, prompts: list[list[int]],
                  echo_texts: list[str], include_usage: bool) -> AsyncIterator[str]:
    created = int(time.time())
    model = req.model or state.config.model_name
    num = len(gen.prompts)
    completion_tokens = [0] * num
    accepted = [0] * num
    cached = [0] * num
    tiers: list[dict[str, int] | None] = [None] * num
    offsets = [len(echo_texts[i // req.n]) for i in range(num)]
    reasons: list[str | None] = [None] * num

    def chunk(index: int, text: str, finish: str | None = None, logprobs: Any = None,
              extra: dict[str, Any] | None = None) -> str:
        choice: dict[str, Any] = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish,
                                  **(extra or {})}
        obj: dict[str, Any] = {"id": gen.request_id, "object": "text_completion", "created": created,
                               "model": model, "choices": [choice]}
        if include_usage:
            obj["usage"] = None
        return sse(obj)

    echo_logprobs = req.echo and req.logprobs is not None
    started = [False] * num

    def first_chunk(i: int, out: Any) -> str:
        """Echoed prompt (with its logprobs when asked) and prompt token ids, before any output."""
        extra: dict[str, Any] = {}
        if req.return_token_ids:
            extra["prompt_token_ids"] = list(gen.prompts[i])
        if out is not None and req.prompt_logprobs is not None:
            extra["prompt_logprobs"] = prompt_logprobs_json(state, out.prompt_logprobs)
        logprobs = None
        if echo_logprobs and out is not None:
            logprobs = completion_logprobs(state, [], req.logprobs or 0, 0, prompt=out.prompt_logprobs,
                                           first_prompt_token=gen.prompts[i][0])
        return chunk(i, echo_texts[i // req.n], logprobs=logprobs, extra=extra or None)

    needs_output = echo_logprobs or req.prompt_logprobs is not None
    try:
        for i in range(num):
            if not needs_output and (req.echo or req.return_token_ids):
                started[i] = True
                yield first_chunk(i, None)
        async for index, out in gen:
            if not started[index]:
                started[index] = True
                if needs_output:
                    yield first_chunk(index, out)
            completion_tokens[index] = len(out.token_ids)
            accepted[index] = out.num_accepted_draft_tokens
            cached[index] = out.cached_tokens
            tiers[index] = out.cached_tokens_by_tier
            logprobs = None
            if req.logprobs is not None and out.logprobs is not None and out.new_token_ids:
                start = len(out.token_ids) - len(out.new_token_ids)
                logprobs = completion_logprobs(state, out.logprobs[start:], req.logprobs, offsets[index])
            offsets[index] += len(out.new_text)
            if out.finished:
                reasons[index] = out.finish_reason
            extra = {"token_ids": list(out.new_token_ids)} if req.return_token_ids else None
            # A step whose text is held back (a possible stop string, a split UTF-8 character)
            # still carries token ids when the client asked for them.
            if not (out.new_text or out.finished or logprobs is not None or (extra and out.new_token_ids)):
                continue
            yield chunk(index, out.new_text, out.finish_reason if out.finished else None, logprobs, extra)
        if include_usage:
            prompt_tokens = sum(len(p) for p in prompts)
            hits = sum(cached[k * req.n] for k in range(len(prompts)))
            yield sse({"id": gen.request_id, "object": "text_completion", "created": created, "model": model,
                       "choices": [], "usage": usage(prompt_tokens, sum(completion_tokens), hits,
                                                  [tiers[k * req.n] for k in range(len(prompts))],
                                                  sum(accepted) if state.speculative else None)})
        log_finished("completion-stream", gen.request_id, gen.session_id, sum(len(p) for p in prompts),
                     sum(cached[k * req.n] for k in range(len(prompts))), sum(completion_tokens),
                     gen.timers[0].arrival, reasons)
    except EngineStepError as e:
        yield sse_error(APIError(500, str(e), type="server_error", code="engine_error"))
    finally:
        await gen.close()
    yield SSE_DONE
