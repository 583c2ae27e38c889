"""What every model offers the engine: its KV layout and a forward over paged KV.

A model is built from :class:`ModelArgs` (the architecture-independent numbers read from an HF
config) and then receives its weights, named as in HF checkpoints, through ``load_weights``.
``hf_state_dict`` gives them back under HF names (views, no copies) so an HF reference model can
be loaded with exactly the same tensors.
"""
from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Mapping

import torch
from torch import nn

if TYPE_CHECKING:
    from tokenmill.layers.attention import ForwardBatch


@dataclass(frozen=True)
class KVCacheSpec:
    """Shape of the KV cache one model needs; decided per model (an MLA model would differ)."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    def __post_init__(self) -> None:
        if min(self.num_layers, self.num_kv_heads, self.head_dim) <= 0:
            raise ValueError(f"KVCacheSpec sizes must be positive: {self}")

    def bytes_per_token(self) -> int:
        """K and V of one token across all layers."""
        itemsize = torch.empty(0, dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * itemsize


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

    @abc.abstractmethod
    def kv_cache_spec(self) -> KVCacheSpec:
        """The KV layout this model writes (one ``[2, pages, page_size, heads, dim]`` tensor per layer)."""

    @abc.abstractmethod
    def forward(self, batch: ForwardBatch, kv_caches: list[torch.Tensor]) -> torch.Tensor:
        """Run one step; write the new tokens' K/V; return fp32 logits ``[len(logits_indices), vocab]``."""

    @abc.abstractmethod
    def load_weights(self, weights: Mapping[str, torch.Tensor]) -> None:
        """Take every parameter from ``weights`` (HF names); raise ModelLoadError on a gap or bad shape."""

    @abc.abstractmethod
    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        """The weights under HF names (views into this model's tensors)."""
