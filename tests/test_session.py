from __future__ import annotations

from tokenmill.session import extract_session_id


def test_header_order_and_case():
    assert extract_session_id({"X-Session-ID": "a", "Modal-Session-Id": "b"}) == "a"
    assert extract_session_id({"modal-session-id": "b"}) == "b"
    assert extract_session_id({"X-Claude-Code-Session-Id": "c"}) == "c"


def test_body_fields_and_precedence():
    assert extract_session_id({}, {"prompt_cache_key": "k", "user": "u"}) == "k"
    assert extract_session_id({}, {"user": "u"}) == "u"
    assert extract_session_id({"x-session-id": "h"}, {"user": "u"}) == "h"


def test_absent_or_empty():
    assert extract_session_id({}, None) is None
    assert extract_session_id({"x-session-id": "  "}, {"user": ""}) is None
    assert extract_session_id({}, {"user": 7}) is None
