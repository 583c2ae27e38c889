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
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from tokenmill.router.discovery import Discovery
from tokenmill.router.policies import (
    DEFAULT_POLICY, NoReplicaAvailable, Policy, RequestMeta, make_policy,
)
from tokenmill.router.replicas import HealthConfig, ReplicaMonitor, ReplicaRegistry
from tokenmill.session import extract_session_id

log = logging.getLogger("tokenmill.router")

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

    def __post_init__(self) -> None:
        if not (self.replicas or self.replica_file or self.replica_dns or self.admin_key):
            raise ValueError("no replicas: give --replica, --replica-file or --replica-dns "
                             "(or --admin-key to add them later through POST /replicas)")
        if self.connect_timeout_s <= 0 or self.request_timeout_s <= 0:
            raise ValueError("timeouts must be > 0")
        make_policy(self.policy, **self.policy_options)   # raises ValueError on a bad policy


def openai_error(status: int, message: str, kind: str = "invalid_request_error",
                 headers: dict[str, str] | None = None) -> JSONResponse:
    body = {"error": {"message": message, "type": kind, "param": None, "code": status}}
    return JSONResponse(body, status_code=status, headers=headers)


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


class Router:
    """Registry + policy + HTTP client; one per process."""

    def __init__(self, config: RouterConfig) -> None:
        self.config = config
        self.policy: Policy = make_policy(config.policy, **config.policy_options)
        self.registry = ReplicaRegistry(config.health)
        for url in config.replicas:
            self.registry.add(url, source="flag")
        self.discovery = Discovery(self.registry, config.replica_file, tuple(config.replica_dns),
                                   config.discovery_interval_s)
        self.client: httpx.AsyncClient | None = None
        self.monitor: ReplicaMonitor | None = None
        self.requests: Counter[tuple[str, int]] = Counter()    # (endpoint, status) -> count
        self.retries = 0
        self.upstream_errors: Counter[str] = Counter()         # reason -> count
        self.midstream_errors = 0
        # Responses API: response id -> (replica id, routing session id), most recent last
        self.response_homes: OrderedDict[str, tuple[str, str | None]] = OrderedDict()
        self.max_response_homes = 100_000

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        timeout = httpx.Timeout(self.config.request_timeout_s, connect=self.config.connect_timeout_s)
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=256)
        self.client = httpx.AsyncClient(timeout=timeout, limits=limits)
        self.monitor = ReplicaMonitor(self.registry, self.client)
        await self.discovery.start()
        await self.monitor.check_all()
        self.monitor.start()

    async def stop(self) -> None:
        await self.discovery.stop()
        if self.monitor is not None:
            await self.monitor.stop()
        if self.client is not None:
            await self.client.aclose()

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

    async def forward(self, request: Request, method: str, path: str, raw_body: bytes,
                      meta: RequestMeta | None, stream: bool, *, prefer: str | None = None) -> Response:
        """Send to the policy's choice; retry once elsewhere on a connect error or 5xx.

        ``meta`` None: not a routed generation request (e.g. /v1/models); the replica ``prefer``
        (if given and eligible) or else the least busy one answers, and the policy is not consulted.
        """
        assert self.client is not None
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP_BY_HOP}
        if request.client is not None:
            headers["x-forwarded-for"] = request.client.host
        tried: list[str] = []
        failure: Response | None = None
        for attempt in range(2):
            try:
                if meta is not None:
                    decision = self.policy.choose(meta, self.registry.views(), exclude=tried)
                    rid, kind = decision.replica_id, decision.kind
                else:
                    views = [v for v in self.registry.views() if v.eligible and v.id not in tried]
                    if not views:
                        raise NoReplicaAvailable("no healthy replica")
                    home = [v for v in views if v.id == prefer]
                    if home:
                        rid, kind = home[0].id, "home"
                    else:
                        rid, kind = min(views, key=lambda v: (v.active, v.id)).id, "least_load"
            except NoReplicaAvailable as e:
                if failure is not None:
                    return failure
                return openai_error(503, f"no replica available: {e}", "service_unavailable")
            if attempt:
                self.retries += 1
            replica = self.registry.get(rid)
            assert replica is not None
            self.registry.request_started(rid)
            upstream_req = self.client.build_request(method, replica.url + path, content=raw_body or None,
                                                     headers=headers)
            try:
                upstream = await self.client.send(upstream_req, stream=True)
            except httpx.HTTPError as e:
                reason = type(e).__name__
                self.upstream_errors[reason] += 1
                if isinstance(e, (httpx.ConnectError, httpx.ConnectTimeout)):
                    self.registry.record_failure(rid, f"{reason}: {e}")
                if meta is not None:
                    self._finish_attempt(meta, rid)
                else:
                    self.registry.request_finished(rid)
                tried.append(rid)
                failure = openai_error(502, f"replica {rid} failed: {reason}: {e}", "upstream_error",
                                       {REPLICA_HEADER: rid})
                continue
            if upstream.status_code >= 500:
                body = await upstream.aread()
                await upstream.aclose()
                self.upstream_errors[f"http_{upstream.status_code}"] += 1
                if meta is not None:
                    self._finish_attempt(meta, rid)
                else:
                    self.registry.request_finished(rid)
                tried.append(rid)
                failure = Response(body, status_code=upstream.status_code,
                                   headers={**self._response_headers(upstream), REPLICA_HEADER: rid})
                continue
            return await self._relay(upstream, rid, kind, meta, stream)
        assert failure is not None
        return failure

    @staticmethod
    def _response_headers(upstream: httpx.Response) -> dict[str, str]:
        return {k: v for k, v in upstream.headers.items() if k.lower() not in _HOP_BY_HOP}

    async def _relay(self, upstream: httpx.Response, rid: str, kind: str, meta: RequestMeta | None,
                     stream: bool) -> Response:
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
                body = b"".join([chunk async for chunk in upstream.aiter_raw()])
            except httpx.HTTPError as e:
                self.midstream_errors += 1
                await close()
                return openai_error(502, f"replica {rid} broke off its response: {type(e).__name__}: {e}",
                                    "upstream_error", {REPLICA_HEADER: rid})
            sniffer.feed_body(body)
            await close()
            return Response(body, status_code=upstream.status_code, headers=headers)

        async def relay() -> AsyncIterator[bytes]:
            try:
                async for chunk in upstream.aiter_raw():
                    sniffer.feed(chunk)
                    yield chunk
            except httpx.HTTPError as e:
                self.midstream_errors += 1
                log.warning("replica %s failed mid-stream: %s", rid, e)
                if is_sse:
                    err = {"error": {"message": f"replica {rid} failed mid-stream: {type(e).__name__}: {e}",
                                     "type": "upstream_error", "param": None, "code": 502}}
                    yield b"\n\ndata: " + json.dumps(err).encode() + b"\n\n"
            finally:
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
    """The router's FastAPI app; replicas are checked once before it starts serving."""
    from contextlib import asynccontextmanager

    from tokenmill.router.metrics import render_metrics

    router = Router(config)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await router.start()
        try:
            yield
        finally:
            await router.stop()

    app = FastAPI(title="tokenmill router", lifespan=lifespan)
    app.state.router = router

    async def generation(request: Request, path: str) -> Response:
        raw = await request.body()
        try:
            body = json.loads(raw)
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
        raw = await request.body()
        response = await router.forward(request, "POST", "/v1/messages/count_tokens", raw, None, False)
        router.requests[("/v1/messages/count_tokens", response.status_code)] += 1
        return response

    @app.post("/v1/responses")
    async def responses(request: Request) -> Response:
        return await generation(request, "/v1/responses")

    @app.api_route("/v1/responses/{response_id}", methods=["GET", "DELETE"])
    async def stored_response(request: Request, response_id: str) -> Response:
        home = router.response_homes.get(response_id)
        path = f"/v1/responses/{response_id}"
        response = await router.forward(request, request.method, path, b"", None, False,
                                        prefer=home[0] if home else None)
        router.requests[("/v1/responses/{id}", response.status_code)] += 1
        return response

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
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
    async def loads() -> Response:
        return JSONResponse(router.loads())

    @app.get("/metrics")
    async def metrics() -> Response:
        return PlainTextResponse(render_metrics(router), media_type="text/plain; version=0.0.4")

    @app.post("/flush_cache")
    async def flush_cache() -> Response:
        """Flush the prefix cache of every healthy replica (what ``tokenmill bench --flush-cache``
        asks for); 200 when all flushed, 409 when any refused or failed."""
        assert router.client is not None
        targets = [r for r in router.registry.all() if r.healthy]

        async def one(url: str) -> int:
            try:
                return (await router.client.post(url + "/flush_cache", timeout=30.0)).status_code  # type: ignore[union-attr]
            except httpx.HTTPError:
                return 502

        codes = await asyncio.gather(*(one(r.url) for r in targets))
        ok = bool(targets) and all(c < 300 for c in codes)
        return JSONResponse({"flushed": ok, "replicas": {r.id: c for r, c in zip(targets, codes)}},
                            status_code=200 if ok else 409)

    def admin_denied(request: Request) -> Response | None:
        if config.admin_key is None:
            return openai_error(403, "the admin API is off; start the router with --admin-key", "permission_error")
        auth = request.headers.get("authorization", "")
        given = auth[7:] if auth.lower().startswith("bearer ") else request.headers.get("x-admin-key", "")
        if not hmac.compare_digest(given.encode(), config.admin_key.encode()):
            return openai_error(401, "missing or wrong admin key (Authorization: Bearer KEY)", "authentication_error")
        return None

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
