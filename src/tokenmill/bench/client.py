"""Streaming HTTP client of the benchmark: one OpenAI-compatible request, timed chunk by chunk.

Requests are sent with ``stream: true`` and ``stream_options.include_usage`` so the final chunk
carries ``usage`` (prompt, completion and ``prompt_tokens_details.cached_tokens``). Optional
extra body fields: ``ignore_eos`` (outputs get their planned length) and ``return_token_ids``
(the server returns the ids it generated, so the closed loop resends exactly them); a server
that rejects them is detected by :meth:`BenchClient.probe` and they are dropped.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from tokenmill.bench.metrics import RequestRecord
from tokenmill.bench.prompts import RequestPayload
from tokenmill.session import RESPONSE_HEADER
from tokenmill.utils.sse import iter_sse_json

FLUSH_PATHS = ("/flush_cache", "/reset_prefix_cache")


@dataclass(frozen=True)
class EndpointConfig:
    """Where and how to send requests."""

    base_url: str = "http://127.0.0.1:8000"
    model: str | None = None
    session_header: bool = True
    ignore_eos: bool = True
    return_token_ids: bool = True
    temperature: float = 0.0
    timeout_s: float = 600.0
    api_key: str | None = None
    label: str | None = None
    extra_body: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.base_url.startswith(("http://", "https://")):
            raise ValueError(f"base URL must start with http:// or https://, got {self.base_url!r}")
        if self.timeout_s <= 0:
            raise ValueError("timeout must be > 0")
        if self.temperature < 0:
            raise ValueError("temperature must be >= 0")

    @property
    def root(self) -> str:
        """The server root (base URL without a trailing ``/v1``)."""
        url = self.base_url.rstrip("/")
        return url[:-3] if url.endswith("/v1") else url


@dataclass
class RequestResult:
    """Output of one request: the record for metrics plus what the closed loop needs."""

    record: RequestRecord
    text: str
    token_ids: list[int] | None


class BenchClient:
    """An httpx.AsyncClient wrapper; use ``async with``."""

    def __init__(self, endpoint: EndpointConfig, max_connections: int = 256) -> None:
        self.endpoint = endpoint
        self.extras: dict[str, Any] = {}
        if endpoint.ignore_eos:
            self.extras["ignore_eos"] = True
        if endpoint.return_token_ids:
            self.extras["return_token_ids"] = True
        self.extras.update(endpoint.extra_body)
        headers = {"Authorization": f"Bearer {endpoint.api_key}"} if endpoint.api_key else {}
        self._http = httpx.AsyncClient(
            base_url=endpoint.root, headers=headers,
            timeout=httpx.Timeout(endpoint.timeout_s, connect=30.0),
            limits=httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections))
        self.model = endpoint.model

    async def __aenter__(self) -> BenchClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._http.aclose()

    async def discover_model(self) -> str:
        """The model to request: the configured one, else the first of ``GET /v1/models``."""
        if self.model:
            return self.model
        try:
            r = await self._http.get("/v1/models")
            r.raise_for_status()
            data = r.json().get("data") or []
        except (httpx.HTTPError, ValueError) as e:
            raise ConnectionError(f"cannot list models at {self.endpoint.root}/v1/models: {e}; "
                                  "is the server up? (or pass --model)") from None
        if not data:
            raise ConnectionError(f"{self.endpoint.root}/v1/models lists no model; pass --model")
        self.model = str(data[0]["id"])
        return self.model

    async def probe(self, payload: RequestPayload) -> list[str]:
        """Warm the server up with one request; drop extra body fields it rejects.

        Returns warnings (one per dropped field). Raises ConnectionError when even a plain
        request fails.
        """
        warnings: list[str] = []
        while True:
            res = await self.send(payload, max_tokens=2, session_id=None)
            err = res.record.error
            if err is None:
                return warnings
            rejected = [k for k in self.extras if k in err] or (
                list(self.extras) if err.startswith(("HTTP 400", "HTTP 422")) else [])
            if not rejected:
                raise ConnectionError(f"warm-up request failed: {err}")
            for k in rejected:
                self.extras.pop(k)
                warnings.append(f"server rejected body field {k!r}; sending without it ({err[:160]})")

    async def flush_cache(self) -> bool | None:
        """Empty the server's prefix cache: ``POST /flush_cache`` (tokenmill, SGLang), else
        ``POST /reset_prefix_cache`` (vLLM in dev mode). True on success, False if refused,
        None if the server has neither."""
        for path in FLUSH_PATHS:
            try:
                r = await self._http.post(path)
            except httpx.HTTPError:
                continue
            if r.status_code not in (404, 405):
                return r.status_code < 300
        return None

    def _body(self, payload: RequestPayload, max_tokens: int) -> dict[str, Any]:
        return {"model": self.model, **payload.body, "max_tokens": max_tokens, "stream": True,
                "stream_options": {"include_usage": True}, "temperature": self.endpoint.temperature,
                **self.extras}

    async def send(self, payload: RequestPayload, *, max_tokens: int, session_id: str | None,
                   turn: int = 0, branch: int = 0, warmup: bool = False) -> RequestResult:
        """Send one streaming request and time it. Never raises for server/network errors: they
        end up in ``record.error``."""
        headers = {"X-Session-ID": session_id} if session_id and self.endpoint.session_header else {}
        rec = RequestRecord(session_id=session_id, turn=turn, branch=branch, send_time=time.perf_counter(),
                            planned_output_tokens=max_tokens, warmup=warmup)
        texts: list[str] = []
        ids: list[int] = []
        ids_seen = False
        usage: dict[str, Any] | None = None
        try:
            async with self._http.stream("POST", payload.path, json=self._body(payload, max_tokens),
                                         headers=headers) as resp:
                if resp.status_code != 200:
                    body = (await resp.aread()).decode(errors="replace")
                    rec.error = f"HTTP {resp.status_code}: {body[:300]}"
                    rec.end_time = None
                    return RequestResult(rec, "", None)
                if session_id and self.endpoint.session_header:
                    rec.session_echoed = resp.headers.get(RESPONSE_HEADER) == session_id
                async for chunk in iter_sse_json(resp):
                    if "error" in chunk:
                        raise RuntimeError(f"stream error: {json.dumps(chunk['error'])[:300]}")
                    now = time.perf_counter()
                    if chunk.get("usage"):
                        usage = chunk["usage"]
                    n_tok, piece = 0, ""
                    for choice in chunk.get("choices") or []:
                        piece += choice.get("text") or (choice.get("delta") or {}).get("content") or ""
                        tids = choice.get("token_ids")
                        if tids is not None:
                            ids_seen = True
                            ids.extend(int(t) for t in tids)
                            n_tok += len(tids)
                    if piece or n_tok:
                        texts.append(piece)
                        if rec.first_token_time is None:
                            rec.first_token_time = now
                        rec.chunk_times.append(now)
                        rec.chunk_tokens.append(n_tok if ids_seen else 1)
        except (httpx.HTTPError, json.JSONDecodeError, RuntimeError, ValueError, KeyError) as e:
            rec.error = f"{type(e).__name__}: {e}"[:300]
            return RequestResult(rec, "".join(texts), None)
        rec.end_time = time.perf_counter()
        rec.output_tokens = sum(rec.chunk_tokens)
        if usage:
            rec.prompt_tokens = int(usage.get("prompt_tokens") or 0)
            if usage.get("completion_tokens") is not None:
                rec.output_tokens = int(usage["completion_tokens"])
            details = usage.get("prompt_tokens_details") or {}
            if details.get("cached_tokens") is not None:
                rec.cached_tokens = int(details["cached_tokens"])
        elif payload.local_ids is not None:
            rec.prompt_tokens = len(payload.local_ids)
        if rec.first_token_time is None:
            rec.error = "no output token received"
        return RequestResult(rec, "".join(texts), ids if ids_seen else None)
