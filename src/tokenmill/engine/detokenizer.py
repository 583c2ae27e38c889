"""Incremental detokenization with stop strings.

Decoding one token at a time is wrong for byte-level BPE (a character may span tokens) and for
tokenizers whose spacing depends on the previous token. :class:`IncrementalDetokenizer` decodes
a short window of previous tokens plus the new ones and keeps only the text that is new and
complete (no trailing U+FFFD), so the concatenated deltas equal the decoded whole.

Stop strings are searched in the full output text as it grows, so a stop string split across
tokens is still found; the text from the stop string on is cut. While a request runs, text that
could be the start of a stop string is held back (not yet emitted); it is released as soon as it
cannot be, or when the request finishes.

Text is stored as the list of emitted pieces plus a short pending tail (new text not yet
handed out, or held back). A step costs time in the size of its new text only: the full text
is joined when someone asks for it (:attr:`text`, :meth:`emitted_view`).
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
        self._pieces: list[str] = []   # text handed out so far, one piece per take_new_text
        self._pending = ""             # text after that (cut at a stop string once found)
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
        old_len = len(self._pending)
        self._pending += full[len(prefix):]
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
            self._pending += full[len(prefix):]
        self._prefix_offset, self._read_offset = self._read_offset, len(self._tokens)

    def _find_stop(self, old_len: int) -> str | None:
        # A stop string can only start in the pending text: emitted text never ends with the
        # start of one (that part is held back), so the search never looks further back.
        best: tuple[int, str] | None = None
        for s in self._stop:
            idx = self._pending.find(s, max(0, old_len - len(s) + 1))
            if idx >= 0 and (best is None or idx < best[0]):
                best = (idx, s)
        if best is None:
            return None
        self._pending = self._pending[: best[0]]
        self.stopped_by = best[1]
        return best[1]

    def _held_back(self) -> int:
        """Length of the longest pending suffix that is a proper prefix of some stop string."""
        text = self._pending
        for k in range(min(self._max_stop - 1, len(text)), 0, -1):
            tail = text[-k:]
            if any(s.startswith(tail) for s in self._stop):
                return k
        return 0

    def take_new_text(self, finished: bool) -> str:
        """Text not handed out yet; while running, a possible stop-string start stays held back."""
        keep = 0 if (finished or not self._stop) else self._held_back()
        new = self._pending[: len(self._pending) - keep]
        if new:
            self._pieces.append(new)
            self._pending = self._pending[len(new):]
        return new

    @property
    def text(self) -> str:
        """All output text so far, held-back text included (cut at a stop string)."""
        return "".join(self._pieces) + self._pending

    @property
    def emitted_text(self) -> str:
        return "".join(self._pieces)

    def emitted_view(self) -> TextView:
        """The emitted text as of now, joined only if read (O(1) to take)."""
        return TextView(self._pieces, len(self._pieces))


class TextView:
    """A snapshot of a growing list of text pieces: the first ``n`` of them, joined on demand."""

    __slots__ = ("_pieces", "_n", "_joined")

    def __init__(self, pieces: list[str], n: int) -> None:
        self._pieces, self._n, self._joined = pieces, n, None

    def __str__(self) -> str:
        if self._joined is None:
            self._joined = "".join(self._pieces[: self._n])
        return self._joined
