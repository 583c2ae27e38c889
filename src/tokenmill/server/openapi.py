"""The server's OpenAPI document (``GET /openapi.json``), built from the pydantic request models.

Handlers read raw bodies (so every error keeps the OpenAI shape), which leaves FastAPI nothing
to describe; this module adds each endpoint's request schema and the error schema of its 4xx
answers, so clients and fuzzers (tests/server/test_fuzz.py) can work from the document.
"""
from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

from tokenmill.server.protocol import ChatCompletionRequest, CompletionRequest

REF = "#/components/schemas/{model}"
ERROR_SCHEMA: dict[str, Any] = {
    "type": "object", "required": ["error"],
    "properties": {"error": {
        "type": "object", "required": ["message", "type", "param", "code"],
        "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                       "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}},
    }},
}
REQUEST_BODIES: dict[str, type[BaseModel]] = {
    "/v1/chat/completions": ChatCompletionRequest,
    "/v1/completions": CompletionRequest,
}


def install(app: FastAPI) -> None:
    """Make ``app.openapi()`` return the document with request bodies and error responses."""

    def build() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        doc = get_openapi(title=app.title, version=app.version, routes=app.routes)
        schemas = doc.setdefault("components", {}).setdefault("schemas", {})
        schemas["Error"] = ERROR_SCHEMA
        for path, model in REQUEST_BODIES.items():
            schema = model.model_json_schema(ref_template=REF)
            schemas.update(schema.pop("$defs", {}))
            schemas[model.__name__] = schema
            op = doc["paths"][path]["post"]
            op["requestBody"] = {"required": True, "content": {
                "application/json": {"schema": {"$ref": REF.format(model=model.__name__)}}}}
        for methods in doc["paths"].values():
            for op in methods.values():
                responses = op.setdefault("responses", {})
                responses.pop("422", None)
                responses["4XX"] = {"description": "Client error",
                                    "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}}
        app.openapi_schema = doc
        return doc

    app.openapi = build  # type: ignore[method-assign]
