"""Tiny random-weight HF checkpoints for tests and fleet benchmarks.

A tiny model is a real HF directory (config.json, model.safetensors, tokenizer files with the
chat template) so it goes through the same loader as any downloaded checkpoint. The tokenizer
is the default model's, taken from its GGUF metadata, so chat templates and stop tokens behave
like the real thing while the network stays a few layers of hidden size 64.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tokenmill.loader.resolve import DEFAULT_MODEL, resolve_model_path

TINY_ARCHS = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")


def default_tokenizer_dir() -> Path:
    """The default model's tokenizer (from its GGUF), saved once under the tokenmill cache."""
    from tokenmill.loader.gguf import gguf_tokenizer_dir

    return gguf_tokenizer_dir(resolve_model_path(DEFAULT_MODEL))


def tiny_config_dict(arch: str = "LlamaForCausalLM", **overrides: Any) -> dict[str, Any]:
    if arch not in TINY_ARCHS:
        raise ValueError(f"unknown tiny architecture {arch!r}; choose from {TINY_ARCHS}")
    cfg: dict[str, Any] = dict(
        architectures=[arch],
        vocab_size=49152,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
        initializer_range=0.2,
        torch_dtype="float32",
    )
    if arch == "Qwen2ForCausalLM":
        cfg.update(model_type="qwen2", use_sliding_window=False)
    elif arch == "Qwen3ForCausalLM":
        cfg.update(model_type="qwen3", head_dim=16, use_sliding_window=False)
    else:
        cfg.update(model_type="llama")
    cfg.update(overrides)
    return cfg


def build_tiny_checkpoint(out_dir: str | Path, arch: str = "LlamaForCausalLM", seed: int = 0,
                          **overrides: Any) -> Path:
    """Write a random-weight HF checkpoint for ``arch`` into ``out_dir`` and return it.

    Weights come from HF transformers' own initialisation under ``torch.manual_seed(seed)``, so
    the same call always gives the same checkpoint.
    """
    import shutil

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cfg_dict = tiny_config_dict(arch, **overrides)
    config = AutoConfig.for_model(**cfg_dict)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32)
    model.save_pretrained(str(out), safe_serialization=True)
    tok_dir = default_tokenizer_dir()
    for f in tok_dir.iterdir():
        shutil.copy(f, out / f.name)
    # Stop tokens of the chat template: <|im_end|> is the end of an assistant turn.
    gen = {"bos_token_id": cfg_dict["bos_token_id"], "eos_token_id": cfg_dict["eos_token_id"]}
    (out / "generation_config.json").write_text(json.dumps(gen))
    return out
