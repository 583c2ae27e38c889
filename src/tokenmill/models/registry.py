"""Model registry keyed by HF architecture name (``config.architectures[0]``)."""
from __future__ import annotations

from typing import Any, Callable, NamedTuple

import torch

from tokenmill.layers.rotary import SUPPORTED_ROPE_TYPES
from tokenmill.contracts.errors import ModelLoadError
from tokenmill.models.base import CausalLM, ModelArgs
from tokenmill.models.llama import LlamaForCausalLM


def _rope(config: Any) -> tuple[float, dict[str, Any] | None]:
    """(theta, scaling dict or None) from either ``rope_parameters`` (transformers 5) or the older
    ``rope_theta`` + ``rope_scaling`` attributes."""
    params = getattr(config, "rope_parameters", None) or {}
    if isinstance(params, dict) and params and not all(isinstance(v, dict) for v in params.values()):
        theta = float(params.get("rope_theta", getattr(config, "rope_theta", 10000.0)))
        rope = dict(params)
    else:
        theta = float(getattr(config, "rope_theta", 10000.0))
        rope = dict(getattr(config, "rope_scaling", None) or {})
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ModelLoadError(f"rope type {rope_type!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}")
    return theta, (rope if rope_type != "default" else None)


def _common(config: Any, **options: Any) -> ModelArgs:
    heads = int(config.num_attention_heads)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    theta, scaling = _rope(config)
    if getattr(config, "mlp_bias", False):
        raise ModelLoadError("config sets mlp_bias=true, which tokenmill's Llama does not support")
    if getattr(config, "use_sliding_window", False):
        raise ModelLoadError("config sets use_sliding_window=true; sliding-window attention is not supported")
    try:
        return ModelArgs(
            vocab_size=int(config.vocab_size), hidden_size=int(config.hidden_size),
            intermediate_size=int(config.intermediate_size), num_layers=int(config.num_hidden_layers),
            num_heads=heads, num_kv_heads=int(getattr(config, "num_key_value_heads", None) or heads),
            head_dim=int(head_dim), rms_norm_eps=float(config.rms_norm_eps), rope_theta=theta,
            max_position_embeddings=int(config.max_position_embeddings), rope_scaling=scaling,
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            hidden_act=str(getattr(config, "hidden_act", "silu")), **options)
    except (AttributeError, TypeError, ValueError) as e:
        raise ModelLoadError(f"invalid model config: {e}") from e


class Architecture(NamedTuple):
    model_class: type[CausalLM]
    args_from_config: Callable[[Any], ModelArgs]


ARCHITECTURES: dict[str, Architecture] = {
    "LlamaForCausalLM": Architecture(LlamaForCausalLM, lambda c: _common(
        c, qkv_bias=bool(getattr(c, "attention_bias", False)))),
    "Qwen2ForCausalLM": Architecture(LlamaForCausalLM, lambda c: _common(c, qkv_bias=True)),
    "Qwen3ForCausalLM": Architecture(LlamaForCausalLM, lambda c: _common(
        c, qkv_bias=bool(getattr(c, "attention_bias", False)), qk_norm=True)),
}


def supported_architectures() -> list[str]:
    return sorted(ARCHITECTURES)


def architecture_of(config: Any) -> str:
    archs = getattr(config, "architectures", None) or []
    if not archs:
        raise ModelLoadError("model config has no 'architectures' entry; supported: "
                             + ", ".join(supported_architectures()))
    arch = archs[0]
    if arch not in ARCHITECTURES:
        raise ModelLoadError(f"unsupported architecture {arch!r}; supported: {', '.join(supported_architectures())}")
    return arch


def build_model(config: Any, dtype: torch.dtype = torch.float32, device: str = "cpu") -> CausalLM:
    """An empty (weightless) model for an HF config; call ``load_weights`` next."""
    arch = ARCHITECTURES[architecture_of(config)]
    return arch.model_class(arch.args_from_config(config), dtype=dtype, device=device)
