"""OpenAI-style errors: every 4xx/5xx the server sends has the body

    {"error": {"message": str, "type": str, "param": str | None, "code": str | None}}

Handlers raise :class:`APIError` (or one of the helpers below); the app turns it into a
``JSONResponse`` and keeps serving.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from fastapi.responses import JSONResponse
from pydantic import ValidationError


class APIError(Exception):
    """An error to report to the client as an OpenAI-style JSON body."""

    def __init__(self, status_code: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None,
                 headers: Mapping[str, str] | None = None) -> None:
        super().__init__(message)
        self.headers = dict(headers or {})
        self.status_code = status_code
        self.message = message
        self.type = type
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self, headers: Mapping[str, str] | None = None) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status_code, headers={**self.headers, **(headers or {})})


def bad_request(message: str, param: str | None = None, code: str | None = "invalid_value") -> APIError:
    return APIError(400, message, param=param, code=code)


def from_validation_error(err: ValidationError) -> APIError:
    """Turn pydantic's first complaint into one clear message naming the field."""
    first = err.errors()[0]
    loc = ".".join(str(p) for p in first.get("loc", ()) if not _is_union_tag(p))
    kind = first.get("type", "")
    if kind == "missing":
        return APIError(400, f"missing required field {loc!r}", param=loc or None, code="missing_required_parameter")
    given = first.get("input")
    shown = repr(given) if len(repr(given)) <= 80 else repr(given)[:77] + "..."
    msg = first.get("msg", "invalid value")
    return APIError(400, f"invalid value for {loc!r}: {msg} (got {shown})" if loc else f"invalid request body: {msg}",
                    param=loc or None, code="invalid_type" if "type" in kind or "parsing" in kind else "invalid_value")


def _is_union_tag(part: Any) -> bool:
    # pydantic adds the tried union member ("str", "list[int]", ...) to the location; drop it
    return isinstance(part, str) and ("[" in part or part in {"str", "int", "float", "bool", "function-after"})
