"""Model configs of the Llama family without transformers' per-model config classes.

Importing ``transformers.LlamaConfig`` (or any model's config class) imports
``transformers.activations``, which pulls in ``torch._dynamo`` and ``torch.distributed.tensor``:
about 2 s of every ``tokenmill serve`` start on a 2-core machine, for a class whose only job here
is to fill in defaults. For the dense Llama-family architectures (``LlamaForCausalLM``,
``Qwen2ForCausalLM``, ``Qwen3ForCausalLM``) the loader builds a ``transformers.PretrainedConfig``
(the base class, which the tokenizer loader imports anyway) from config.json over the defaults
of the model type's class, listed below. ``tests/loader/test_light_config.py`` checks the table
against the classes' own defaults and checks that every field the models read comes out the
same as through the class. Other architectures keep their transformers class.

:func:`hf_config` turns such a config into the model type's own transformers class (for the
oracle tests' HF models; it pays the import then). ``TOKENMILL_CONFIG_CLASSES=1`` makes the loader
use the transformers classes for every architecture (for A/B checks, ``benchmarks/startup.py``).
"""
from __future__ import annotations

import os
from typing import Any

# model type -> the defaults of its transformers config class (5.x) for every field a config.json
# may leave out and tokenmill reads; None means "derived" (see light_config)
LIGHT_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": dict(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                  num_attention_heads=32, num_key_value_heads=None, head_dim=None, hidden_act="silu",
                  max_position_embeddings=2048, rms_norm_eps=1e-6, tie_word_embeddings=False,
                  attention_bias=False, mlp_bias=False, bos_token_id=1, eos_token_id=2, pad_token_id=None),
    "qwen2": dict(vocab_size=151936, hidden_size=4096, intermediate_size=22016, num_hidden_layers=32,
                  num_attention_heads=32, num_key_value_heads=32, hidden_act="silu",
                  max_position_embeddings=32768, rms_norm_eps=1e-6, tie_word_embeddings=False,
                  use_sliding_window=False, bos_token_id=None, eos_token_id=None, pad_token_id=None),
    "qwen3": dict(vocab_size=151936, hidden_size=4096, intermediate_size=22016, num_hidden_layers=32,
                  num_attention_heads=32, num_key_value_heads=32, head_dim=128, hidden_act="silu",
                  max_position_embeddings=32768, rms_norm_eps=1e-6, tie_word_embeddings=False,
                  attention_bias=False, use_sliding_window=False, bos_token_id=None, eos_token_id=None,
                  pad_token_id=None),
}
LIGHT_ARCHITECTURES = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3"}
_NOT_FIELDS = ("model_type", "transformers_version", "auto_map")
_DEFAULT_ROPE_THETA = 10000.0   # every class above, when neither rope_parameters nor rope_theta is given


def light_config(raw: dict[str, Any]) -> Any:
    """A ``PretrainedConfig`` for config.json contents ``raw`` of a Llama-family model (with its
    class's defaults and derived fields), or None when ``raw`` is of another type or architecture.
    Raises ValueError / TypeError for fields of the wrong type."""
    model_type = raw.get("model_type")
    archs = raw.get("architectures") or []
    if os.environ.get("TOKENMILL_CONFIG_CLASSES") == "1":   # A/B switch: transformers' classes throughout
        return None
    if model_type not in LIGHT_DEFAULTS or not archs or LIGHT_ARCHITECTURES.get(archs[0]) != model_type:
        return None
    from transformers import PretrainedConfig

    fields = {**LIGHT_DEFAULTS[model_type], **{k: v for k, v in raw.items() if k not in _NOT_FIELDS}}
    for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                 "max_position_embeddings"):
        if not isinstance(fields[name], int) or isinstance(fields[name], bool) or fields[name] <= 0:
            raise ValueError(f"{name} must be a positive integer, got {fields[name]!r}")
    if fields.get("num_key_value_heads") is None:
        fields["num_key_value_heads"] = fields["num_attention_heads"]
    if model_type == "llama" and fields.get("head_dim") is None:
        fields["head_dim"] = fields["hidden_size"] // fields["num_attention_heads"]
    if not fields.get("rope_parameters"):   # the classes fold legacy rope_theta / rope_scaling into it
        rope = dict(fields.pop("rope_scaling", None) or {})
        rope["rope_theta"] = float(fields.pop("rope_theta", _DEFAULT_ROPE_THETA))
        rope.setdefault("rope_type", rope.get("type", "default"))
        fields["rope_parameters"] = rope
    config = PretrainedConfig(**fields)
    config.model_type = model_type   # the base class's own is ""
    return config


def is_light(config: Any) -> bool:
    from transformers import PretrainedConfig

    return type(config) is PretrainedConfig


def config_dict(config: Any) -> dict[str, Any]:
    """``config.to_dict()`` with the model type (the base class writes an empty one)."""
    out = config.to_dict()
    out["model_type"] = config.model_type
    return out


def hf_config(config: Any) -> Any:
    """The model type's own transformers config class holding ``config``'s fields (unchanged
    when it already is one)."""
    if not is_light(config):
        return config
    from transformers import AutoConfig

    fields = {k: v for k, v in config.to_dict().items() if k not in _NOT_FIELDS}
    out = AutoConfig.for_model(config.model_type, **fields)
    out._name_or_path = config._name_or_path
    return out
