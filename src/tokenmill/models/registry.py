"""Model registry keyed by HF architecture name (``config.architectures[0]``)."""
from __future__ import annotations

from typing import Any, Callable, NamedTuple

import torch

from tokenmill.layers.rotary import SUPPORTED_ROPE_TYPES
from tokenmill.contracts.errors import ModelLoadError
from tokenmill.models.bailing_hybrid import BailingHybridArgs, BailingHybridForCausalLM
from tokenmill.models.base import CausalLM, ModelArgs
from tokenmill.models.deepseek_v3 import DeepseekV3Args, DeepseekV3ForCausalLM
from tokenmill.models.llama import LlamaForCausalLM
from tokenmill.models.qwen3_next import Qwen3NextArgs, Qwen3NextForCausalLM


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
    if rope_type in ("yarn", "llama3"):  # HF's defaults for the pretraining length and YaRN's factor
        rope.setdefault("original_max_position_embeddings", int(config.max_position_embeddings))
        if rope_type == "yarn" and rope.get("factor") is None:
            rope["factor"] = config.max_position_embeddings / rope["original_max_position_embeddings"]
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


# DeepSeek config fields outside HF's DeepseekV3Config that original checkpoints carry; only
# the values HF's implementation computes are accepted.
_DEEPSEEK_FIXED = {"topk_method": ("noaux_tc",), "scoring_func": ("sigmoid",), "moe_layer_freq": (1,)}


def _deepseek_v3(config: Any) -> DeepseekV3Args:
    """DeepseekV3Args from a DeepseekV3Config; refuses values the math here does not implement."""
    quant = getattr(config, "quantization_config", None)
    if quant:
        method = quant.get("quant_method") if isinstance(quant, dict) else getattr(quant, "quant_method", quant)
        raise ModelLoadError(f"config sets quantization_config (quant_method={method!r}): quantized DeepSeek-V3 "
                             "checkpoints are not supported; use a bf16/fp32 checkpoint")
    for name, allowed in _DEEPSEEK_FIXED.items():
        value = getattr(config, name, allowed[0])
        if value not in allowed:
            raise ModelLoadError(f"config sets {name}={value!r}, which is not supported for DeepseekV3ForCausalLM "
                                 f"(supported: {', '.join(map(repr, allowed))})")
    if getattr(config, "hidden_act", "silu") not in ("silu", "swish"):
        raise ModelLoadError(f"config sets hidden_act={config.hidden_act!r}; only silu is supported")
    theta, scaling = _rope(config)

    def opt_int(name: str, default: int) -> int:
        value = getattr(config, name, None)
        return default if value is None else int(value)

    try:
        q_lora = getattr(config, "q_lora_rank", None)
        return DeepseekV3Args(
            vocab_size=int(config.vocab_size), hidden_size=int(config.hidden_size),
            intermediate_size=int(config.intermediate_size), moe_intermediate_size=int(config.moe_intermediate_size),
            num_layers=int(config.num_hidden_layers), num_heads=int(config.num_attention_heads),
            q_lora_rank=None if q_lora is None else int(q_lora), kv_lora_rank=int(config.kv_lora_rank),
            qk_nope_head_dim=int(config.qk_nope_head_dim), qk_rope_head_dim=int(config.qk_rope_head_dim),
            v_head_dim=int(config.v_head_dim), rope_interleave=bool(getattr(config, "rope_interleave", True)),
            rms_norm_eps=float(config.rms_norm_eps), rope_theta=theta,
            max_position_embeddings=int(config.max_position_embeddings), rope_scaling=scaling,
            n_routed_experts=int(config.n_routed_experts), num_experts_per_tok=opt_int("num_experts_per_tok", 1),
            n_shared_experts=opt_int("n_shared_experts", 0), first_k_dense_replace=opt_int("first_k_dense_replace", 0),
            n_group=opt_int("n_group", 1), topk_group=opt_int("topk_group", 1),
            norm_topk_prob=bool(getattr(config, "norm_topk_prob", False)),
            routed_scaling_factor=float(getattr(config, "routed_scaling_factor", 1.0)),
            attention_bias=bool(getattr(config, "attention_bias", False)),
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            num_mtp_layers=opt_int("num_nextn_predict_layers", 0))
    except (AttributeError, TypeError) as e:
        raise ModelLoadError(f"invalid DeepSeek-V3 config: {e}") from e


def _bailing_hybrid(config: Any) -> BailingHybridArgs:
    """BailingHybridArgs from a BailingHybridConfig (Ling); refuses values the math here does not
    implement, naming the field."""
    quant = getattr(config, "quantization_config", None)
    if quant:
        raise ModelLoadError("config sets quantization_config: quantized BailingHybrid checkpoints are not "
                             "supported; use a bf16/fp32 checkpoint")
    if getattr(config, "hidden_act", "silu") not in ("silu", "swish"):
        raise ModelLoadError(f"config sets hidden_act={config.hidden_act!r}; only silu is supported "
                             "(BailingHybrid uses it for the MLPs and the KDA convolutions)")
    heads = int(config.num_attention_heads)
    kv_heads = getattr(config, "num_key_value_heads", None)
    if kv_heads is not None and int(kv_heads) != heads:
        raise ModelLoadError(f"config sets num_key_value_heads={kv_heads}; BailingHybrid's MLA expands one "
                             f"key/value head per query head, so it must equal num_attention_heads={heads}")
    if getattr(config, "tie_word_embeddings", False):
        raise ModelLoadError("config sets tie_word_embeddings=true; HF's BailingHybridForCausalLM keeps lm_head "
                             "separate, so a tied checkpoint is not supported")
    theta, scaling = _rope(config)
    params = getattr(config, "rope_parameters", None)
    partial = (params or {}).get("partial_rotary_factor") if isinstance(params, dict) else None
    partial = partial if partial is not None else getattr(config, "partial_rotary_factor", None)
    if partial is not None and float(partial) != 1.0:
        raise ModelLoadError(f"config sets partial_rotary_factor={partial}; BailingHybrid's MLA ropes the whole "
                             "qk_rope_head_dim, only 1.0 is supported")
    n = int(config.num_hidden_layers)
    group = int(getattr(config, "layer_group_size", 0) or 0)
    layer_types = getattr(config, "layer_types", None)
    if layer_types is None:
        if group <= 0:
            raise ModelLoadError(f"config sets layer_group_size={group!r}; it must be positive")
        layer_types = ["full_attention" if (i + 1) % group == 0 else "linear_attention" for i in range(n)]
    first_dense = int(getattr(config, "first_k_dense_replace", 0) or 0)
    mlp_types = getattr(config, "mlp_layer_types", None) or [
        "dense" if i < first_dense else "sparse" for i in range(n)]
    sparse = [i for i, t in enumerate(mlp_types) if t == "sparse"]

    def opt_int(name: str, default: int) -> int:
        value = getattr(config, name, None)
        return default if value is None else int(value)

    try:
        mla = DeepseekV3Args(
            vocab_size=int(config.vocab_size), hidden_size=int(config.hidden_size),
            intermediate_size=int(config.intermediate_size), moe_intermediate_size=int(config.moe_intermediate_size),
            num_layers=n, num_heads=heads, q_lora_rank=None, kv_lora_rank=int(config.kv_lora_rank),
            qk_nope_head_dim=int(config.qk_nope_head_dim), qk_rope_head_dim=int(config.qk_rope_head_dim),
            v_head_dim=int(config.v_head_dim), rope_interleave=True, rms_norm_eps=float(config.rms_norm_eps),
            rope_theta=theta, max_position_embeddings=int(config.max_position_embeddings), rope_scaling=scaling,
            n_routed_experts=opt_int("num_local_experts", 0), num_experts_per_tok=opt_int("num_experts_per_tok", 1),
            n_shared_experts=opt_int("n_shared_experts", 0),
            first_k_dense_replace=sparse[0] if sparse else n,   # MoE sizes are validated when any layer is sparse
            n_group=opt_int("n_group", 1), topk_group=opt_int("topk_group", 1),
            norm_topk_prob=bool(getattr(config, "norm_topk_prob", True)),
            routed_scaling_factor=float(getattr(config, "routed_scaling_factor", 1.0)),
            attention_bias=bool(getattr(config, "attention_bias", False)), tie_word_embeddings=False,
            num_mtp_layers=opt_int("num_mtp_layers", 0), hidden_act=str(getattr(config, "hidden_act", "silu")))
        return BailingHybridArgs(
            mla=mla, layer_types=tuple(layer_types), mlp_layer_types=tuple(mlp_types),
            linear_num_heads=opt_int("linear_num_heads", heads),
            linear_head_dim=int(getattr(config, "linear_head_dim", None) or config.head_dim),
            conv_kernel=int(getattr(config, "linear_conv_kernel_dim", None) or config.short_conv_kernel_size),
            kda_safe_gate=bool(getattr(config, "kda_safe_gate", True)),
            kda_lower_bound=float(getattr(config, "kda_lower_bound", -5.0)))
    except (AttributeError, TypeError) as e:
        raise ModelLoadError(f"invalid BailingHybrid config: {e}") from e


def _qwen3_next(config: Any) -> Qwen3NextArgs:
    """Qwen3NextArgs from a Qwen3NextConfig; refuses values the math here does not implement."""
    quant = getattr(config, "quantization_config", None)
    if quant:
        method = quant.get("quant_method") if isinstance(quant, dict) else getattr(quant, "quant_method", quant)
        raise ModelLoadError(f"config sets quantization_config (quant_method={method!r}): quantized Qwen3-Next "
                             "checkpoints are not supported; use a bf16/fp32 checkpoint")
    if getattr(config, "hidden_act", "silu") not in ("silu", "swish"):
        raise ModelLoadError(f"config sets hidden_act={config.hidden_act!r}; only silu is supported")
    theta, scaling = _rope(config)
    params = getattr(config, "rope_parameters", None) or {}
    partial = params.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 0.25)) \
        if isinstance(params, dict) else getattr(config, "partial_rotary_factor", 0.25)
    if scaling is not None:
        scaling = {k: v for k, v in scaling.items() if k != "partial_rotary_factor"}
    types = list(getattr(config, "layer_types", None) or [])
    if len(types) < int(config.num_hidden_layers):
        raise ModelLoadError(f"config sets layer_types with {len(types)} entries for num_hidden_layers="
                             f"{config.num_hidden_layers}; it needs one per layer")
    try:
        heads = int(config.num_attention_heads)
        return Qwen3NextArgs(
            vocab_size=int(config.vocab_size), hidden_size=int(config.hidden_size),
            intermediate_size=int(config.intermediate_size), num_heads=heads,
            num_kv_heads=int(getattr(config, "num_key_value_heads", None) or heads),
            head_dim=int(getattr(config, "head_dim", None) or config.hidden_size // heads),
            rms_norm_eps=float(config.rms_norm_eps), rope_theta=theta,
            max_position_embeddings=int(config.max_position_embeddings),
            layer_types=tuple(config.layer_types)[:int(config.num_hidden_layers)],
            linear_num_key_heads=int(config.linear_num_key_heads),
            linear_num_value_heads=int(config.linear_num_value_heads),
            linear_key_head_dim=int(config.linear_key_head_dim), linear_value_head_dim=int(config.linear_value_head_dim),
            linear_conv_kernel_dim=int(config.linear_conv_kernel_dim),
            num_experts=int(getattr(config, "num_experts", 0) or 0),
            num_experts_per_tok=int(getattr(config, "num_experts_per_tok", 1) or 1),
            moe_intermediate_size=int(getattr(config, "moe_intermediate_size", 0) or 0),
            shared_expert_intermediate_size=int(getattr(config, "shared_expert_intermediate_size", 0) or 0),
            norm_topk_prob=bool(getattr(config, "norm_topk_prob", True)),
            decoder_sparse_step=int(getattr(config, "decoder_sparse_step", 1) or 1),
            mlp_only_layers=tuple(int(i) for i in (getattr(config, "mlp_only_layers", None) or ())),
            partial_rotary_factor=float(partial), rope_scaling=scaling,
            attention_bias=bool(getattr(config, "attention_bias", False)),
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)))
    except (AttributeError, TypeError) as e:
        raise ModelLoadError(f"invalid Qwen3-Next config: {e}") from e


class Architecture(NamedTuple):
    model_class: type[CausalLM]
    args_from_config: Callable[[Any], Any]


ARCHITECTURES: dict[str, Architecture] = {
    "LlamaForCausalLM": Architecture(LlamaForCausalLM, lambda c: _common(
        c, qkv_bias=bool(getattr(c, "attention_bias", False)))),
    "Qwen2ForCausalLM": Architecture(LlamaForCausalLM, lambda c: _common(c, qkv_bias=True)),
    "Qwen3ForCausalLM": Architecture(LlamaForCausalLM, lambda c: _common(
        c, qkv_bias=bool(getattr(c, "attention_bias", False)), qk_norm=True)),
    "DeepseekV3ForCausalLM": Architecture(DeepseekV3ForCausalLM, _deepseek_v3),  # also Kimi K2
    "BailingHybridForCausalLM": Architecture(BailingHybridForCausalLM, _bailing_hybrid),  # Ling
    "Qwen3NextForCausalLM": Architecture(Qwen3NextForCausalLM, _qwen3_next),      # hybrid: GDN + attention
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
