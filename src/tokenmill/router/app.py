"""The router's HTTP proxy: OpenAI-compatible in front, any number of replicas behind.

One request, end to end::

    POST /v1/chat/completions -> parse JSON (400 if not an object) -> session id
      (tokenmill.session.extract_session_id) + prefix text -> policy.choose(meta, views)
      -> send upstream (streamed) --connect error / 5xx before any byte--> choose again with
         the failed replica excluded (once) -> response headers + X-Tokenmill-Replica
      -> stream: chunks are forwarded as they arrive; a failure mid-stream becomes an SSE
         ``error`` event; non-stream: the body is read, then returned (502 if it breaks off)
      -> finally: registry.request_finished + policy.on_finish (exactly once per attempt)

The same path serves ``POST /v1/messages`` (Anthropic) and ``POST /v1/responses``. A Responses
request without a session id gets one from the router: a new one for a fresh conversation, or
the one of the response named in ``previous_response_id`` (the router remembers which session
each response id it relayed came from, bounded), so a conversation stays on the replica that
stores it. ``GET``/``DELETE /v1/responses/{id}`` go to the replica that produced ``id``.

Everything runs on one event loop; the registry and the policy are touched only there.
"""
from __future__ import annotations

import asyncio
import hmac
import json
import logging
import re
import time
import uuid
from collections import Counter, OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from tokenmill.router.discovery import Discovery
from tokenmill.router.metrics import CONTENT_TYPE, RouterCollector, RouterStats, make_registry, render
from tokenmill.router.policies import (
    DEFAULT_POLICY, NoReplicaAvailable, Policy, RequestMeta, make_policy,
)
from tokenmill.router.replicas import HealthConfig, ReplicaMonitor, ReplicaRegistry
from tokenmill.server.limits import PARSED_BODY_KEY, BodyLimits
from tokenmill.session import extract_session_id

log = logging.getLogger("tokenmill.router")
T = TypeVar("T")

REPLICA_HEADER = "X-Tokenmill-Replica"
DECISION_HEADER = "X-Tokenmill-Decision"
_HOP_BY_HOP = {"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer",
               "transfer-encoding", "upgrade", "host", "content-length", "accept-encoding"}


@dataclass
class RouterConfig:
    """Everything ``tokenmill route`` needs; validated on construction."""

    replicas: list[str] = field(default_factory=list)
    replica_file: str | None = None
    replica_dns: list[str] = field(default_factory=list)
    policy: str = DEFAULT_POLICY
    policy_options: dict[str, Any] = field(default_factory=dict)
    admin_key: str | None = None
    health: HealthConfig = field(default_factory=HealthConfig)
    discovery_interval_s: float = 2.0
    connect_timeout_s: float = 5.0
    request_timeout_s: float = 3600.0
    api_key: str | None = None                   # clients must send it (all routes but /health)
    replica_api_key: str | None = None           # sent to the replicas instead of the client's header
    replica_admin_key: str | None = None         # sent with /flush_cache fan-out (else replica_api_key)
    max_inflight: int | None = None              # fleet-wide bound; past it 429
    max_inflight_per_replica: int | None = None  # per-replica bound; a full replica is skipped, all full: 429
    max_attempts: int = 3                        # replicas tried per request before giving up
    retry_after_s: int = 1
    max_request_bytes: int = 32 * 2**20
    max_json_depth: int = 64

    def __post_init__(self) -> None:
        if not (self.replicas or self.replica_file or self.replica_dns or self.admin_key):
            raise ValueError("no replicas: give --replica, --replica-file or --replica-dns "
                             "(or --admin-key to add them later through POST /replicas)")
        if self.connect_timeout_s <= 0 or self.request_timeout_s <= 0:
            raise ValueError("timeouts must be > 0")
        make_policy(self.policy, **self.policy_options)   # raises ValueError on a bad policy
        for name in ("max_inflight", "max_inflight_per_replica"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if self.max_attempts < 1:
            raise ValueError(f"max_attempts must be >= 1, got {self.max_attempts}")
        for name in ("api_key", "admin_key", "replica_api_key", "replica_admin_key"):
            if getattr(self, name) == "":
                raise ValueError(f"{name} must not be empty")


def openai_error(status: int, message: str, kind: str = "invalid_request_error",
                 headers: dict[str, str] | None = None, code: str | int | None = None) -> JSONResponse:
    body = {"error": {"message": message, "type": kind, "param": None, "code": status if code is None else code}}
    return JSONResponse(body, status_code=status, headers=headers)


async def _unless_down(work: Awaitable[T], down: asyncio.Event) -> T:
    """Await ``work``, or raise :class:`_Ejected` (cancelling it) if ``down`` is set first."""
    task = asyncio.ensure_future(work)
    if down.is_set():
        task.cancel()
        raise _Ejected()
    waiter = asyncio.ensure_future(down.wait())
    try:
        await asyncio.wait({task, waiter}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        waiter.cancel()
    if not task.done():
        task.cancel()
        raise _Ejected()
    return task.result()


async def _read_all(upstream: httpx.Response) -> bytes:
    return b"".join([chunk async for chunk in upstream.aiter_raw()])


def _content_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):   # content parts
        return "".join(p.get("text", "") if isinstance(p, dict) else str(p) for p in content)
    return "" if content is None else json.dumps(content, sort_keys=True)


def prompt_prefix_key(path: str, body: dict[str, Any]) -> str | list[int] | None:
    """Text (or token ids) whose leading chunks identify the prompt: tools, then each message.

    Appending a message keeps the earlier text a prefix, so turns of one conversation match.
    """
    if path.endswith("/chat/completions") or path.endswith("/messages"):
        parts = []
        if body.get("tools"):
            parts.append(json.dumps(body["tools"], sort_keys=True))
        if body.get("system"):          # Anthropic Messages
            parts.append(f"<system>{_content_text(body['system'])}")
        for m in body.get("messages") or []:
            if isinstance(m, dict):
                parts.append(f"<{m.get('role', '')}>{_content_text(m.get('content'))}")
        return "\n".join(parts) or None
    if path.endswith("/responses"):
        parts = []
        if body.get("tools"):
            parts.append(json.dumps(body["tools"], sort_keys=True))
        if body.get("instructions"):
            parts.append(f"<system>{_content_text(body['instructions'])}")
        items = body.get("input")
        for m in [{"role": "user", "content": items}] if isinstance(items, str) else items or []:
            if isinstance(m, dict):
                parts.append(f"<{m.get('role', m.get('type', ''))}>{_content_text(m.get('content', m.get('output')))}")
        return "\n".join(parts) or None
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and not all(isinstance(t, int) for t in prompt):
        prompt = prompt[0]          # a batch of prompts: the first one stands for all
    if isinstance(prompt, str) and prompt:
        return prompt
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return prompt
    return None


def _estimate_tokens(key: str | list[int] | None) -> int | None:
    if key is None:
        return None
    return len(key) if isinstance(key, list) else max(1, len(key) // 4)


_RESPONSE_ID = re.compile(rb'"id"\s*:\s*"(resp_[A-Za-z0-9_-]+)"')


class _UsageSniffer:
    """Finds the last ``usage`` object in an SSE stream or JSON body, without buffering it, and
    the first Responses API id (``resp_...``) in it."""

    def __init__(self) -> None:
        self.usage: dict[str, Any] | None = None
        self.response_id: str | None = None
        self._tail = b""

    def feed(self, chunk: bytes) -> None:
        data = self._tail + chunk
        lines = data.split(b"\n")
        self._tail = lines.pop()[-65536:]
        for line in lines:
            if line.startswith(b"data:"):
                self._find_id(line)
                if b'"usage"' in line:
                    self._take(line[5:])

    def feed_body(self, body: bytes) -> None:
        self._find_id(body)
        self._take(body)

    def _find_id(self, raw: bytes) -> None:
        if self.response_id is None and b"resp_" in raw:
            m = _RESPONSE_ID.search(raw)
            if m is not None:
                self.response_id = m.group(1).decode()

    def _take(self, raw: bytes) -> None:
        try:
            obj = json.loads(raw)
            usage = obj.get("usage")
            if usage is None and isinstance(obj.get("response"), dict):   # Responses API events
                usage = obj["response"].get("usage")
        except (ValueError, AttributeError):
            return
        if isinstance(usage, dict):
            self.usage = usage


class _ProxyStream(StreamingResponse):
    """A streaming response that always runs ``on_close`` (even if the client left early)."""

    def __init__(self, content: AsyncIterator[bytes], on_close: Callable[[], Awaitable[None]], **kw: Any) -> None:
        super().__init__(content, **kw)
        self._on_close = on_close

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._on_close()


class _Ejected(Exception):
    """The replica went down (unhealthy or circuit opened) while this attempt was on it."""


class Router:
    """Registry + policy + HTTP client; one per process."""

    def __init__(self, config: RouterConfig) -> None:
        self.config = config
        self.policy: Policy = make_policy(config.policy, **config.policy_options)
        self.registry = ReplicaRegistry(config.health)
        self.registry.on_down = self._replica_down
        for url in config.replicas:
            self.registry.add(url, source="flag")
        self.discovery = Discovery(self.registry, config.replica_file, tuple(config.replica_dns),
                                   config.discovery_interval_s)
        self.client: httpx.AsyncClient | None = None
        self.monitor: ReplicaMonitor | None = None
        self.stats = RouterStats()
        # Responses API: response id -> (replica id, routing session id), most recent last
        self.response_homes: OrderedDict[str, tuple[str, str | None]] = OrderedDict()
        self.max_response_homes = 100_000
        self._down_events: dict[str, asyncio.Event] = {}   # replica id -> set when it goes down
        sessions = getattr(self.policy, "sessions_per_replica", lambda: {})
        self.metrics_registry = make_registry(RouterCollector(self.stats, self.registry, self.policy, sessions))

    # counters kept under their old names for callers and tests
    @property
    def retries(self) -> int:
        return self.stats.retries

    @property
    def requests(self) -> Counter[tuple[str, int]]:
        return self.stats.requests

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        timeout = httpx.Timeout(self.config.request_timeout_s, connect=self.config.connect_timeout_s)
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=256)
        self.client = httpx.AsyncClient(timeout=timeout, limits=limits)
        self.monitor = ReplicaMonitor(self.registry, self.client, self._replica_auth(admin=False))
        await self.discovery.start()
        await self.monitor.check_all()
        self.monitor.start()

    async def stop(self) -> None:
        await self.discovery.stop()
        if self.monitor is not None:
            await self.monitor.stop()
        if self.client is not None:
            await self.client.aclose()

    def _replica_auth(self, *, admin: bool) -> dict[str, str]:
        key = (self.config.replica_admin_key or self.config.replica_api_key) if admin else self.config.replica_api_key
        return {"authorization": f"Bearer {key}"} if key else {}

    def _replica_down(self, replica_id: str) -> None:
        """Registry hook: wake every attempt in flight on the replica (they move or end)."""
        event = self._down_events.pop(replica_id, None)
        if event is not None:
            event.set()
        self.stats.ejections[replica_id] += 1

    def _request_result(self, replica_id: str, ok: bool, reason: str = "") -> None:
        if self.registry.record_request_result(replica_id, ok, reason):
            self.stats.ejections[replica_id] += 1

    def _down_event(self, replica_id: str) -> asyncio.Event:
        event = self._down_events.get(replica_id)
        if event is None:
            event = self._down_events[replica_id] = asyncio.Event()
        return event

    # ------------------------------------------------------------------ proxying
    def _finish_attempt(self, meta: RequestMeta, replica_id: str, usage: dict[str, Any] | None = None) -> None:
        self.registry.request_finished(replica_id)
        output_tokens = 0
        if usage:
            prompt = usage.get("prompt_tokens", usage.get("input_tokens"))
            if isinstance(prompt, int):
                if isinstance(usage.get("cache_read_input_tokens"), int):   # Anthropic: input excludes hits
                    prompt += usage["cache_read_input_tokens"]
                meta.prompt_tokens = prompt
            completion = usage.get("completion_tokens", usage.get("output_tokens"))
            if isinstance(completion, int):
                output_tokens = completion
        self.policy.on_finish(meta, replica_id, output_tokens=output_tokens, now=time.monotonic())

    def remember_response(self, response_id: str, replica_id: str, session_id: str | None) -> None:
        self.response_homes[response_id] = (replica_id, session_id)
        self.response_homes.move_to_end(response_id)
        while len(self.response_homes) > self.max_response_homes:
            self.response_homes.popitem(last=False)

    def _overloaded(self, reason: str, message: str) -> Response:
        self.stats.rejected[reason] += 1
        return openai_error(429, message, "rate_limit_error", {"Retry-After": str(self.config.retry_after_s)},
                            code=reason)

    def _full_replicas(self) -> list[str]:
        cap = self.config.max_inflight_per_replica
        return [r.id for r in self.registry.all() if cap is not None and r.inflight >= cap]

    async def forward(self, request: Request, method: str, path: str, raw_body: bytes,
                      meta: RequestMeta | None, stream: bool, *, prefer: str | None = None) -> Response:
        """Send to the policy's choice; on a connect error, a 5xx, a 429 or the replica going down
        before the first byte reached the client, try another (up to ``max_attempts`` in all).

        ``meta`` None: not a routed generation request (e.g. /v1/models); the replica ``prefer``
        (if given and eligible) or else the least busy one answers, and the policy is not consulted.
        """
        assert self.client is not None
        if meta is not None and self.config.max_inflight is not None:
            total = sum(r.inflight for r in self.registry.all())
            if total >= self.config.max_inflight:
                return self._overloaded("fleet_full", f"the fleet is at its limit of {self.config.max_inflight} "
                                                      "requests in flight (--max-inflight); retry later")
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP_BY_HOP}
        headers.update(self._replica_auth(admin=False))
        if request.client is not None:
            headers["x-forwarded-for"] = request.client.host
        tried: list[str] = []
        failure: Response | None = None
        for attempt in range(self.config.max_attempts):
            full = self._full_replicas()
            try:
                if meta is not None:
                    decision = self.policy.choose(meta, self.registry.views(), exclude=[*tried, *full])
                    rid, kind = decision.replica_id, decision.kind
                else:
                    views = [v for v in self.registry.views() if v.eligible and v.id not in tried]
                    if not views:
                        raise NoReplicaAvailable("no healthy replica")
                    home = [v for v in views if v.id == prefer]
                    if home:
                        rid, kind = home[0].id, "home"
                    else:
                        home = [v for v in views if v.id == prefer]
                    if home:
                        rid, kind = home[0].id, "home"
                    else:
                        rid, kind = min(views, key=lambda v: (v.active, v.id)).id, "least_load"
            except NoReplicaAvailable as e:
                if failure is not None:
                    return failure
                if full and any(v.eligible and v.id not in tried for v in self.registry.views()):
                    return self._overloaded("replicas_full", "every healthy replica is at its limit of "
                                            f"{self.config.max_inflight_per_replica} requests in flight "
                                            "(--max-inflight-per-replica); retry later")
                return openai_error(503, f"no replica available: {e}", "service_unavailable",
                                    {"Retry-After": str(self.config.retry_after_s)})
            if attempt:
                self.stats.retries += 1
            replica = self.registry.get(rid)
            assert replica is not None
            self.registry.request_started(rid)
            down = self._down_event(rid)

            def failed(response: Response, reason: str, *, breaker: bool = True) -> None:
                nonlocal failure
                self.stats.upstream_errors[reason] += 1
                if breaker:
                    self._request_result(rid, False, reason)
                if meta is not None:
                    self._finish_attempt(meta, rid)
                else:
                    self.registry.request_finished(rid)
                tried.append(rid)
                failure = response

            upstream_req = self.client.build_request(method, replica.url + path, content=raw_body or None,
                                                     headers=headers)
            try:
                upstream = await _unless_down(self.client.send(upstream_req, stream=True), down)
            except _Ejected:
                failed(openai_error(502, f"replica {rid} went down before answering", "upstream_error",
                                    {REPLICA_HEADER: rid}), "replica_down", breaker=False)
                continue
            except httpx.HTTPError as e:
                reason = type(e).__name__
                if isinstance(e, (httpx.ConnectError, httpx.ConnectTimeout)):
                    self.registry.record_failure(rid, f"{reason}: {e}")
                failed(openai_error(502, f"replica {rid} failed: {reason}: {e}", "upstream_error",
                                    {REPLICA_HEADER: rid}), reason)
                continue
            if upstream.status_code >= 500 or upstream.status_code == 429:
                try:
                    body = await _unless_down(upstream.aread(), down)
                except (_Ejected, httpx.HTTPError):
                    body = b""
                await upstream.aclose()
                # 429, or 503 with Retry-After: the replica is overloaded, not broken
                overload = upstream.status_code == 429 or (upstream.status_code == 503
                                                           and "retry-after" in upstream.headers)
                if overload:
                    self.stats.rejected[f"replica_{upstream.status_code}"] += 1
                failed(Response(body, status_code=upstream.status_code,
                                headers={**self._response_headers(upstream), REPLICA_HEADER: rid}),
                       f"http_{upstream.status_code}", breaker=not overload)
                continue
            relayed = await self._relay(upstream, rid, kind, meta, stream, down)
            if relayed is None:   # the replica went down before the body was read: try elsewhere
                self.stats.upstream_errors["replica_down"] += 1
                tried.append(rid)
                failure = openai_error(502, f"replica {rid} went down mid-response", "upstream_error",
                                       {REPLICA_HEADER: rid})
                continue
            return relayed
        assert failure is not None
        return failure

    @staticmethod
    def _response_headers(upstream: httpx.Response) -> dict[str, str]:
        return {k: v for k, v in upstream.headers.items() if k.lower() not in _HOP_BY_HOP}

    async def _relay(self, upstream: httpx.Response, rid: str, kind: str, meta: RequestMeta | None,
                     stream: bool, down: asyncio.Event) -> Response | None:
        """The client's response; None when a non-streamed body was cut by the replica going
        down (nothing was sent yet, so the caller may retry)."""
        headers = {**self._response_headers(upstream), REPLICA_HEADER: rid, DECISION_HEADER: kind}
        sniffer = _UsageSniffer()
        closed = False

        async def close() -> None:
            nonlocal closed
            if closed:
                return
            closed = True
            await upstream.aclose()
            if meta is not None:
                self._finish_attempt(meta, rid, sniffer.usage)
                if sniffer.response_id is not None and upstream.status_code < 300:
                    self.remember_response(sniffer.response_id, rid, meta.session_id)
            else:
                self.registry.request_finished(rid)

        is_sse = upstream.headers.get("content-type", "").startswith("text/event-stream")
        if not (stream or is_sse):
            try:
                body = await _unless_down(_read_all(upstream), down)
            except _Ejected:
                await close()
                return None
            except httpx.HTTPError as e:
                self.stats.midstream_errors += 1
                self._request_result(rid, False, type(e).__name__)
                await close()
                return openai_error(502, f"replica {rid} broke off its response: {type(e).__name__}: {e}",
                                    "upstream_error", {REPLICA_HEADER: rid})
            self._request_result(rid, upstream.status_code < 500)
            sniffer.feed_body(body)
            await close()
            return Response(body, status_code=upstream.status_code, headers=headers)

        async def relay() -> AsyncIterator[bytes]:
            chunks = upstream.aiter_raw().__aiter__()
            down_wait = asyncio.ensure_future(down.wait())
            try:
                while True:
                    nxt = asyncio.ensure_future(chunks.__anext__())
                    await asyncio.wait({nxt, down_wait}, return_when=asyncio.FIRST_COMPLETED)
                    if not nxt.done():
                        nxt.cancel()
                        raise _Ejected()
                    try:
                        chunk = nxt.result()
                    except StopAsyncIteration:
                        break
                    sniffer.feed(chunk)
                    yield chunk
                self._request_result(rid, True)
            except (httpx.HTTPError, _Ejected) as e:
                self.stats.midstream_errors += 1
                why = "went down" if isinstance(e, _Ejected) else f"failed: {type(e).__name__}: {e}"
                log.warning("replica %s mid-stream: %s", rid, why)
                if not isinstance(e, _Ejected):
                    self._request_result(rid, False, type(e).__name__)
                if is_sse:
                    err = {"error": {"message": f"replica {rid} {why} mid-stream", "type": "upstream_error",
                                     "param": None, "code": 502}}
                    yield b"\n\ndata: " + json.dumps(err).encode() + b"\n\ndata: [DONE]\n\n"
            finally:
                down_wait.cancel()
                await close()

        return _ProxyStream(relay(), close, status_code=upstream.status_code, headers=headers)

    # ------------------------------------------------------------------ views
    def loads(self) -> dict[str, Any]:
        sessions = getattr(self.policy, "sessions_per_replica", lambda: {})()
        replicas = []
        for r in self.registry.all():
            d = r.as_dict()
            d["sessions"] = sessions.get(r.id, 0)
            replicas.append(d)
        return {
            "router": {
                "policy": self.policy.name,
                "inflight": sum(r.inflight for r in self.registry.all()),
                "sessions": getattr(self.policy, "num_sessions", None),
                "decisions": dict(self.policy.counters),
                "retries": self.retries,
                "load_dispersion": self.registry.dispersion.as_dict(),
            },
            "replicas": replicas,
        }


def build_app(config: RouterConfig) -> FastAPI:
    """The router's FastAPI app; replicas are checked once before it starts serving.

    Keys: with ``api_key`` every route but ``/health`` needs ``Authorization: Bearer <api key>``;
    the admin routes (``/replicas``, ``/flush_cache``) need the admin key (they are off without
    one). Keys are compared in constant time. Body size and JSON depth are checked by
    :class:`~tokenmill.server.limits.BodyLimits` before anything is parsed.
    """
    from contextlib import asynccontextmanager

    router = Router(config)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await router.start()
        try:
            yield
        finally:
            await router.stop()

    app = FastAPI(title="tokenmill router", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.router = router

    def on_limit(status: int, code: str) -> None:
        router.stats.rejected[code] += 1

    app.add_middleware(BodyLimits, max_bytes=config.max_request_bytes,  # type: ignore[arg-type]
                       max_depth=config.max_json_depth, on_reject=on_limit)

    def _bearer(request: Request) -> str | None:
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        return token.strip() if scheme.lower() == "bearer" else None

    def key_denied(request: Request) -> Response | None:
        if config.api_key is None:
            return None
        given = _bearer(request)
        if given is None:   # Anthropic clients send x-api-key
            given = request.headers.get("x-api-key")
        if given is None or not hmac.compare_digest(given.strip().encode(), config.api_key.encode()):
            return openai_error(401, "invalid or missing API key: send 'Authorization: Bearer <key>'",
                                "authentication_error", {"WWW-Authenticate": "Bearer"}, code="invalid_api_key")
        return None

    def admin_denied(request: Request) -> Response | None:
        if config.admin_key is None:
            return openai_error(403, "the admin API is off; start the router with --admin-key", "permission_error")
        given = _bearer(request)
        if given is None:
            given = request.headers.get("x-admin-key", "")
        if not hmac.compare_digest(given.encode(), config.admin_key.encode()):
            return openai_error(401, "missing or wrong admin key (Authorization: Bearer KEY)", "authentication_error",
                                {"WWW-Authenticate": "Bearer"}, code="invalid_admin_key")
        return None

    async def generation(request: Request, path: str) -> Response:
        if (denied := key_denied(request)) is not None:
            router.requests[(path, denied.status_code)] += 1
            return denied
        raw = await request.body()
        parsed = request.scope.get(PARSED_BODY_KEY, _UNPARSED)
        try:
            body = json.loads(raw) if parsed is _UNPARSED else parsed
        except ValueError as e:
            return openai_error(400, f"request body is not valid JSON: {e}")
        if not isinstance(body, dict):
            return openai_error(400, "request body must be a JSON object")
        key = prompt_prefix_key(path, body)
        session_id = extract_session_id(request.headers, body)
        if session_id is None and path == "/v1/responses":
            prev = body.get("previous_response_id")
            home = router.response_homes.get(prev) if isinstance(prev, str) else None
            session_id = home[1] if home is not None and home[1] else f"responses-{uuid.uuid4().hex}"
        meta = RequestMeta(session_id=session_id, prompt_tokens=_estimate_tokens(key), prefix_key=key,
                           now=time.monotonic())
        response = await router.forward(request, "POST", path, raw, meta, bool(body.get("stream")))
        router.requests[(path, response.status_code)] += 1
        return response

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await generation(request, "/v1/chat/completions")

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await generation(request, "/v1/completions")

    @app.post("/v1/messages")
    async def messages(request: Request) -> Response:
        return await generation(request, "/v1/messages")

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(request: Request) -> Response:
        if (denied := key_denied(request)) is not None:
            return denied
        raw = await request.body()
        response = await router.forward(request, "POST", "/v1/messages/count_tokens", raw, None, False)
        router.requests[("/v1/messages/count_tokens", response.status_code)] += 1
        return response

    @app.post("/v1/responses")
    async def responses(request: Request) -> Response:
        return await generation(request, "/v1/responses")

    @app.api_route("/v1/responses/{response_id}", methods=["GET", "DELETE"])
    async def stored_response(request: Request, response_id: str) -> Response:
        if (denied := key_denied(request)) is not None:
            return denied
        home = router.response_homes.get(response_id)
        path = f"/v1/responses/{response_id}"
        response = await router.forward(request, request.method, path, b"", None, False,
                                        prefer=home[0] if home else None)
        router.requests[("/v1/responses/{id}", response.status_code)] += 1
        return response

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        if (denied := key_denied(request)) is not None:
            return denied
        response = await router.forward(request, "GET", "/v1/models", b"", None, False)
        router.requests[("/v1/models", response.status_code)] += 1
        return response

    @app.get("/health")
    async def health() -> Response:
        healthy = sum(1 for r in router.registry.all() if r.healthy and not r.draining)
        status = 200 if healthy else 503
        return JSONResponse({"status": "ok" if healthy else "no healthy replica", "healthy_replicas": healthy,
                             "replicas": len(router.registry.all())}, status_code=status)

    @app.get("/v1/loads")
    async def loads(request: Request) -> Response:
        return key_denied(request) or JSONResponse(router.loads())

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        return key_denied(request) or PlainTextResponse(render(router.metrics_registry), media_type=CONTENT_TYPE)

    @app.post("/flush_cache")
    async def flush_cache(request: Request) -> Response:
        """Flush the prefix cache of every healthy replica (what ``tokenmill bench --flush-cache``
        asks for); 200 when all flushed, 409 when any refused or failed. Needs the admin key
        when the router has one, else the API key."""
        denied = admin_denied(request) if config.admin_key is not None else key_denied(request)
        if denied is not None:
            return denied
        assert router.client is not None
        targets = [r for r in router.registry.all() if r.healthy]
        auth = router._replica_auth(admin=True)

        async def one(url: str) -> int:
            try:
                return (await router.client.post(url + "/flush_cache", timeout=30.0,  # type: ignore[union-attr]
                                                 headers=auth)).status_code
            except httpx.HTTPError:
                return 502

        codes = await asyncio.gather(*(one(r.url) for r in targets))
        ok = bool(targets) and all(c < 300 for c in codes)
        return JSONResponse({"flushed": ok, "replicas": {r.id: c for r, c in zip(targets, codes)}},
                            status_code=200 if ok else 409)

    @app.get("/replicas")
    async def list_replicas(request: Request) -> Response:
        return admin_denied(request) or JSONResponse({"replicas": [r.as_dict() for r in router.registry.all()]})

    @app.post("/replicas")
    async def add_replica(request: Request) -> Response:
        if (denied := admin_denied(request)) is not None:
            return denied
        try:
            body = json.loads(await request.body())
            if not isinstance(body, dict) or not isinstance(body.get("url"), str):
                raise ValueError('expected a JSON object {"url": "http://host:port", "id": optional}')
            rid = body.get("id")
            if rid is not None and not isinstance(rid, str):
                raise ValueError("id must be a string")
            replica = router.registry.add(body["url"], source="admin", replica_id=rid)
        except ValueError as e:
            return openai_error(400, str(e))
        assert router.monitor is not None
        await router.monitor.check_health(replica)
        return JSONResponse(replica.as_dict(), status_code=201)

    @app.delete("/replicas/{replica_id}")
    async def drain_replica(replica_id: str, request: Request) -> Response:
        if (denied := admin_denied(request)) is not None:
            return denied
        try:
            replica = router.registry.drain(replica_id)
        except KeyError:
            return openai_error(404, f"no replica {replica_id!r}", "not_found_error")
        return JSONResponse({**replica.as_dict(), "removed": replica_id not in router.registry}, status_code=202)

    return app


_UNPARSED = object()
