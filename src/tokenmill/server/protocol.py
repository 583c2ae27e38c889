"""OpenAI request bodies (pydantic) and their checks.

Pydantic checks types; :func:`check_common` checks ranges with messages that name the field.
Unknown fields are ignored, as OpenAI clients send fields this server has no use for, and an
explicit ``null`` means the field's default.
Responses are built as plain dicts in ``serving_*.py`` (they go straight to JSON).

tokenmill extensions accepted in both endpoints: ``return_token_ids`` (raw prompt and completion
token ids in the response), ``top_k``, ``min_p``, ``repetition_penalty``, ``ignore_eos``,
``stop_token_ids``, ``speculative`` (false: no speculative decoding for this request).
``stop_token_ids``, ``prompt_logprobs`` (log-probabilities of the prompt tokens), and the output
constraints ``regex``, ``choice``, ``grammar`` (see server/structured.py; ``response_format`` is
the OpenAI one).
"""
from __future__ import annotations

import math
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictStr, model_validator

from tokenmill.contracts.sampling import MAX_LOGPROBS
from tokenmill.server.errors import APIError, bad_request


class ProtocolModel(BaseModel):
    """Base of every API body model (OpenAI, Anthropic, Responses): unknown fields are ignored and
    an explicit null takes the default."""

    model_config = ConfigDict(extra="ignore")

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data: Any) -> Any:
        # clients often send "n": null, "stop": null, ...: an explicit null takes the default
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if v is not None}
        return data


_Model = ProtocolModel


class StreamOptions(_Model):
    include_usage: StrictBool = False


class FunctionDef(_Model):
    name: StrictStr
    description: StrictStr | None = None
    parameters: dict[str, Any] | None = None
    strict: StrictBool | None = None


class ToolDef(_Model):
    type: Literal["function"] = "function"
    function: FunctionDef


class ToolCallFunction(_Model):
    name: StrictStr
    arguments: StrictStr | dict[str, Any] = "{}"


class ToolCallIn(_Model):
    id: StrictStr | None = None
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ContentPart(_Model):
    type: StrictStr
    text: StrictStr | None = None


class ChatMessage(_Model):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: StrictStr | list[ContentPart] | None = None
    name: StrictStr | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: StrictStr | None = None


class SamplingFields(_Model):
    """Fields shared by both endpoints."""

    model: StrictStr | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: StrictStr | list[StrictStr] | None = None
    n: int = 1
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    user: StrictStr | None = None
    prompt_cache_key: StrictStr | None = None
    # extensions
    return_token_ids: StrictBool = False
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    ignore_eos: StrictBool = False
    stop_token_ids: list[int] = Field(default_factory=list)
    speculative: StrictBool = True
    deadline_s: float | None = None   # finish within this many seconds of arrival (finish_reason "deadline")
    prompt_logprobs: int | None = None
    response_format: dict[str, Any] | None = None
    regex: StrictStr | None = None
    choice: list[StrictStr] | None = None
    grammar: StrictStr | None = None


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: StrictBool = False
    top_logprobs: int | None = None
    tools: list[ToolDef] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: StrictBool | None = None
    add_generation_prompt: StrictBool = True
    chat_template_kwargs: dict[str, Any] | None = None


class CompletionRequest(SamplingFields):
    prompt: StrictStr | list[StrictStr] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    echo: StrictBool = False
    logprobs: int | None = None


def check_common(req: SamplingFields, *, max_n: int) -> None:
    """Range checks shared by both endpoints; raises :class:`APIError` (400)."""
    if req.temperature is not None and not (math.isfinite(req.temperature) and req.temperature >= 0):
        raise bad_request(f"temperature must be >= 0, got {req.temperature}", "temperature")
    if req.top_p is not None and not (0.0 < req.top_p <= 1.0):
        raise bad_request(f"top_p must be in (0, 1], got {req.top_p}", "top_p")
    if req.n < 1:
        raise bad_request(f"n must be at least 1, got {req.n}", "n")
    if req.n > max_n:
        raise bad_request(f"n must be at most {max_n} on this server, got {req.n}", "n")
    for field in ("presence_penalty", "frequency_penalty"):
        value = getattr(req, field)
        if not -2.0 <= value <= 2.0:
            raise bad_request(f"{field} must be in [-2, 2], got {value}", field)
    if req.top_k < 0:
        raise bad_request(f"top_k must be >= 0 (0 disables it), got {req.top_k}", "top_k")
    if req.top_k > 2**31 - 1:   # found by the fuzzer: a value past int64 failed the engine step
        raise bad_request(f"top_k must be at most {2**31 - 1}, got {req.top_k}", "top_k")
    if req.seed is not None and not -(2**63) <= req.seed < 2**63:
        raise bad_request(f"seed must fit in 64 bits, got {req.seed}", "seed")
    if not 0.0 <= req.min_p <= 1.0:
        raise bad_request(f"min_p must be in [0, 1], got {req.min_p}", "min_p")
    if not req.repetition_penalty > 0.0:
        raise bad_request(f"repetition_penalty must be > 0, got {req.repetition_penalty}", "repetition_penalty")
    if req.stop is not None:
        stops = [req.stop] if isinstance(req.stop, str) else req.stop
        if any(not s for s in stops):
            raise bad_request("stop strings must be non-empty", "stop")
        if len(stops) > 16:
            raise bad_request(f"at most 16 stop strings are accepted, got {len(stops)}", "stop")
    if req.deadline_s is not None and not (math.isfinite(req.deadline_s) and req.deadline_s > 0):
        raise bad_request(f"deadline_s must be a number of seconds > 0, got {req.deadline_s}", "deadline_s")
    if req.prompt_logprobs is not None and not 0 <= req.prompt_logprobs <= MAX_LOGPROBS:
        raise bad_request(f"prompt_logprobs must be between 0 and {MAX_LOGPROBS}, got {req.prompt_logprobs}",
                          "prompt_logprobs")
    if req.stream_options is not None and not req.stream:
        raise bad_request("stream_options is only allowed when stream is true", "stream_options")


def check_chat(req: ChatCompletionRequest) -> None:
    if not req.messages:
        raise bad_request("messages must hold at least one message", "messages", code="empty_array")
    if req.top_logprobs is not None:
        if not 0 <= req.top_logprobs <= MAX_LOGPROBS:
            raise bad_request(f"top_logprobs must be between 0 and {MAX_LOGPROBS}, got {req.top_logprobs}",
                              "top_logprobs")
        if not req.logprobs:
            raise bad_request("top_logprobs needs logprobs set to true", "top_logprobs")
    for i, msg in enumerate(req.messages):
        if isinstance(msg.content, list):
            for part in msg.content:
                if part.type != "text" or part.text is None:
                    raise bad_request(f"messages[{i}].content: only text parts are accepted by this text-only "
                                      f"model, got a part of type {part.type!r}", f"messages.{i}.content")
    if isinstance(req.tool_choice, dict):
        name = (req.tool_choice.get("function") or {}).get("name")
        if req.tool_choice.get("type") != "function" or not isinstance(name, str):
            raise bad_request('tool_choice must be "none", "auto", "required" or '
                              '{"type": "function", "function": {"name": ...}}', "tool_choice")
        if not req.tools or all(t.function.name != name for t in req.tools):
            raise bad_request(f"tool_choice names the function {name!r}, which is not in tools", "tool_choice")
    elif req.tool_choice == "required" and not req.tools:
        raise bad_request('tool_choice "required" needs a non-empty tools list', "tool_choice")


def check_completion(req: CompletionRequest) -> None:
    if req.logprobs is not None and not 0 <= req.logprobs <= MAX_LOGPROBS:
        raise bad_request(f"logprobs must be between 0 and {MAX_LOGPROBS}, got {req.logprobs}", "logprobs")
    p = req.prompt
    if isinstance(p, list) and (not p or any(isinstance(x, list) and not x for x in p)):
        raise bad_request("prompt must not be empty", "prompt", code="empty_array")


def requested_max_tokens(value: int | None, param: str) -> int | None:
    if value is not None and value <= 0:
        raise bad_request(f"{param} must be at least 1, got {value}", param)
    return value


def context_error(prompt_len: int, max_tokens: int | None, max_model_len: int, param: str) -> APIError:
    """400 for a request that does not fit the context; ``max_tokens`` None: the prompt alone is too long."""
    if max_tokens is None:
        return bad_request(f"this model's maximum context length is {max_model_len} tokens, but the prompt "
                           f"has {prompt_len} tokens (at least one token must be left for the completion)",
                           param, code="context_length_exceeded")
    return bad_request(f"this model's maximum context length is {max_model_len} tokens, but {prompt_len + max_tokens}"
                       f" were requested ({prompt_len} in the prompt, {max_tokens} for the completion); lower "
                       f"{param} or shorten the prompt", param, code="context_length_exceeded")


__all__ = [
    "ChatCompletionRequest", "ChatMessage", "CompletionRequest", "StreamOptions", "ToolDef",
    "check_chat", "check_common", "check_completion", "context_error", "requested_max_tokens",
]
