"""Prompt formats of the benchmark: how workload token ids become request bodies.

- ``tokens``: ``/v1/completions`` with a list of token ids (exact lengths, any tokenizer).
- ``text``: ``/v1/completions`` with a string of exactly that many tokens under the given
  tokenizer. Each workload id is mapped to a "safe word": a vocabulary entry that decodes to a
  space plus lowercase letters and re-encodes to itself, so that a string of safe words
  tokenizes back to exactly one token per word (byte-level BPE pre-tokenizers split on the
  leading space).
- ``chat``: ``/v1/chat/completions``; the session history becomes messages (system = shared
  prompt, user = first block and each later turn's new tokens, assistant = real outputs). The
  chat template adds tokens, so lengths are the template's.

A :class:`SessionPrompt` keeps one session's history and yields the body of each request and the
token ids the server should see (for the theoretical cache hit rate).
"""
from __future__ import annotations

import re
from collections.abc import Sequence
from functools import lru_cache
from dataclasses import dataclass, field
from typing import Any, Protocol

PROMPT_FORMATS = ("tokens", "text", "chat")
_SAFE_WORD = re.compile(r" [a-z]{2,12}")


class Tokenizer(Protocol):
    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...
    def decode(self, ids: Sequence[int]) -> str: ...


@lru_cache(maxsize=4)
def load_tokenizer(path: str | None) -> Any:
    """An HF fast tokenizer from ``path``, or the default model's when ``path`` is None
    (memoised: loading takes seconds)."""
    from transformers import AutoTokenizer

    if path is None:
        from tokenmill.loader.tiny import default_tokenizer_dir

        path = str(default_tokenizer_dir())
    try:
        return AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot load tokenizer from {path!r}: {e}") from None


@lru_cache(maxsize=4)
def load_codec(path: str | None) -> TextCodec:
    """The :class:`TextCodec` of :func:`load_tokenizer` (memoised)."""
    return TextCodec(load_tokenizer(path))


class TextCodec:
    """Maps arbitrary token ids to text of exactly one token per id (see module doc)."""

    def __init__(self, tokenizer: Any, max_words: int = 8192) -> None:
        self.tokenizer = tokenizer
        safe: list[int] = []
        vocab = tokenizer.get_vocab()
        for tid in sorted(vocab.values()):
            s = tokenizer.decode([tid])
            if _SAFE_WORD.fullmatch(s) and tokenizer.encode(s, add_special_tokens=False) == [tid]:
                safe.append(tid)
                if len(safe) >= max_words:
                    break
        if len(safe) < 64:
            raise ValueError("tokenizer has too few single-token words for exact-length text prompts; "
                             "use --prompt-format tokens")
        self.safe_ids = safe
        self._words = {tid: tokenizer.decode([tid]) for tid in safe}

    def to_safe(self, ids: Sequence[int]) -> list[int]:
        n = len(self.safe_ids)
        return [self.safe_ids[i % n] for i in ids]

    def text(self, ids: Sequence[int]) -> str:
        """Text of exactly ``len(ids)`` tokens."""
        return "".join(self._words[t] for t in self.to_safe(ids))

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))


@dataclass
class RequestPayload:
    """A request ready to send: endpoint path, body fields, and the token ids the server is
    expected to see (``local_ids``, None when no tokenizer is available)."""

    path: str
    body: dict[str, Any]
    local_ids: list[int] | None


@dataclass
class SessionPrompt:
    """One session's closed-loop history in one prompt format.

    ``tokens``/``text`` keep the history as token ids (outputs as returned ids, or the returned
    text re-encoded); ``chat`` keeps messages.
    """

    prompt_format: str
    codec: TextCodec | None
    ids: list[int] = field(default_factory=list)
    messages: list[dict[str, str]] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.prompt_format not in PROMPT_FORMATS:
            raise ValueError(f"prompt format must be one of {PROMPT_FORMATS}, got {self.prompt_format!r}")
        if self.prompt_format in ("text", "chat") and self.codec is None:
            raise ValueError(f"prompt format {self.prompt_format!r} needs a tokenizer")

    def start(self, shared_ids: Sequence[int], first_ids: Sequence[int]) -> None:
        if self.prompt_format == "tokens":
            self.ids = [*shared_ids, *first_ids]
        elif self.prompt_format == "text":
            assert self.codec is not None
            self.ids = self.codec.to_safe([*shared_ids, *first_ids])
        else:
            assert self.codec is not None
            self.messages = ([{"role": "system", "content": self.codec.text(shared_ids).lstrip()}]
                             if shared_ids else [])
            self.messages.append({"role": "user", "content": self.codec.text(first_ids).lstrip()})

    def extend(self, output_ids: Sequence[int] | None, output_text: str, new_ids: Sequence[int]) -> None:
        """Append the real output of the last request and the next turn's new tokens."""
        if self.prompt_format == "chat":
            assert self.codec is not None
            self.messages.append({"role": "assistant", "content": output_text})
            self.messages.append({"role": "user", "content": self.codec.text(new_ids).lstrip()})
            return
        if output_ids is None:
            if self.codec is None:
                raise ValueError("the server returned no token ids and no tokenizer is loaded to "
                                 "re-encode its output text")
            output_ids = self.codec.encode(output_text)
        new = list(new_ids) if self.prompt_format == "tokens" else self.codec.to_safe(new_ids)  # type: ignore[union-attr]
        self.ids = [*self.ids, *output_ids, *new]

    def payload(self, suffix_ids: Sequence[int] = ()) -> RequestPayload:
        """The request for the current history (plus a branch suffix for thick sessions)."""
        if self.prompt_format == "tokens":
            ids = [*self.ids, *suffix_ids]
            return RequestPayload("/v1/completions", {"prompt": ids}, ids)
        assert self.codec is not None
        if self.prompt_format == "text":
            ids = [*self.ids, *self.codec.to_safe(suffix_ids)]
            text = self.codec.tokenizer.decode(ids)
            return RequestPayload("/v1/completions", {"prompt": text}, self.codec.encode(text))
        messages = [dict(m) for m in self.messages]
        if suffix_ids:
            messages[-1]["content"] += self.codec.text(suffix_ids)
        return RequestPayload("/v1/chat/completions", {"messages": messages}, chat_ids(self.codec, messages))


def chat_ids(codec: TextCodec, messages: list[dict[str, str]]) -> list[int] | None:
    """Token ids of the chat prompt under the tokenizer's own template (None without one)."""
    tok = codec.tokenizer
    if not getattr(tok, "chat_template", None):
        return None
    out = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if isinstance(out, dict) or hasattr(out, "keys"):
        out = out["input_ids"]
    return list(out)


def single_prompt(prompt_format: str, codec: TextCodec | None, ids: Sequence[int]) -> RequestPayload:
    """A one-shot request (trace replay, warm-up) for the given token ids."""
    sp = SessionPrompt(prompt_format, codec)
    sp.start((), ids)
    return sp.payload()
