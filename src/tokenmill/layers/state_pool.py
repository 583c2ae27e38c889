"""The state pool of a hybrid model: fixed slots of per-request recurrent and conv state.

A hybrid model's KV spec mixes attention layers (paged KV) with
:class:`~tokenmill.contracts.kv.LinearState` layers. For every LinearState layer ``i`` the pool
holds two fp32 tensors indexed by slot:

* ``rec[i]``: ``[num_slots, num_heads, k_head_dim, v_head_dim]``, the recurrent state;
* ``conv[i]``: ``[num_slots, conv_dim, conv_kernel - 1]``, the last inputs of the causal conv.

Attention layers have ``None`` in both lists. The engine hands slot numbers out (a torch-free
free list beside the page pool); a running request owns one slot from admission to release,
and ``ForwardBatch.state_slots`` names each sequence's slot in a step.

Speculative verification: a step that feeds a request ``1 + k`` tokens (its last token and k
drafts) advances the slot through all of them, but only the first ``1 + accepted`` may stay.
Before such a step the model runner names the verify sequences (:meth:`begin_verify`); each
linear layer then keeps, for those sequences only, the recurrent state after every position
and the conv inputs of the chunk (:meth:`keep_verify`). After verification
:meth:`commit_verify` writes, for each, the state after its last kept position into its slot,
so the slot ends exactly as if only the accepted tokens had been fed.
"""
from __future__ import annotations

import torch

from tokenmill.contracts.kv import KVCacheSpec, LinearState


class StatePool:
    def __init__(self, spec: KVCacheSpec, num_slots: int, device: torch.device | str = "cpu") -> None:
        if num_slots <= 0:
            raise ValueError(f"a state pool needs at least one slot, got {num_slots}")
        self.spec = spec
        self.num_slots = num_slots
        self.device = torch.device(device)
        self.rec: list[torch.Tensor | None] = []
        self.conv: list[torch.Tensor | None] = []
        for layer in spec.layers:
            if isinstance(layer, LinearState):
                self.rec.append(torch.zeros((num_slots, *layer.state_shape()), dtype=torch.float32, device=self.device))
                self.conv.append(torch.zeros((num_slots, *layer.conv_shape()), dtype=torch.float32, device=self.device))
            else:
                self.rec.append(None)
                self.conv.append(None)
        # the current verify step (None: none): batch rows, slots and chunk lengths, and per
        # linear layer the kept states [n, L-1, H, Dk, Dv] and conv windows [n, C, K-1+L]
        self.verify_rows: list[int] | None = None
        self._verify_slots: list[int] = []
        self._verify_lens: list[int] = []
        self._kept_rec: dict[int, torch.Tensor] = {}
        self._kept_conv: dict[int, torch.Tensor] = {}

    @property
    def bytes_per_slot(self) -> int:
        return self.spec.bytes_per_request()

    @property
    def nbytes(self) -> int:
        return self.bytes_per_slot * self.num_slots

    def zero(self, slot: int) -> None:
        """Reset one slot (a request starting from position 0)."""
        for rec, conv in zip(self.rec, self.conv):
            if rec is not None:
                rec[slot].zero_()
                conv[slot].zero_()

    def copy(self, src: int, dst: int) -> None:
        """Copy slot ``src`` into slot ``dst`` across every linear layer."""
        for rec, conv in zip(self.rec, self.conv):
            if rec is not None:
                rec[dst].copy_(rec[src])
                conv[dst].copy_(conv[src])

    # -- speculative verification ------------------------------------------------------------
    def begin_verify(self, rows: list[int], slots: list[int], lens: list[int]) -> None:
        """The next step verifies drafts for batch sequences ``rows`` (their ``slots``, their
        chunk lengths ``lens``); an empty ``rows`` means a step without drafts."""
        self.verify_rows = list(rows) if rows else None
        self._verify_slots, self._verify_lens = list(slots), list(lens)
        self._kept_rec, self._kept_conv = {}, {}

    def keep_verify_states(self, layer_idx: int, states: torch.Tensor) -> None:
        """Layer ``layer_idx``'s recurrent state after each chunk position but the last of the
        verify sequences, ``[n, L-1, H, Dk, Dv]`` in ``verify_rows`` order (L: the longest chunk;
        a chunk's last state is its final one, already in its slot)."""
        self._kept_rec[layer_idx] = states

    def keep_verify_conv(self, layer_idx: int, window: torch.Tensor) -> None:
        """Layer ``layer_idx``'s conv windows of the verify sequences, ``[n, C, K-1+L]``: the
        conv state before the chunk, then the chunk's inputs."""
        self._kept_conv[layer_idx] = window

    def commit_verify(self, keep: list[int]) -> None:
        """Leave each verify sequence's slot holding the state after its first ``keep[j]`` chunk
        tokens (``1 <= keep[j] <= len``); ends the verify step."""
        if self.verify_rows is None:
            return
        if len(keep) != len(self._verify_slots):
            raise ValueError(f"commit_verify needs one count per verify sequence ({len(self._verify_slots)}), "
                             f"got {len(keep)}")
        todo = [(j, n) for j, n in enumerate(keep) if n < self._verify_lens[j]]
        for n in (n for _, n in todo):
            if n < 1:
                raise ValueError(f"a verify sequence keeps at least its first token, got {n}")
        missing = [i for i, r in enumerate(self.rec)
                   if r is not None and (i not in self._kept_rec or i not in self._kept_conv)]
        if todo and missing:
            raise RuntimeError(f"linear layers {missing} kept no verify states this step")
        if todo:
            js = torch.tensor([j for j, _ in todo], dtype=torch.int64, device=self.device)
            at = torch.tensor([n - 1 for _, n in todo], dtype=torch.int64, device=self.device)
            slots = torch.tensor([self._verify_slots[j] for j, _ in todo], dtype=torch.int64, device=self.device)
            for i, rec in enumerate(self.rec):
                if rec is None:
                    continue
                rec.index_copy_(0, slots, self._kept_rec[i][js, at].to(rec.dtype))
                conv = self.conv[i]
                w1 = conv.shape[-1]
                # the last K-1 inputs after n tokens: window columns n .. n + K-2
                cols = (at + 1)[:, None] + torch.arange(w1, device=self.device)[None, :]     # [m, K-1]
                win = self._kept_conv[i][js]                                                # [m, C, K-1+L]
                picked = win.gather(2, cols[:, None, :].expand(-1, win.shape[1], -1))
                conv.index_copy_(0, slots, picked.to(conv.dtype))
        self.verify_rows = None
        self._kept_rec, self._kept_conv = {}, {}
