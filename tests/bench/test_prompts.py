"""Prompt formats: exact-length text prompts and closed-loop histories."""
from __future__ import annotations

import pytest

from tokenmill.bench.prompts import SessionPrompt, TextCodec, single_prompt
from tokenmill.workload import AgenticWorkloadConfig, make_session, random_token_ids


@pytest.fixture(scope="module")
def codec(tokenizer) -> TextCodec:
    return TextCodec(tokenizer)


def test_text_prompts_have_exact_token_lengths(codec: TextCodec) -> None:
    for n, seed in [(1, 0), (17, 1), (300, 2), (2048, 3)]:
        ids = random_token_ids(n, 1000, 30000, "t", seed)
        text = codec.text(ids)
        assert len(codec.encode(text)) == n
        assert codec.encode(text) == codec.to_safe(ids)
    assert codec.text([5, 6]) == codec.text([5, 6]) and codec.text([5]) != codec.text([6])


def test_session_prompt_tokens_closed_loop() -> None:
    cfg = AgenticWorkloadConfig(first_turn_tokens=20, new_tokens_per_turn=5, shared_prompt_tokens=3)
    s = make_session(cfg, 0)
    sp = SessionPrompt("tokens", None)
    sp.start(s.shared_prompt_ids, s.turns[0].new_token_ids)
    p0 = sp.payload()
    assert p0.path == "/v1/completions" and p0.body["prompt"] == p0.local_ids and len(p0.local_ids) == 23
    sp.extend([1, 2, 3], "ignored", s.turns[1].new_token_ids)
    p1 = sp.payload()
    assert p1.local_ids == [*p0.local_ids, 1, 2, 3, *s.turns[1].new_token_ids]
    b = sp.payload((9, 9))
    assert b.local_ids == [*p1.local_ids, 9, 9]
    with pytest.raises(ValueError, match="tokenizer"):
        sp.extend(None, "text but no tokenizer", [1])


def test_session_prompt_text_reencodes_output_and_keeps_prefix(codec: TextCodec) -> None:
    sp = SessionPrompt("text", codec)
    sp.start([1001, 1002], [2001, 2002, 2003])
    p0 = sp.payload()
    assert isinstance(p0.body["prompt"], str) and len(p0.local_ids) == 5
    sp.extend(None, " hello world", [3001, 3002])
    p1 = sp.payload()
    assert p1.body["prompt"].startswith(p0.body["prompt"])
    assert p1.local_ids[:5] == p0.local_ids and len(p1.local_ids) == 5 + len(codec.encode(" hello world")) + 2


def test_session_prompt_chat_messages(codec: TextCodec) -> None:
    sp = SessionPrompt("chat", codec)
    sp.start([1001] * 4, [2001] * 6)
    sp.extend(None, "answer", [3001] * 3)
    p = sp.payload()
    assert p.path == "/v1/chat/completions"
    assert [m["role"] for m in p.body["messages"]] == ["system", "user", "assistant", "user"]
    assert p.body["messages"][2]["content"] == "answer"
    assert p.local_ids and len(p.local_ids) > 4 + 6 + 3
    assert single_prompt("chat", codec, [5, 6]).body["messages"][0]["role"] == "user"


def test_bad_format() -> None:
    with pytest.raises(ValueError, match="prompt format"):
        SessionPrompt("xml", None)
    with pytest.raises(ValueError, match="tokenizer"):
        SessionPrompt("text", None)
