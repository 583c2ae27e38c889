"""``--log-token-ids DIR``: one JSONL record per finished request, in token ids.

Training a drafter needs the exact token sequences the model saw and produced; re-tokenized
text is not the same sequence (merges across the prompt/output boundary, special tokens, chat
markup), so this log keeps ids. Each record::

    {"model": ..., "request_id": ..., "prompt_token_ids": [...], "output_token_ids": [...],
     "finish_reason": ..., "sampling": {SamplingParams fields}, "time": unix seconds}

Records go to ``DIR/tokens-<pid>.jsonl``, appended and flushed per record (one writer per
server process; the event loop is the only caller).
"""
from __future__ import annotations

import dataclasses
import json
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any


class TokenLog:
    def __init__(self, directory: str | Path, model: str) -> None:
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.path = self.dir / f"tokens-{os.getpid()}.jsonl"
        self.model = model
        self._file = open(self.path, "a", encoding="utf-8")

    def write(self, request_id: str, prompt_token_ids: Sequence[int], output_token_ids: Sequence[int],
              finish_reason: str | None, params: Any) -> None:
        record = {"model": self.model, "request_id": request_id,
                  "prompt_token_ids": list(prompt_token_ids), "output_token_ids": list(output_token_ids),
                  "finish_reason": finish_reason,
                  "sampling": dataclasses.asdict(params) if dataclasses.is_dataclass(params) else None,
                  "time": round(time.time(), 3)}
        self._file.write(json.dumps(record, separators=(",", ":")) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()
