"""Session id extraction, shared by the server and the router.

A coding agent marks the requests of one session with a header or a body field. Both the
server (for cache retention) and the router (for affinity) read it the same way.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

# Checked in this order; header names are compared case-insensitively.
SESSION_HEADERS: tuple[str, ...] = ("x-session-id", "modal-session-id", "x-claude-code-session-id")
SESSION_BODY_FIELDS: tuple[str, ...] = ("prompt_cache_key", "user")
# Anthropic Messages requests carry it as metadata.user_id (checked after the fields above).
SESSION_METADATA_FIELD = "user_id"
RESPONSE_HEADER = "X-Session-ID"


def extract_session_id(headers: Mapping[str, str], body: Mapping[str, Any] | None = None) -> str | None:
    """Return the session id of a request, or None when it carries none.

    Headers win over body fields. Empty strings and non-string body values are ignored.
    """
    lowered = {k.lower(): v for k, v in headers.items()}
    for name in SESSION_HEADERS:
        value = lowered.get(name)
        if value and value.strip():
            return value.strip()
    if body:
        for field in SESSION_BODY_FIELDS:
            value = body.get(field)
            if isinstance(value, str) and value.strip():
                return value.strip()
        metadata = body.get("metadata")
        if isinstance(metadata, Mapping):
            value = metadata.get(SESSION_METADATA_FIELD)
            if isinstance(value, str) and value.strip():
                return value.strip()
    return None


def header_safe(session_id: str | None) -> str | None:
    """The id if it may be echoed in a response header (printable ASCII), else None.

    A body field may hold any text; a header may not (non-Latin-1 characters cannot be encoded,
    and CR/LF would split the header).
    """
    if session_id is not None and session_id.isascii() and session_id.isprintable():
        return session_id
    return None
