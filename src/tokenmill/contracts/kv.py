"""What a model stores per token: the KV spec the model runner allocates from.

A model declares one entry per layer. The runner allocates the pools from the spec (through its
attention backend), the engine sizes the page pool from :meth:`KVCacheSpec.bytes_per_token`, and
the planner computes capacity from the same formula, so the three agree by construction.

Layer kinds:

* :class:`PagedKV`: standard attention, K and V of ``num_kv_heads`` heads per token.
* :class:`LatentKV`: multi-head latent attention (MLA), one compressed latent of
  ``kv_lora_rank`` plus a shared rope key of ``rope_dim`` elements per token.

* :class:`LinearState`: a linear-attention (recurrent) layer of a hybrid model. It stores
  nothing per token; each running request owns one fixed-size slot of a *state pool*: a
  recurrent state ``[num_heads, k_head_dim, v_head_dim]`` and a causal-convolution state
  ``[conv_dim, conv_kernel - 1]``, both fp32 whatever the KV dtype (the recurrence is sensitive
  to rounding). ``bytes_per_request`` is that slot's size.

A new kind is one more dataclass with ``elements_per_token`` / ``scales_per_token`` /
``bytes_per_request`` and a backend that allocates and reads it.

Storage dtypes: ``float32``, ``bfloat16``, ``float16``, ``float8_e4m3fn``, ``int8``. Entries stored
as int8 carry one fp32 scale per token and head for K and for V (``amax / 127``; one per token for
an MLA latent), counted per token like fp8's ``token`` scheme. Entries stored as fp8 carry fp32
scales, in one of two schemes (``KVCacheSpec.fp8_scales``):

* ``static`` (default): one scale per layer and KV head for K and for V (per layer for an MLA
  latent and for its rope key), calibrated at start-up. Nothing is stored per token, so fp8
  takes exactly a quarter of fp32's bytes per token.
* ``token``: one scale per token and head for K and for V, one per token for an MLA latent
  (``scales_per_token`` of them per layer, :data:`SCALE_BYTES` each, counted per token).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Union

KV_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float8_e4m3fn": 1, "int8": 1}
FP8_DTYPES = ("float8_e4m3fn",)
INT8_DTYPES = ("int8",)
SCALE_BYTES = 4
FP8_SCALE_SCHEMES = ("static", "token")

# User-facing KV dtype names (``--kv-cache-dtype`` of serve / generate, ``--kv-dtype`` of plan)
# -> storage dtype. ``auto`` (the model's dtype) is resolved by the engine.
KV_DTYPE_NAMES = {
    "fp8_e4m3": "float8_e4m3fn", "fp8": "float8_e4m3fn", "float8_e4m3fn": "float8_e4m3fn",
    "bf16": "bfloat16", "bfloat16": "bfloat16",
    "fp16": "float16", "float16": "float16",
    "fp32": "float32", "float32": "float32",
    "int8": "int8",
}


def kv_storage_dtype(name: str) -> str:
    """The storage dtype (a key of :data:`KV_DTYPE_BYTES`) for a user-facing name."""
    try:
        return KV_DTYPE_NAMES[name]
    except KeyError:
        raise ValueError(f"KV cache dtype must be one of {', '.join(KV_DTYPE_NAMES)}, got {name!r}") from None


@dataclass(frozen=True)
class PagedKV:
    """K and V heads per token (Llama, Qwen, ...)."""

    num_kv_heads: int
    head_dim: int

    def __post_init__(self) -> None:
        if min(self.num_kv_heads, self.head_dim) <= 0:
            raise ValueError(f"PagedKV sizes must be positive: {self}")

    def elements_per_token(self) -> int:
        return 2 * self.num_kv_heads * self.head_dim

    def scales_per_token(self) -> int:
        return 2 * self.num_kv_heads

    def bytes_per_request(self) -> int:
        return 0


@dataclass(frozen=True)
class LatentKV:
    """MLA: the compressed latent (``kv_lora_rank``) plus the rope key (``rope_dim``)."""

    kv_lora_rank: int
    rope_dim: int

    def __post_init__(self) -> None:
        if self.kv_lora_rank <= 0 or self.rope_dim < 0:
            raise ValueError(f"LatentKV sizes must be positive: {self}")

    def elements_per_token(self) -> int:
        return self.kv_lora_rank + self.rope_dim

    def scales_per_token(self) -> int:
        return 1

    def bytes_per_request(self) -> int:
        return 0


@dataclass(frozen=True)
class LinearState:
    """A linear-attention layer: one state-pool slot per request, nothing per token.

    ``num_heads`` counts the heads that own a recurrent state (the value heads where keys are
    shared across several); ``conv_dim`` is the number of channels of the short causal
    convolution (q, k and v together) and ``conv_kernel`` its width.
    """

    num_heads: int
    k_head_dim: int
    v_head_dim: int
    conv_dim: int
    conv_kernel: int

    STATE_BYTES = 4   # fp32

    def __post_init__(self) -> None:
        if min(self.num_heads, self.k_head_dim, self.v_head_dim, self.conv_dim) <= 0 or self.conv_kernel < 1:
            raise ValueError(f"LinearState sizes must be positive: {self}")

    def elements_per_token(self) -> int:
        return 0

    def scales_per_token(self) -> int:
        return 0

    def state_shape(self) -> tuple[int, int, int]:
        return (self.num_heads, self.k_head_dim, self.v_head_dim)

    def conv_shape(self) -> tuple[int, int]:
        return (self.conv_dim, self.conv_kernel - 1)

    def state_elements(self) -> int:
        return self.num_heads * self.k_head_dim * self.v_head_dim

    def conv_elements(self) -> int:
        return self.conv_dim * (self.conv_kernel - 1)

    def bytes_per_request(self) -> int:
        return (self.state_elements() + self.conv_elements()) * self.STATE_BYTES


LayerKV = Union[PagedKV, LatentKV, LinearState]


@dataclass(frozen=True)
class KVCacheSpec:
    """Per-layer KV entries of one model and their storage dtype."""

    layers: tuple[LayerKV, ...]
    dtype: str = "float32"
    fp8_scales: str = "static"   # fp8 only: "static" (per layer and head) or "token" (per token and head);
    #                              int8 always has per-token scales

    def __post_init__(self) -> None:
        if not self.layers:
            raise ValueError("KVCacheSpec needs at least one layer")
        if self.dtype not in KV_DTYPE_BYTES:
            raise ValueError(f"KV dtype must be one of {sorted(KV_DTYPE_BYTES)}, got {self.dtype!r}")
        if self.fp8_scales not in FP8_SCALE_SCHEMES:
            raise ValueError(f"fp8 KV scales must be one of {FP8_SCALE_SCHEMES}, got {self.fp8_scales!r}")

    @classmethod
    def dense(cls, num_layers: int, num_kv_heads: int, head_dim: int, dtype: str = "float32") -> KVCacheSpec:
        """Every layer the same standard attention."""
        if num_layers <= 0:
            raise ValueError(f"num_layers must be positive, got {num_layers}")
        return cls(tuple(PagedKV(num_kv_heads, head_dim) for _ in range(num_layers)), dtype)

    def with_dtype(self, dtype: str) -> KVCacheSpec:
        return KVCacheSpec(self.layers, dtype, self.fp8_scales)

    def with_fp8_scales(self, scheme: str) -> KVCacheSpec:
        return KVCacheSpec(self.layers, self.dtype, scheme)

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def is_fp8(self) -> bool:
        return self.dtype in FP8_DTYPES

    @property
    def is_int8(self) -> bool:
        return self.dtype in INT8_DTYPES

    @property
    def is_scaled(self) -> bool:
        """The pool stores 8-bit codes with fp32 scales (fp8 or int8)."""
        return self.is_fp8 or self.is_int8

    @property
    def per_token_scales(self) -> bool:
        """fp8 (``token`` scheme) and int8 entries carry a scale per token (and head), counted in
        :meth:`bytes_per_token`."""
        return (self.is_fp8 and self.fp8_scales == "token") or self.is_int8

    @property
    def itemsize(self) -> int:
        return KV_DTYPE_BYTES[self.dtype]

    def layer_bytes_per_token(self, layer: LayerKV) -> int:
        scales = layer.scales_per_token() * SCALE_BYTES if self.per_token_scales else 0
        return layer.elements_per_token() * self.itemsize + scales

    def bytes_per_token(self) -> int:
        """Bytes one token's entries take across all layers (per-token fp8 scales included; static
        fp8 scales are a few bytes per layer, held beside the pool like weights)."""
        return sum(self.layer_bytes_per_token(layer) for layer in self.layers)

    def bytes_per_request(self) -> int:
        """Fixed per-request state (recurrent layers); 0 for pure attention models."""
        return sum(layer.bytes_per_request() for layer in self.layers)

    @property
    def is_hybrid(self) -> bool:
        """Some layers are linear-attention layers with a per-request state slot."""
        return any(isinstance(layer, LinearState) for layer in self.layers)

    def attention_layer_ids(self) -> tuple[int, ...]:
        """Indices of the layers that keep paged KV (everything but LinearState)."""
        return tuple(i for i, layer in enumerate(self.layers) if not isinstance(layer, LinearState))

    def linear_layer_ids(self) -> tuple[int, ...]:
        """Indices of the LinearState layers (their state lives in the state pool)."""
        return tuple(i for i, layer in enumerate(self.layers) if isinstance(layer, LinearState))

    def capacity_tokens(self, memory_bytes: float, page_size: int = 1) -> int:
        """Tokens a pool of ``memory_bytes`` holds in whole pages of ``page_size`` tokens (the
        engine sizes its page pool with this; the planner reports it)."""
        if page_size <= 0:
            raise ValueError(f"page_size must be positive, got {page_size}")
        tokens = int(memory_bytes // self.bytes_per_token())
        return tokens // page_size * page_size
