"""What both OpenAI endpoints share: server state, body reading, sampling parameters, running the
``n`` engine requests of one HTTP request, logprob formatting and usage.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import copy
import functools
import json
import logging
import math
import threading
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple

from fastapi import Request
from pydantic import ValidationError

from tokenmill.engine.admission import QUEUE_TIMEOUT, QueueFullError
from tokenmill.engine.async_engine import AsyncEngine, EngineStepError, EngineStoppedError
from tokenmill.contracts.sampling import SamplingParams, StructuredOutputs
from tokenmill.server.errors import APIError, bad_request, from_validation_error
from tokenmill.server.limits import PARSED_BODY_KEY
from tokenmill.server.metrics import RequestTimer, ServerMetrics
from tokenmill.server.protocol import SamplingFields, context_error
from tokenmill.server.protocol_responses import ResponseStore
from tokenmill.server.tool_parser import HermesToolParser, get_tool_parser

if TYPE_CHECKING:
    from tokenmill.engine.request import RequestOutput, TokenLogprob

logger = logging.getLogger("tokenmill.server")

LOGPROB_FLOOR = -9999.0  # JSON has no -inf


@dataclass(frozen=True)
class ServerConfig:
    """Server-side knobs (the engine's live in EngineConfig)."""

    served_model_names: tuple[str, ...]
    max_n: int = 8
    max_request_bytes: int = 32 * 2**20
    api_key: str | None = None
    tool_call_parser: str | None = None
    chat_template: str | None = None     # Jinja text overriding the tokenizer's template
    shutdown_grace_s: float = 30.0
    log_token_ids: str | None = None     # directory of the token-id log (server/token_log.py)
    admin_key: str | None = None         # guards /flush_cache (else the API key does)
    max_json_depth: int = 64             # deeper request bodies get 400 (server/limits.py)
    max_waiting_requests: int | None = None  # the engine's queue bound, for the 429 fast path
    max_queue_wait_s: float | None = None    # a request not started by then fails with 503
    request_deadline_s: float | None = None  # default and upper bound of a request's deadline_s
    retry_after_s: int = 1               # Retry-After of 429 / 503 overload answers
    tokenizer_workers: int = 2           # threads that tokenize long prompts (TokenizerPool)
    log_requests: bool = False           # log prompts and outputs (off: only sizes and timings)
    max_stored_responses: int = 1024     # Responses API store (previous_response_id)

    def __post_init__(self) -> None:
        if not self.served_model_names or any(not n for n in self.served_model_names):
            raise ValueError("served_model_names must hold at least one non-empty name")
        if self.max_n < 1:
            raise ValueError(f"max_n must be at least 1, got {self.max_n}")
        if self.max_request_bytes < 1024:
            raise ValueError(f"max_request_bytes must be at least 1024, got {self.max_request_bytes}")
        if self.api_key is not None and not self.api_key:
            raise ValueError("api_key must not be empty")
        if self.tool_call_parser is not None:
            get_tool_parser(self.tool_call_parser)  # raises on an unknown name
        if self.max_stored_responses < 0:
            raise ValueError(f"max_stored_responses must be >= 0, got {self.max_stored_responses}")
        if self.shutdown_grace_s < 0:
            raise ValueError(f"shutdown_grace_s must be >= 0, got {self.shutdown_grace_s}")
        if self.admin_key is not None and not self.admin_key:
            raise ValueError("admin_key must not be empty")
        if self.max_json_depth < 2:
            raise ValueError(f"max_json_depth must be at least 2, got {self.max_json_depth}")
        if self.tokenizer_workers < 1:
            raise ValueError(f"tokenizer_workers must be at least 1, got {self.tokenizer_workers}")
        for name in ("max_queue_wait_s", "request_deadline_s"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"{name} must be > 0, got {value}")
        if self.retry_after_s < 0:
            raise ValueError(f"retry_after_s must be >= 0, got {self.retry_after_s}")

    @property
    def model_name(self) -> str:
        return self.served_model_names[0]


class TokenizerPool:
    """One tokenizer per thread, copied from a prototype on the thread's first use.

    A fast (Rust) tokenizer refuses to be used by two threads at once ("Already borrowed"), and
    one shared instance behind a lock would serialise every request's tokenization. Handlers
    tokenize long prompts on the pool's own workers (:meth:`run`), so each worker, and the
    event-loop thread, gets its own copy. The workers are a fixed number, all started (and given
    their copy) by :meth:`start`, so the server's threads and memory do not grow later when a
    burst of long prompts first needs another worker.
    """

    def __init__(self, prototype: Any, num_workers: int = 2) -> None:
        if num_workers < 1:
            raise ValueError(f"the tokenizer pool needs at least one worker, got {num_workers}")
        self._prototype = prototype
        self._local = threading.local()
        self._lock = threading.Lock()
        self.num_copies = 0
        self.num_workers = num_workers
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None

    def start(self) -> None:
        """Start every worker now and make its tokenizer copy (idempotent)."""
        if self._executor is not None:
            return
        self._executor = concurrent.futures.ThreadPoolExecutor(self.num_workers, thread_name_prefix="tokenize")
        barrier = threading.Barrier(self.num_workers)

        def warm() -> None:   # each task holds its worker until all are started: one per thread
            self.get()
            barrier.wait()

        for f in [self._executor.submit(warm) for _ in range(self.num_workers)]:
            f.result()

    async def run(self, fn: Any, *args: Any) -> Any:
        """``fn(*args)`` on a tokenizer worker, awaited from the event loop."""
        self.start()
        assert self._executor is not None
        return await asyncio.get_running_loop().run_in_executor(self._executor, functools.partial(fn, *args))

    def shutdown(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=False)
            self._executor = None

    def get(self) -> Any:
        tok = getattr(self._local, "tokenizer", None)
        if tok is None:
            with self._lock:  # deepcopy reads the prototype; never two copies at once
                tok = copy.deepcopy(self._prototype)
                self.num_copies += 1
            self._local.tokenizer = tok
        return tok


@dataclass
class ServerState:
    """Everything a handler needs; one per app."""

    engine: AsyncEngine
    config: ServerConfig
    tokenizers: TokenizerPool           # the server's own copies: one per thread (see TokenizerPool)
    max_model_len: int
    metrics: ServerMetrics
    tool_parser: HermesToolParser | None = None
    token_log: Any = None               # TokenLog, when --log-token-ids is given
    max_token_chars: int = 0            # longest vocabulary entry in characters (0: unknown)
    responses: ResponseStore = field(default_factory=lambda: ResponseStore(1024))
    _token_text: dict[int, tuple[str, list[int]]] = field(default_factory=dict)
    _grammar_compiler: Any = None

    async def grammar_compiler(self) -> Any:
        """The engine's grammar compiler (thread-safe); the first call imports xgrammar off the
        event loop and builds the compiler on the engine thread."""
        if self._grammar_compiler is None:
            import importlib

            await asyncio.to_thread(importlib.import_module, "xgrammar")
            self._grammar_compiler = await self.engine.call(lambda e: e.grammar_compiler)
        return self._grammar_compiler

    def tool_parser_for(self, forced: bool) -> HermesToolParser | None:
        """The tool-call parser of a request with tools: the configured one, or (when the request
        forces a call, whose format then comes from the constraint) the default hermes format."""
        if self.tool_parser is not None:
            return self.tool_parser
        return get_tool_parser("hermes") if forced else None

    @classmethod
    def create(cls, engine: AsyncEngine, config: ServerConfig, *, prefix_cache_enabled: bool = True) -> ServerState:
        tokenizers = TokenizerPool(engine.engine.tokenizer, config.tokenizer_workers)
        tokenizers.start()
        return cls(
            engine=engine, config=config, tokenizers=tokenizers,
            max_model_len=int(engine.engine.max_model_len),
            metrics=ServerMetrics(config.model_name, prefix_cache_enabled=prefix_cache_enabled,
                                  max_waiting_requests=config.max_waiting_requests),
            tool_parser=get_tool_parser(config.tool_call_parser) if config.tool_call_parser else None,
            token_log=_token_log(config),
            max_token_chars=_max_token_chars(tokenizers.get()),
            responses=ResponseStore(config.max_stored_responses),
        )

    def check_text_fits(self, text: str, param: str) -> None:
        """Refuse, before tokenizing, a text too long for the context whatever its tokens are.

        No token covers more than ``max_token_chars`` characters, so a text longer than
        ``max_model_len * max_token_chars`` characters cannot fit; tokenizing megabytes only to
        find that out would hold a worker for seconds.
        """
        if self.max_token_chars and len(text) > self.max_model_len * self.max_token_chars:
            raise APIError(400, f"the prompt has {len(text)} characters; no token of this model covers more than "
                                f"{self.max_token_chars}, so it cannot fit in the context of "
                                f"{self.max_model_len} tokens", param=param, code="context_length_exceeded")

    def overload_headers(self, retry_after_s: float | None = None) -> dict[str, str]:
        """Retry-After: the predicted wait when there is one (whole seconds, at least 1), else the
        configured default."""
        if retry_after_s is not None:
            return {"Retry-After": str(max(1, math.ceil(retry_after_s)))}
        return {"Retry-After": str(self.config.retry_after_s)}

    @property
    def speculative(self) -> bool:
        """The engine speculates (responses carry ``usage.accepted_draft_tokens``)."""
        return self.engine.engine.spec is not None

    @property
    def tokenizer(self) -> Any:
        """This thread's tokenizer (safe to use from any thread, handlers and workers alike)."""
        return self.tokenizers.get()

    @property
    def vocab_limit(self) -> int:
        return len(self.tokenizer)

    def check_model(self, name: str | None) -> None:
        if name is not None and name not in self.config.served_model_names:
            raise APIError(404, f"the model {name!r} does not exist on this server; it serves "
                                f"{', '.join(repr(n) for n in self.config.served_model_names)}",
                           param="model", code="model_not_found")

    def token_text(self, token_id: int) -> tuple[str, list[int]]:
        """(decoded text, raw UTF-8 bytes) of one token, cached."""
        hit = self._token_text.get(token_id)
        if hit is None:
            text = self.tokenizer.decode([token_id])
            raw = _raw_token_bytes(self.tokenizer, token_id)
            hit = (text, list(raw if raw is not None else text.encode("utf-8")))
            self._token_text[token_id] = hit
        return hit


def _max_token_chars(tokenizer: Any) -> int:
    """Characters of the longest vocabulary entry (+1 for a decoder's joining space); 0 if unknown."""
    try:
        pieces = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
        longest = max((len(p) for p in pieces if isinstance(p, str)), default=0)
    except Exception:  # noqa: BLE001 - an odd tokenizer just skips the early check
        return 0
    return longest + 1 if longest else 0


_BYTE_DECODER: dict[str, int] | None = None


def _token_log(config: ServerConfig) -> Any:
    if config.log_token_ids is None:
        return None
    from tokenmill.server.token_log import TokenLog

    return TokenLog(config.log_token_ids, config.model_name)


def _raw_token_bytes(tokenizer: Any, token_id: int) -> bytes | None:
    """The token's own bytes for GPT-2 style byte-level BPE vocabularies (None if not one)."""
    global _BYTE_DECODER
    if _BYTE_DECODER is None:
        visible = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
        chars = list(visible)
        extra = 0
        for b in range(256):
            if b not in visible:
                visible.append(b)
                chars.append(256 + extra)
                extra += 1
        _BYTE_DECODER = {chr(c): b for b, c in zip(visible, chars)}
    piece = tokenizer.convert_ids_to_tokens(token_id)
    if not isinstance(piece, str) or any(ch not in _BYTE_DECODER for ch in piece):
        return None
    return bytes(_BYTE_DECODER[ch] for ch in piece)


# ---------------------------------------------------------------------------- request body
async def read_json_body(request: Request, max_bytes: int) -> dict[str, Any]:
    """Read, size-check, UTF-8-check and JSON-parse the body; it must be a JSON object.

    Behind :class:`~tokenmill.server.limits.BodyLimits` the size and depth are already checked and
    the parsed value waits in the scope; this reads the body itself only when it is not there.
    """
    if PARSED_BODY_KEY in request.scope:
        body = request.scope[PARSED_BODY_KEY]
        if not isinstance(body, dict):
            raise bad_request(f"request body must be a JSON object, got {type(body).__name__}", code="invalid_json")
        return body
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise APIError(413, f"request body of {declared} bytes exceeds the limit of {max_bytes} bytes",
                       code="request_too_large")
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise APIError(413, f"request body exceeds the limit of {max_bytes} bytes", code="request_too_large")
        chunks.append(chunk)
    raw = b"".join(chunks)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise bad_request(f"request body is not valid UTF-8 (byte {e.start}: {raw[e.start:e.start + 1]!r})",
                          code="invalid_encoding") from None
    try:
        body = json.loads(text)
    except json.JSONDecodeError as e:
        raise bad_request(f"request body is not valid JSON: {e.msg} at line {e.lineno} column {e.colno}",
                          code="invalid_json") from None
    if not isinstance(body, dict):
        raise bad_request(f"request body must be a JSON object, got {type(body).__name__}", code="invalid_json")
    return body


def parse_model(model_cls: type[SamplingFields], body: dict[str, Any]) -> Any:
    try:
        return model_cls.model_validate(body)
    except ValidationError as e:
        raise from_validation_error(e) from None


# ---------------------------------------------------------------------------- sampling
def sampling_params(req: SamplingFields, *, max_tokens: int, logprobs: int | None, choice: int,
                    structured: StructuredOutputs | None = None,
                    prompt_logprobs: int | None = None) -> SamplingParams:
    """Engine parameters of choice ``choice``; with a seed, choice i uses seed + i (distinct, repeatable)."""
    stop = [] if req.stop is None else ([req.stop] if isinstance(req.stop, str) else list(req.stop))
    try:
        return SamplingParams(
            max_tokens=max_tokens, temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p, top_k=req.top_k, min_p=req.min_p,
            seed=None if req.seed is None else req.seed + choice,
            presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty,
            repetition_penalty=req.repetition_penalty, stop=stop, stop_token_ids=list(req.stop_token_ids),
            ignore_eos=req.ignore_eos, logprobs=logprobs, structured=structured,
            prompt_logprobs=prompt_logprobs, speculative=req.speculative,
        )
    except ValueError as e:
        raise bad_request(str(e)) from None


def resolve_max_tokens(state: ServerState, prompt_len: int, requested: int | None, param: str,
                       prompt_param: str) -> int:
    """Tokens to generate: the request's value, or what is left of the context. 400 if it does not fit."""
    limit = state.max_model_len
    if prompt_len >= limit:
        raise context_error(prompt_len, None, limit, prompt_param)
    if requested is None:
        return limit - prompt_len
    if prompt_len + requested > limit:
        raise context_error(prompt_len, requested, limit, param)
    return requested


def check_token_ids(state: ServerState, ids: Sequence[int], param: str) -> None:
    limit = state.vocab_limit
    for t in ids:
        if not 0 <= t < limit:
            raise bad_request(f"token id {t} is outside the vocabulary [0, {limit})", param, code="invalid_token_id")


# ---------------------------------------------------------------------------- running requests
class ChoiceOutput(NamedTuple):
    index: int
    output: RequestOutput


class Generation:
    """The engine requests (one per choice) of one HTTP request, merged into one stream.

    ``start()`` submits them all (engine rejections raise here, before any response byte: 400 for
    bad input, 429 when the waiting queue is full); iterate to get :class:`ChoiceOutput` items in
    arrival order; ``close()`` aborts whatever has not finished. A choice that waited longer than
    ``max_queue_wait_s`` for its first step raises a 503 :class:`APIError`. Streaming handlers call
    ``wait_first()`` before sending headers, so those errors still get their own status code.
    Latency metrics are recorded as outputs arrive.

    Deadline: ``deadline_s`` (the request's extension field) or the server's
    ``request_deadline_s``, the smaller of the two, counted from ``arrival``. ``streamed``: the
    response is streamed, so the engine keeps its decodes' pace while others prefill
    (``--decode-slowdown``); a response sent whole leaves its steps to throughput.
    """

    def __init__(self, state: ServerState, request_id: str, prompts: list[list[int]],
                 params: list[SamplingParams], session_id: str | None, arrival: float,
                 deadline_s: float | None = None, *, streamed: bool) -> None:
        self.state = state
        self.request_id = request_id
        self.prompts = prompts
        self.params = params
        self.session_id = session_id
        self.streamed = streamed
        self.timers = [RequestTimer(state.metrics, arrival) for _ in prompts]
        cfg = state.config
        limits = [d for d in (deadline_s, cfg.request_deadline_s) if d is not None]
        self.deadline = arrival + min(limits) if limits else None
        self.queue_deadline = arrival + cfg.max_queue_wait_s if cfg.max_queue_wait_s is not None else None
        self._streams: list[Any] = []
        self._tasks: list[asyncio.Task[None]] = []
        self._iter: AsyncIterator[ChoiceOutput] | None = None
        self._first: ChoiceOutput | None = None

    async def start(self) -> None:
        try:
            for i, (prompt, params) in enumerate(zip(self.prompts, self.params)):
                stream = await self.state.engine.submit(f"{self.request_id}-{i}", prompt, params, self.session_id,
                                                        deadline=self.deadline, queue_deadline=self.queue_deadline,
                                                        streamed=self.streamed)
                self._streams.append(stream)
        except ValueError as e:
            await self.close()
            raise bad_request(str(e)) from None
        except QueueFullError as e:
            await self.close()
            self.state.metrics.rejected[e.reason] += 1
            raise APIError(429, str(e), type="rate_limit_error", code=e.reason,
                           headers=self.state.overload_headers(e.retry_after_s)) from None
        except EngineStoppedError as e:
            await self.close()
            raise APIError(503, str(e), type="server_error", code="shutting_down") from None
        except BaseException:
            await self.close()
            raise

    async def wait_first(self, request: Request) -> None:
        """Wait for the first output (or error) before a streamed response commits to 200.

        Raises what the first output raises (a 503 for a queue timeout), or :class:`ClientGone`
        if the client disconnects meanwhile; in both cases the generation is closed.
        """
        self._iter = self._items()
        nxt = asyncio.ensure_future(self._iter.__anext__())
        watcher = asyncio.create_task(_wait_disconnect(request))
        try:
            done, _ = await asyncio.wait({nxt, watcher}, return_when=asyncio.FIRST_COMPLETED)
            if nxt not in done:
                nxt.cancel()
                logger.info("request %s: client disconnected before its first token, aborting", self.request_id)
                raise ClientGone()
            try:
                self._first = nxt.result()
            except StopAsyncIteration:
                self._first = None
        except BaseException:
            await self.close()
            raise
        finally:
            watcher.cancel()

    async def __aiter__(self) -> AsyncIterator[ChoiceOutput]:
        if self._iter is None:
            self._iter = self._items()
        elif self._first is not None:
            first, self._first = self._first, None
            yield first
        async for item in self._iter:
            yield item

    async def _items(self) -> AsyncIterator[ChoiceOutput]:
        if len(self._streams) == 1:
            async for out in self._streams[0]:
                self._observe(0, out)
                yield ChoiceOutput(0, out)
            return
        merged: asyncio.Queue[ChoiceOutput | BaseException | None] = asyncio.Queue()

        async def pump(i: int, stream: Any) -> None:
            try:
                async for out in stream:
                    merged.put_nowait(ChoiceOutput(i, out))
            except Exception as e:  # noqa: BLE001 - handed to the consumer
                merged.put_nowait(e)
            merged.put_nowait(None)

        self._tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(self._streams)]
        remaining = len(self._tasks)
        while remaining:
            item = await merged.get()
            if item is None:
                remaining -= 1
                continue
            if isinstance(item, BaseException):
                raise item
            self._observe(item.index, item.output)
            yield item

    def _observe(self, i: int, out: RequestOutput) -> None:
        now = time.monotonic()
        self.timers[i].on_tokens(len(out.new_token_ids), now)
        if out.finished:
            self.timers[i].on_finish(out.finish_reason, now)
            if self.state.token_log is not None:
                self.state.token_log.write(out.request_id, self.prompts[i], out.token_ids,
                                           out.finish_reason, self.params[i])
            if self.state.config.log_requests:
                logger.info("request %s-%d prompt=%r output=%r finish=%s", self.request_id, i,
                            self.state.tokenizer.decode(self.prompts[i]), out.text, out.finish_reason)
            if out.finish_reason == QUEUE_TIMEOUT:
                self.state.metrics.rejected["queue_timeout"] += 1
                wait = self.state.config.max_queue_wait_s
                raise APIError(503, f"the server is overloaded: the request waited more than {wait} s "
                                    "(--max-queue-wait-s) without starting; retry later",
                               type="server_error", code="queue_timeout", headers=self.state.overload_headers())

    async def close(self) -> None:
        for t in self._tasks:
            t.cancel()
        for s in self._streams:
            if not s.finished and not s.closed:
                self.state.metrics.finished["abort"] += 1
            await s.aclose()


async def _wait_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def collect(gen: Generation, request: Request) -> list[RequestOutput]:
    """Run a non-streamed generation to the end; abort it if the client disconnects meanwhile."""
    finals: list[RequestOutput | None] = [None] * len(gen.prompts)

    async def consume() -> None:
        async for item in gen:
            if item.output.finished:
                finals[item.index] = item.output

    work = asyncio.create_task(consume())
    watcher = asyncio.create_task(_wait_disconnect(request))
    try:
        done, _ = await asyncio.wait({work, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if work not in done:
            logger.info("request %s: client disconnected, aborting", gen.request_id)
            work.cancel()
            raise ClientGone()
        work.result()
    except EngineStepError as e:
        raise APIError(500, str(e), type="server_error", code="engine_error") from None
    finally:
        watcher.cancel()
        await gen.close()
    return [f for f in finals if f is not None]


class ClientGone(Exception):
    """The client went away before the response was ready."""


# ---------------------------------------------------------------------------- formatting
def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int,
          tiers: list[dict[str, int] | None] | None = None,
          accepted_draft_tokens: int | None = None) -> dict[str, Any]:
    """OpenAI usage; ``tiers`` (one split per prompt) adds the extension field
    ``prompt_tokens_details.cached_tokens_by_tier`` = {"l1", "l2", "l3"}, summing to cached_tokens;
    ``accepted_draft_tokens`` (extension) is given when the engine speculates."""
    details: dict[str, Any] = {"cached_tokens": cached_tokens}
    if tiers:
        split = {"l1": 0, "l2": 0, "l3": 0}
        for t in tiers:
            for k, v in (t or {}).items():
                split[k] = split.get(k, 0) + v
        details["cached_tokens_by_tier"] = split
    out: dict[str, Any] = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                           "total_tokens": prompt_tokens + completion_tokens, "prompt_tokens_details": details}
    if accepted_draft_tokens is not None:
        out["accepted_draft_tokens"] = accepted_draft_tokens
    return out


def _lp(v: float) -> float:
    return max(float(v), LOGPROB_FLOOR) if v == v else LOGPROB_FLOOR


def chat_logprobs(state: ServerState, entries: Sequence[TokenLogprob], top_n: int) -> list[dict[str, Any]]:
    out = []
    for e in entries:
        text, raw = state.token_text(e.token_id)
        tops = []
        for t in e.top_logprobs[:top_n]:
            ttext, traw = state.token_text(t.token_id)
            tops.append({"token": ttext, "logprob": _lp(t.logprob), "bytes": traw})
        out.append({"token": text, "logprob": _lp(e.logprob), "bytes": raw, "top_logprobs": tops})
    return out


def prompt_logprobs_json(state: ServerState, entries: Sequence[TokenLogprob | None] | None) -> list[Any] | None:
    """``prompt_logprobs`` extension: per prompt token, None (the first) or its logprob and top-N."""
    if entries is None:
        return None
    out: list[Any] = []
    for e in entries:
        if e is None:
            out.append(None)
            continue
        out.append({"token_id": e.token_id, "token": state.token_text(e.token_id)[0], "logprob": _lp(e.logprob),
                    "top_logprobs": [{"token_id": t.token_id, "token": state.token_text(t.token_id)[0],
                                      "logprob": _lp(t.logprob)} for t in e.top_logprobs]})
    return out


def completion_logprobs(state: ServerState, entries: Sequence[TokenLogprob], top_n: int,
                        text_offset: int, *, prompt: Sequence[TokenLogprob | None] | None = None,
                        first_prompt_token: int | None = None) -> dict[str, Any]:
    """Legacy completions logprobs; with ``prompt`` (echo), the prompt tokens come first (the
    first one with a null logprob, ``first_prompt_token`` being its id)."""
    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    top: list[dict[str, float] | None] = []
    offsets: list[int] = []
    pos = text_offset
    if prompt is not None:
        for k, e in enumerate(prompt):
            tid = e.token_id if e is not None else first_prompt_token
            text = state.token_text(tid)[0] if tid is not None else ""
            tokens.append(text)
            offsets.append(pos)
            pos += len(text)
            if e is None or k == 0:
                token_logprobs.append(None)
                top.append(None)
            else:
                token_logprobs.append(_lp(e.logprob))
                top.append({state.token_text(t.token_id)[0]: _lp(t.logprob) for t in e.top_logprobs[:top_n]} or None)
    for e in entries:
        text, _ = state.token_text(e.token_id)
        tokens.append(text)
        token_logprobs.append(_lp(e.logprob))
        top.append({state.token_text(t.token_id)[0]: _lp(t.logprob) for t in e.top_logprobs[:top_n]} or None)
        offsets.append(pos)
        pos += len(text)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets}


def sse(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


SSE_DONE = "data: [DONE]\n\n"


def sse_error(err: APIError) -> str:
    return sse(err.body())


def log_finished(kind: str, request_id: str, session_id: str | None, prompt_tokens: int, cached: int,
                 completion_tokens: int, arrival: float, reasons: Sequence[str | None]) -> None:
    logger.info("%s %s session=%s prompt=%d cached=%d completion=%d finish=%s latency=%.3fs", kind, request_id,
                session_id or "-", prompt_tokens, cached, completion_tokens, ",".join(str(r) for r in reasons),
                time.monotonic() - arrival)
