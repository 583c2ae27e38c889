"""Attention backends over the paged KV pool (see :mod:`.base` for the interface).

* ``torch`` (:mod:`.torch_ref`): plain torch ops, any device; the correctness reference for
  :class:`~tokenmill.contracts.kv.PagedKV` specs (K/V heads), fp8 pages included.
* ``native`` (:mod:`.native`): the CPU kernel of ``tokenmill._native``, reading pages in place.
* ``mla-torch`` (:mod:`.mla`): multi-head latent attention for
  :class:`~tokenmill.contracts.kv.LatentKV` specs (latent + rope key; absorbed decode); chosen
  for every LatentKV spec.

:func:`select_attention_backend` picks one for a KV spec and a device at start-up.
"""
from __future__ import annotations

import torch

from tokenmill.contracts.batch import ForwardBatch
from tokenmill.contracts.kv import KVCacheSpec, LatentKV
from tokenmill.layers.attention.base import AttentionBackend, ForwardContext, attention_kinds
from tokenmill.layers.attention.fp8 import FP8Pages, fp8_supported
from tokenmill.layers.attention.mla import MLAAttention
from tokenmill.layers.attention.torch_ref import AttentionMetadata, PrefillSegment, TorchPagedAttention

BACKENDS = ("auto", "torch", "native")


def select_attention_backend(spec: KVCacheSpec, device: torch.device | str = "cpu",
                             compute_dtype: torch.dtype = torch.float32, name: str = "auto") -> AttentionBackend:
    """The attention implementation for ``spec`` on ``device``, chosen once at start-up.

    ``auto`` takes the native CPU kernel when it is built and supports the spec, else torch;
    LatentKV specs (MLA) get :class:`MLAAttention`. An fp8 spec on a device whose torch cannot
    convert float8_e4m3fn is refused here.
    """
    device = torch.device(device)
    if name not in BACKENDS:
        raise ValueError(f"attention backend must be one of {BACKENDS}, got {name!r}")
    if spec.is_fp8 and not fp8_supported(device):
        raise ValueError(f"KV cache dtype {spec.dtype} is not supported on device {device} by this torch "
                         f"build ({torch.__version__}); use --kv-cache-dtype bf16 or fp32")
    if name in ("auto", "native"):
        from tokenmill.layers.attention import native

        reason = native.unsupported_reason(spec, device, compute_dtype)
        if reason is None:
            return native.NativePagedAttention(spec, device, compute_dtype)
        if name == "native":
            raise ValueError(f"the native attention backend cannot run here: {reason}")
    if any(isinstance(layer, LatentKV) for layer in attention_kinds(spec)):
        return MLAAttention(spec, device, compute_dtype)
    return TorchPagedAttention(spec, device, compute_dtype)


__all__ = ["AttentionBackend", "AttentionMetadata", "BACKENDS", "FP8Pages", "ForwardBatch", "ForwardContext",
           "MLAAttention", "PrefillSegment", "TorchPagedAttention", "select_attention_backend"]
