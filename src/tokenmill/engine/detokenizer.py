"""Incremental detokenization with stop strings.

Decoding one token at a time is wrong for byte-level BPE (a character may span tokens) and for
tokenizers whose spacing depends on the previous token. :class:`IncrementalDetokenizer` decodes
a short window of previous tokens plus the new ones and keeps only the text that is new and
complete (no trailing U+FFFD), so the concatenated deltas equal the decoded whole.

Stop strings are searched in the full output text as it grows, so a stop string split across
tokens is still found; the text from the stop string on is cut. While a request runs, text that
could be the start of a stop string is held back (not yet emitted); it is released as soon as it
cannot be, or when the request finishes.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

_CONTEXT_TOKENS = 6  # prompt tokens decoded before the first output token, for correct spacing


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, prompt_token_ids: Sequence[int], stop: Sequence[str] = (),
                 skip_special_tokens: bool = True) -> None:
        backend = getattr(tokenizer, "backend_tokenizer", None)
        self._decode_fn = backend.decode if backend is not None else tokenizer.decode
        self._skip = skip_special_tokens
        self._tokens: list[int] = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._tokens)
        self._stop = list(stop)
        self._max_stop = max((len(s) for s in self._stop), default=0)
        self.text = ""        # output text so far (cut at a stop string once found)
        self._emitted = 0     # chars of self.text already handed out
        self.stopped_by: str | None = None

    def _decode(self, ids: list[int]) -> str:
        return self._decode_fn(ids, skip_special_tokens=self._skip)

    def add_token(self, token_id: int) -> str | None:
        """Append one output token; return the stop string it completed, if any."""
        if self.stopped_by is not None:
            raise RuntimeError("detokenizer already stopped")
        self._tokens.append(token_id)
        prefix = self._decode(self._tokens[self._prefix_offset:self._read_offset])
        full = self._decode(self._tokens[self._prefix_offset:])
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return None  # nothing new yet, or an incomplete multi-byte character
        old_len = len(self.text)
        self.text += full[len(prefix):]
        self._prefix_offset, self._read_offset = self._read_offset, len(self._tokens)
        if self._stop:
            return self._find_stop(old_len)
        return None

    def flush(self) -> None:
        """At the end of a request (not by a stop string), keep an incomplete trailing character.

        Generation may end in the middle of a multi-byte character; the final text then ends
        with U+FFFD exactly as decoding the whole output would, instead of losing those bytes.
        """
        if self.stopped_by is not None or self._read_offset == len(self._tokens):
            return
        prefix = self._decode(self._tokens[self._prefix_offset:self._read_offset])
        full = self._decode(self._tokens[self._prefix_offset:])
        if len(full) > len(prefix):
            self.text += full[len(prefix):]
        self._prefix_offset, self._read_offset = self._read_offset, len(self._tokens)

    def _find_stop(self, old_len: int) -> str | None:
        best: tuple[int, str] | None = None
        for s in self._stop:
            idx = self.text.find(s, max(0, old_len - len(s) + 1))
            if idx >= 0 and (best is None or idx < best[0]):
                best = (idx, s)
        if best is None:
            return None
        self.text = self.text[: best[0]]
        self.stopped_by = best[1]
        return best[1]

    def _held_back(self) -> int:
        """Length of the longest text suffix that is a proper prefix of some stop string."""
        text = self.text
        for k in range(min(self._max_stop - 1, len(text)), 0, -1):
            tail = text[-k:]
            if any(s.startswith(tail) for s in self._stop):
                return k
        return 0

    def take_new_text(self, finished: bool) -> str:
        """Text not handed out yet; while running, a possible stop-string start stays held back."""
        end = len(self.text) if (finished or not self._stop) else len(self.text) - self._held_back()
        end = max(end, self._emitted)
        new = self.text[self._emitted:end]
        self._emitted = end
        return new

    @property
    def emitted_text(self) -> str:
        return self.text[: self._emitted]
