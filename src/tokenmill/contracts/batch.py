"""One engine step's tokens: what the model runner hands the attention backend and the model.

``T`` tokens from ``B`` sequences, concatenated in sequence order. Each sequence contributes a
query chunk ``[query_start_loc[i], query_start_loc[i+1])`` whose tokens are the *last* ones of
its context: after the step the sequence holds ``seq_lens[i]`` tokens, whose pages are listed
in ``block_tables[i]``. A query at context position ``p`` attends to every token at ``<= p``.
The token at slot ``s = page_id * page_size + offset`` lives in page ``s // page_size``.

The fields are tensors on the runner's device; this module only names them (no torch import).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


@dataclass
class ForwardBatch:
    """All tokens scheduled in one engine step (prefill chunks and decodes mixed).

    ``logits_indices`` picks the rows of ``T`` that produce logits (usually the last token of
    each sequence; any rows may be chosen, e.g. every draft position for speculation or the
    prompt rows for prompt logprobs).
    """

    input_ids: torch.Tensor        # [T] int64
    positions: torch.Tensor        # [T] int64
    slot_mapping: torch.Tensor     # [T] int64: page_id * page_size + offset for each new entry
    query_start_loc: torch.Tensor  # [B+1] int64, cumulative query lengths, starts at 0
    seq_lens: torch.Tensor         # [B] int64, context length after this step
    block_tables: torch.Tensor     # [B, max_pages] int64 page ids, padded with 0
    logits_indices: torch.Tensor   # [N] int64 rows of T that produce logits
    page_size: int
    max_seq_len: int = 0           # max(seq_lens) when known (0: not given), saves a device read
    # Hybrid models only: the state-pool slot of each sequence, [B] int64 (None otherwise). A
    # sequence whose chunk starts at position 0 starts from a zero state; any other reads the
    # slot (left there by its previous step, or restored from a prefix-cache snapshot).
    state_slots: torch.Tensor | None = None

    def __post_init__(self) -> None:
        t = self.input_ids.shape[0]
        b = self.seq_lens.shape[0]
        if self.page_size <= 0:
            raise ValueError(f"page_size must be positive, got {self.page_size}")
        if tuple(self.positions.shape) != (t,) or tuple(self.slot_mapping.shape) != (t,):
            raise ValueError(
                f"input_ids, positions and slot_mapping must all be [T]; got {tuple(self.input_ids.shape)}, "
                f"{tuple(self.positions.shape)}, {tuple(self.slot_mapping.shape)}")
        if tuple(self.query_start_loc.shape) != (b + 1,):
            raise ValueError(f"query_start_loc must be [B+1]={b + 1}, got {tuple(self.query_start_loc.shape)}")
        if self.block_tables.dim() != 2 or self.block_tables.shape[0] != b:
            raise ValueError(f"block_tables must be [B={b}, max_pages], got {tuple(self.block_tables.shape)}")

    @property
    def num_seqs(self) -> int:
        return int(self.seq_lens.shape[0])

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])
