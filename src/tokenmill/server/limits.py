"""Request-body limits as ASGI middleware, so every POST endpoint gets them without asking.

:class:`BodyLimits` runs before routing and before any handler parses anything:

1. a ``Content-Length`` above ``max_bytes`` is refused at once with 413, unread;
2. the body is read in chunks and refused with 413 as soon as it passes ``max_bytes`` (a
   chunked upload without a length gets the same treatment);
3. a body that decodes as JSON is checked for nesting depth: deeper than ``max_depth`` (or too
   deep for Python's parser at all) is refused with 400 ``json_too_deep``. The parsed value is
   left in the ASGI scope under :data:`PARSED_BODY_KEY` so the handler does not parse it twice;
   a body that is not valid JSON is passed on untouched for the handler to report in its own words.

The handler then receives the buffered body as one ``http.request`` message; later ``receive()``
calls go to the server, so disconnect detection keeps working. Error bodies default to the
OpenAI shape; ``error_body`` lets an app choose another shape per path (an Anthropic-style
endpoint, say), and ``on_reject(status, code)`` counts refusals for metrics.
"""
from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

PARSED_BODY_KEY = "tokenmill.json_body"
_BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})

ErrorBody = Callable[[str, int, str, str], dict[str, Any]]


def openai_error_body(path: str, status: int, message: str, code: str) -> dict[str, Any]:
    kind = "invalid_request_error"
    return {"error": {"message": message, "type": kind, "param": None, "code": code}}


def json_too_deep(value: Any, limit: int) -> bool:
    """True when ``value`` nests containers deeper than ``limit`` (a scalar has depth 0).
    Walks with an explicit stack, so no depth can overflow Python's own."""
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        children = node.values() if isinstance(node, dict) else node if isinstance(node, list) else None
        if children is None:
            continue
        if depth > limit:
            return True
        stack.extend((c, depth + 1) for c in children if isinstance(c, (dict, list)))
    return False


class BodyLimits:
    """ASGI middleware enforcing ``max_bytes`` and ``max_depth`` on request bodies."""

    def __init__(self, app: Any, *, max_bytes: int, max_depth: int,
                 error_body: ErrorBody = openai_error_body,
                 on_reject: Callable[[int, str], None] | None = None) -> None:
        if max_bytes < 1 or max_depth < 1:
            raise ValueError("max_bytes and max_depth must be >= 1")
        self.app = app
        self.max_bytes = max_bytes
        self.max_depth = max_depth
        self.error_body = error_body
        self.on_reject = on_reject

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope.get("method") not in _BODY_METHODS:
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "")
        declared = _content_length(scope)
        if declared is not None and declared > self.max_bytes:
            await self._refuse(send, path, 413, "request_too_large",
                               f"request body of {declared} bytes exceeds the limit of {self.max_bytes} bytes")
            return
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return          # the client left before finishing its body: nobody to answer
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                await self._refuse(send, path, 413, "request_too_large",
                                   f"request body exceeds the limit of {self.max_bytes} bytes")
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        refusal = self._check_json(scope, body)
        if refusal is not None:
            await self._refuse(send, path, 400, "json_too_deep", refusal)
            return
        replayed = False

        async def replay() -> dict[str, Any]:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    def _check_json(self, scope: dict[str, Any], body: bytes) -> str | None:
        start = body.lstrip()[:1]
        if start not in (b"{", b"["):
            return None
        # Fewer brackets than the limit cannot nest deeper than it: skip the parse-and-walk.
        shallow = body.count(b"[") + body.count(b"{") <= self.max_depth
        try:
            value = json.loads(body.decode("utf-8"))
        except RecursionError:
            return f"request body nests JSON arrays/objects deeper than the limit of {self.max_depth}"
        except ValueError:
            return None   # not UTF-8 / not JSON: the handler reports it
        if not shallow and json_too_deep(value, self.max_depth):
            return f"request body nests JSON arrays/objects deeper than the limit of {self.max_depth}"
        scope[PARSED_BODY_KEY] = value
        return None

    async def _refuse(self, send: Any, path: str, status: int, code: str, message: str) -> None:
        if self.on_reject is not None:
            self.on_reject(status, code)
        payload = json.dumps(self.error_body(path, status, message, code)).encode()
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(payload)).encode()),
                                (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": payload})


def _content_length(scope: dict[str, Any]) -> int | None:
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None
