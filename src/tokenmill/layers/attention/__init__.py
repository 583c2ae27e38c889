"""Attention backends over the paged KV pool (see :mod:`.base` for the interface).

* ``torch`` (:mod:`.torch_ref`): plain torch ops, any device; the correctness reference.
* ``native`` (:mod:`.native`): the CPU kernel of ``tokenmill._native``, reading pages in place.

:func:`select_attention_backend` picks one for a KV spec and a device at start-up.
"""
from __future__ import annotations

import torch

from tokenmill.contracts.batch import ForwardBatch
from tokenmill.contracts.kv import KVCacheSpec
from tokenmill.layers.attention.base import AttentionBackend, ForwardContext
from tokenmill.layers.attention.torch_ref import AttentionMetadata, PrefillSegment, TorchPagedAttention

BACKENDS = ("auto", "torch", "native")


def select_attention_backend(spec: KVCacheSpec, device: torch.device | str = "cpu",
                             compute_dtype: torch.dtype = torch.float32, name: str = "auto") -> AttentionBackend:
    """The attention implementation for ``spec`` on ``device``, chosen once at start-up.

    ``auto`` takes the native CPU kernel when it is built and supports the spec, else torch.
    """
    device = torch.device(device)
    if name not in BACKENDS:
        raise ValueError(f"attention backend must be one of {BACKENDS}, got {name!r}")
    if name in ("auto", "native"):
        from tokenmill.layers.attention import native

        reason = native.unsupported_reason(spec, device, compute_dtype)
        if reason is None:
            return native.NativePagedAttention(spec, device, compute_dtype)
        if name == "native":
            raise ValueError(f"the native attention backend cannot run here: {reason}")
    return TorchPagedAttention(spec, device, compute_dtype)


__all__ = ["AttentionBackend", "AttentionMetadata", "BACKENDS", "ForwardBatch", "ForwardContext",
           "PrefillSegment", "TorchPagedAttention", "select_attention_backend"]
