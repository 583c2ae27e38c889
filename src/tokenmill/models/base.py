"""What every model offers the engine: its KV spec and a forward over a prepared context.

A model is built from :class:`ModelArgs` (the architecture-independent numbers read from an HF
config) and then receives its weights, named as in HF checkpoints, through ``load_weights``.
``hf_state_dict`` gives them back under HF names (views, no copies) so an HF reference model can
be loaded with exactly the same tensors.
"""
from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Mapping, Sequence

import torch
from torch import nn

from tokenmill.contracts.errors import ModelLoadError
from tokenmill.contracts.kv import KVCacheSpec

if TYPE_CHECKING:
    from tokenmill.layers.attention import ForwardContext

__all__ = ["CausalLM", "KVCacheSpec", "ModelArgs"]


@dataclass(frozen=True)
class ModelArgs:
    """Decoder-only transformer sizes and options, read from an HF config."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    rope_scaling: Mapping[str, Any] | None = None
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    qk_norm: bool = False
    hidden_act: str = "silu"

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim", "max_position_embeddings"):
            if getattr(self, name) <= 0:
                raise ValueError(f"model config: {name} must be positive, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"model config: num_attention_heads={self.num_heads} is not a multiple of "
                             f"num_key_value_heads={self.num_kv_heads}")
        if self.hidden_act not in ("silu", "swish"):
            raise ValueError(f"model config: hidden_act {self.hidden_act!r} is not supported (only silu)")


class CausalLM(nn.Module, abc.ABC):
    """Base class of tokenmill models."""

    args: ModelArgs

    dtype: torch.dtype

    @abc.abstractmethod
    def kv_cache_spec(self) -> KVCacheSpec:
        """What each layer stores per token (in the model's dtype; the runner may override it)."""

    @abc.abstractmethod
    def forward(self, ctx: ForwardContext) -> torch.Tensor:
        """Run one step over ``ctx.batch``; write the new tokens' KV through ``ctx.attn`` into
        ``ctx.kv_caches``; return fp32 logits ``[len(ctx.batch.logits_indices), vocab]``."""

    def chains_decode_steps(self, rows: int, attn: Any, kv_caches: Sequence[Any]) -> bool:
        """Whether :meth:`forward` can run ``ctx.decode_steps > 1`` (greedy steps chained in one
        call, ``ForwardContext.decode_steps``) for a batch of ``rows`` decode rows, one per
        sequence, on this backend and pool. No model can unless it says so."""
        return False

    @abc.abstractmethod
    def load_weights(self, weights: Mapping[str, torch.Tensor]) -> None:
        """Take every parameter from ``weights`` (HF names); raise ModelLoadError on a gap or bad shape."""

    def check_weights(self, weights: Mapping[str, Any], layout: Mapping[str, tuple[int, ...]]) -> None:
        """Refuse a checkpoint that lacks a tensor of ``layout`` (HF name -> shape), has one this
        model does not use, or has one of the wrong shape; the ModelLoadError names it."""
        missing = [n for n in layout if n not in weights]
        if missing:
            more = f" (and {len(missing) - 5} more)" if len(missing) > 5 else ""
            raise ModelLoadError(f"checkpoint is missing tensor(s) {', '.join(missing[:5])}{more}")
        ignorable = ("rotary_emb.inv_freq", "lm_head.weight")
        unexpected = [n for n in weights if n not in layout and not n.endswith(ignorable)]
        if unexpected:
            raise ModelLoadError(f"checkpoint has tensor(s) this {type(self).__name__} does not use: "
                                 f"{', '.join(sorted(unexpected)[:5])}")
        for name, shape in layout.items():
            if tuple(weights[name].shape) != shape:
                raise ModelLoadError(f"tensor {name} has shape {tuple(weights[name].shape)}, "
                                     f"expected {shape} from the model config")

    @abc.abstractmethod
    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        """The weights under HF names (views into this model's tensors)."""
