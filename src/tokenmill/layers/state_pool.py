"""The state pool of a hybrid model: fixed slots of per-request recurrent and conv state.

A hybrid model's KV spec mixes attention layers (paged KV) with
:class:`~tokenmill.contracts.kv.LinearState` layers. For every LinearState layer ``i`` the pool
holds two fp32 tensors indexed by slot:

* ``rec[i]``: ``[num_slots, num_heads, k_head_dim, v_head_dim]``, the recurrent state;
* ``conv[i]``: ``[num_slots, conv_dim, conv_kernel - 1]``, the last inputs of the causal conv.

Attention layers have ``None`` in both lists. The engine hands slot numbers out (a torch-free
free list beside the page pool); a running request owns one slot from admission to release,
and ``ForwardBatch.state_slots`` names each sequence's slot in a step.
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
