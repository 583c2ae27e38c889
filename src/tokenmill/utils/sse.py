"""Reading OpenAI-style server-sent event streams (shared by the benchmark client and sim calibration)."""
from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import httpx


async def iter_sse_json(resp: httpx.Response) -> AsyncIterator[dict[str, Any]]:
    """The JSON objects of an OpenAI-style SSE stream, up to ``data: [DONE]``."""
    async for line in resp.aiter_lines():
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            return
        yield json.loads(data)
