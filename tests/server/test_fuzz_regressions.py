"""Cases the fuzzer (test_fuzz.py) found, each kept as a test of its own against the shared server."""
from __future__ import annotations

import httpx

from tests.server.conftest import MODEL_NAME


def test_non_ascii_session_id_in_body_is_not_echoed_as_a_header(http: httpx.Client) -> None:
    # Found by schemathesis: {"messages": [], "user": "\u0100"} gave a 500 (UnicodeEncodeError while
    # echoing the session id in X-Session-ID). Any text is a valid session id; only header-safe
    # ones are echoed.
    for user in ("\u0100", "caf\u00e9", "a\r\nSet-Cookie: x=1"):
        r = http.post("/v1/chat/completions", json={"model": MODEL_NAME, "messages": [], "user": user})
        assert r.status_code == 400 and r.json()["error"]["code"] == "empty_array", r.text
        assert "x-session-id" not in r.headers and "set-cookie" not in r.headers
        ok = http.post("/v1/completions", json={"model": MODEL_NAME, "prompt": "x", "max_tokens": 1, "user": user})
        assert ok.status_code == 200 and "x-session-id" not in ok.headers
    r = http.post("/v1/completions", json={"model": MODEL_NAME, "prompt": "x", "max_tokens": 1, "user": "s-1"})
    assert r.headers["x-session-id"] == "s-1"


def test_huge_top_k_and_seed_are_400(http: httpx.Client) -> None:
    # Found by schemathesis: {"prompt": "0", "top_k": 9223372036854775808} failed the engine step
    # (500 "Overflow when unpacking long long") instead of being refused.
    for field, value in (("top_k", 2**63), ("top_k", 2**31), ("seed", 2**64), ("seed", -(2**63) - 1)):
        r = http.post("/v1/completions", json={"model": MODEL_NAME, "prompt": "0", "max_tokens": 1, field: value})
        assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text
    big_k = http.post("/v1/completions", json={"model": MODEL_NAME, "prompt": "0", "max_tokens": 2,
                                               "top_k": 2**31 - 1, "seed": 2**63 - 1})
    assert big_k.status_code == 200, big_k.text
