"""The HTTP app: routes, API-key check, session-id echo and OpenAI-style error bodies.

Routes (see docs/server.md):
    POST /v1/chat/completions, POST /v1/completions, GET /v1/models,
    POST /v1/messages, POST /v1/messages/count_tokens (Anthropic Messages API),
    POST /v1/responses, GET /v1/responses/{id} (OpenAI Responses API),
    GET /health, GET /metrics, GET /v1/loads, POST /flush_cache (L1 + L2),
    POST /flush_cache/storage (this model's L3 pages), GET /openapi.json

Every error leaves as ``{"error": {"message", "type", "param", "code"}}`` with a 4xx/5xx status
(``{"type": "error", "error": {"type", "message"}}`` on the Anthropic routes); no client input
can stop the server. The API key is accepted as ``Authorization: Bearer`` or ``x-api-key``.
Handlers never call the engine directly: they go through
the :class:`~tokenmill.engine.async_engine.AsyncEngine` in ``ServerState``.

Keys: with ``api_key`` every route but ``/health`` needs ``Authorization: Bearer <api key>``;
with ``admin_key`` the state-changing ``/flush_cache`` and ``/flush_cache/storage`` need the admin
key instead. Both are
compared in constant time. Body size and JSON depth are enforced by
:class:`~tokenmill.server.limits.BodyLimits` before any route runs.
"""
from __future__ import annotations

import hmac
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from tokenmill.engine.admission import wait_too_long
from tokenmill.server import openapi
from tokenmill.server.common import ServerState, read_json_body
from tokenmill.server.errors import APIError
from tokenmill.server.limits import BodyLimits, openai_error_body
from tokenmill.server.metrics import CONTENT_TYPE
from tokenmill.server.serving_chat import create_chat_completion
from tokenmill.server.protocol_anthropic import anthropic_error_body
from tokenmill.server.serving_completions import create_completion
from tokenmill.server.serving_messages import count_tokens, create_message
from tokenmill.server.serving_responses import create_response, delete_response, retrieve_response
from tokenmill.session import RESPONSE_HEADER, extract_session_id, header_safe

logger = logging.getLogger("tokenmill.server")

Handler = Callable[[ServerState, Request, dict[str, Any], "str | None", float], Awaitable[Any]]


def build_app(state: ServerState) -> FastAPI:
    """The FastAPI app over a running AsyncEngine. Shutting the app down stops the engine."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        logger.info("stopping the engine")
        state.engine.shutdown()
        state.tokenizers.shutdown()

    app = FastAPI(title="tokenmill", lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None)
    app.state.tokenmill = state
    openapi.install(app)

    def on_limit(status: int, code: str) -> None:
        state.metrics.rejected[code] += 1
        state.metrics.http_errors[status] += 1
        logger.info("client error %d: %s", status, code)

    app.add_middleware(BodyLimits, max_bytes=state.config.max_request_bytes,  # type: ignore[arg-type]
                       max_depth=state.config.max_json_depth, on_reject=on_limit, error_body=limit_error_body)

    def check_auth(request: Request, *, admin: bool = False) -> None:
        key = state.config.admin_key if admin and state.config.admin_key is not None else state.config.api_key
        if key is None:
            return
        given = request.headers.get("authorization", "")
        scheme, _, token = given.partition(" ")
        what = "admin key" if admin and state.config.admin_key is not None else "API key"
        if scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), key.encode()):
            return
        other = request.headers.get("x-api-key")
        if other is not None and hmac.compare_digest(other.strip().encode(), key.encode()):
            return
        raise APIError(401, f"invalid or missing {what}: send 'Authorization: Bearer <key>' or 'x-api-key: <key>'",
                       type="authentication_error", code="invalid_api_key")

    def check_queue_room() -> None:
        """429 before reading the body when the engine's queue is already full (a fast path:
        the engine's own check on submit is the authoritative one)."""
        limit = state.config.max_waiting_requests
        stats = state.engine.stats()
        if limit is not None and stats.num_waiting >= limit:
            state.metrics.rejected["queue_full"] += 1
            raise APIError(429, f"the server is overloaded: {limit} requests are already waiting; retry later",
                           type="rate_limit_error", code="queue_full", headers=state.overload_headers())
        wait_limit = state.config.max_queue_wait_s
        if wait_too_long(stats.predicted_wait_s, wait_limit):
            state.metrics.rejected["predicted_wait"] += 1
            raise APIError(429, f"the server is overloaded: a new request could wait up to "
                                f"{stats.predicted_wait_s:.1f} s to start (limit {wait_limit:g} s); retry later",
                           type="rate_limit_error", code="predicted_wait",
                           headers=state.overload_headers(stats.predicted_wait_s))

    async def run_generation(request: Request, handler: Handler, *, anthropic: bool = False) -> Response:
        arrival = time.monotonic()
        session_id: str | None = extract_session_id(request.headers)
        try:
            check_auth(request)
            check_queue_room()
            body = await read_json_body(request, state.config.max_request_bytes)
            session_id = extract_session_id(request.headers, body)
            response: Response = await handler(state, request, body, session_id, arrival)
        except APIError as e:
            return _error_response(state, e, session_id, anthropic=anthropic)
        except Exception as e:  # noqa: BLE001 - a bug must cost one request, never the server
            logger.exception("unexpected error on %s", request.url.path)
            return _error_response(state, APIError(500, f"internal server error: {type(e).__name__}: {e}",
                                                   type="server_error", code="internal_error"), session_id,
                                   anthropic=anthropic)
        if header_safe(session_id):
            response.headers[RESPONSE_HEADER] = session_id  # type: ignore[assignment]
        return response

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await run_generation(request, create_chat_completion)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await run_generation(request, create_completion)

    @app.post("/v1/messages")
    async def messages(request: Request) -> Response:
        return await run_generation(request, create_message, anthropic=True)

    @app.post("/v1/messages/count_tokens")
    async def messages_count_tokens(request: Request) -> Response:
        return await run_generation(request, count_tokens, anthropic=True)

    @app.post("/v1/responses")
    async def responses(request: Request) -> Response:
        return await run_generation(request, create_response)

    @app.get("/v1/responses/{response_id}")
    async def get_response(request: Request, response_id: str) -> Response:
        check_auth(request)
        return await retrieve_response(state, response_id)

    @app.delete("/v1/responses/{response_id}")
    async def remove_response(request: Request, response_id: str) -> Response:
        check_auth(request)
        return await delete_response(state, response_id)

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        check_auth(request)
        created = int(time.time())
        data = [{"id": name, "object": "model", "created": created, "owned_by": "tokenmill",
                 "max_model_len": state.max_model_len} for name in state.config.served_model_names]
        return JSONResponse({"object": "list", "data": data})

    @app.get("/health")
    async def health() -> Response:
        if state.engine.is_running:
            return JSONResponse({"status": "ok"})
        return JSONResponse({"status": "engine stopped"}, status_code=503)

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        check_auth(request)
        return PlainTextResponse(state.metrics.render(state.engine.stats()), media_type=CONTENT_TYPE)

    @app.get("/openapi.json")
    async def openapi_json(request: Request) -> Response:
        check_auth(request)
        return JSONResponse(app.openapi())

    @app.get("/v1/loads")
    async def loads(request: Request) -> Response:
        check_auth(request)
        s = state.engine.stats()
        return JSONResponse({
            "model": state.config.model_name, "num_running": s.num_running, "num_waiting": s.num_waiting,
            "kv_cache_usage": s.kv_cache_usage, "kv_pages_total": s.kv_pages_total,
            "kv_pages_free": s.kv_pages_free, "kv_pages_cached": s.kv_pages_cached,
            "kv_pages_in_use": s.kv_pages_in_use,
            "kv_cache_dtype": s.kv_cache_dtype, "kv_cache_fp8_scales": s.kv_cache_fp8_scales,
            "kv_bytes_per_token": s.kv_bytes_per_token,
            "kv_capacity_tokens": s.kv_capacity_tokens,
            # hybrid models' state pool (zeros for attention-only models): request slots
            "state_pool_usage": s.state_pool_usage, "state_slots_total": s.state_slots_total,
            "state_slots_free": s.state_slots_free, "state_snapshot_slots": s.state_snapshot_slots,
            "state_snapshots_cached": s.state_snapshots_cached,
            "state_bytes_per_request": s.state_bytes_per_request,
            "cached_tokens": s.cached_tokens_total,
            "prompt_tokens": s.prompt_tokens_total, "generation_tokens": s.generation_tokens_total,
        })

    @app.post("/flush_cache")
    async def flush_cache(request: Request) -> Response:
        check_auth(request, admin=True)
        if not await state.engine.flush_cache():
            raise APIError(409, "the prefix cache was not flushed: requests are running", code="engine_busy")
        return JSONResponse({"flushed": True})

    @app.post("/flush_cache/storage")
    async def flush_storage_cache(request: Request) -> Response:
        """Admin: delete the pages this model wrote to the L3 storage tier (shared by replicas)."""
        check_auth(request, admin=True)
        if state.engine.stats().tiers is None:
            raise APIError(409, "this server has no cache storage tier (--cache-storage none)",
                           code="no_storage_tier")
        try:
            deleted = await state.engine.call(lambda e: e.flush_storage_cache())
        except Exception as e:  # noqa: BLE001 - a storage failure is the backend's, not the server's
            raise APIError(503, f"flushing the storage tier failed: {e}", type="server_error",
                           code="storage_unavailable") from None
        return JSONResponse({"flushed": True, "pages_deleted": deleted})

    @app.exception_handler(APIError)
    async def on_api_error(request: Request, exc: APIError) -> Response:
        return _error_response(state, exc, None)

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request: Request, exc: StarletteHTTPException) -> Response:
        kind = "not_found" if exc.status_code == 404 else "method_not_allowed" if exc.status_code == 405 else None
        return _error_response(state, APIError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}",
                                               code=kind), None)

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(request: Request, exc: RequestValidationError) -> Response:
        return _error_response(state, APIError(400, f"invalid request: {exc.errors()[:1]}"), None)

    @app.exception_handler(Exception)
    async def on_unexpected(request: Request, exc: Exception) -> Response:
        logger.exception("unexpected error on %s %s", request.method, request.url.path)
        return _error_response(state, APIError(500, f"internal server error: {type(exc).__name__}: {exc}",
                                               type="server_error", code="internal_error"), None)

    return app


def limit_error_body(path: str, status: int, message: str, code: str) -> dict[str, Any]:
    """Body of a size / depth refusal in the shape of the API the path belongs to."""
    if path.startswith("/v1/messages"):   # Anthropic Messages API
        kind = "request_too_large" if status == 413 else "invalid_request_error"
        return {"type": "error", "error": {"type": kind, "message": message}}
    return openai_error_body(path, status, message, code)


def _error_response(state: ServerState, err: APIError, session_id: str | None, *,
                    anthropic: bool = False) -> Response:
    state.metrics.http_errors[err.status_code] += 1
    if err.status_code >= 500 and err.code not in ("queue_timeout", "shutting_down"):
        logger.error("error %d: %s", err.status_code, err.message)
    elif state.config.log_requests:
        logger.info("client error %d: %s", err.status_code, err.message)
    else:   # the message may quote the request: only its kind unless requests are logged
        logger.info("client error %d: code=%s param=%s", err.status_code, err.code, err.param)
    headers = {RESPONSE_HEADER: session_id} if header_safe(session_id) else None
    if err.status_code == 401:
        headers = {**(headers or {}), "WWW-Authenticate": "Bearer"}
    if anthropic:
        return JSONResponse(anthropic_error_body(err), status_code=err.status_code, headers=headers)
    return err.response(headers)
