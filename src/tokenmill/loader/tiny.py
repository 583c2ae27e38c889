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

TINY_ARCHS = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")   # dense
TINY_MOE_ARCHS = ("DeepseekV3ForCausalLM",)                                   # MLA + MoE
TINY_LING_ARCHS = ("BailingHybridForCausalLM",)                                # MLA + KDA + MoE (hybrid)
TINY_QWEN3_NEXT = "Qwen3NextForCausalLM"   # hybrid: Gated DeltaNet + gated attention, MoE


def tiny_qwen3_next_dict(**overrides: Any) -> dict[str, Any]:
    """A four-layer Qwen3-Next: three Gated DeltaNet layers then one gated full-attention layer
    (``full_attention_interval`` 4), 2 key / 4 value heads of 16 in the linear layers, conv width 4,
    a dense first layer (``mlp_only_layers`` [0]) then MoE of 8 experts (top 2) with a shared
    expert, rotary on a quarter of the head. Override any field (``layer_types`` included)."""
    cfg: dict[str, Any] = dict(
        architectures=["Qwen3NextForCausalLM"], model_type="qwen3_next",
        vocab_size=49152, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, full_attention_interval=4,
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
        linear_conv_kernel_dim=4, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
        shared_expert_intermediate_size=48, decoder_sparse_step=1, mlp_only_layers=[0], norm_topk_prob=True,
        partial_rotary_factor=0.25, max_position_embeddings=4096, rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, tie_word_embeddings=False,
        attention_bias=False, bos_token_id=1, eos_token_id=2, initializer_range=0.1, torch_dtype="float32",
    )
    cfg.update(overrides)
    return cfg


def tiny_deepseek_v3_dict(**overrides: Any) -> dict[str, Any]:
    """A two-layer DeepSeek-V3: MLA with query compression, one dense layer then one MoE layer of
    8 experts (top 2 of 2 groups, 1 group kept) with one shared expert. Override any field."""
    cfg: dict[str, Any] = dict(
        architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3",
        vocab_size=49152, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
        q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
        n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1, n_shared_experts=1,
        first_k_dense_replace=1, norm_topk_prob=True, routed_scaling_factor=2.5, rope_interleave=True,
        max_position_embeddings=4096, rms_norm_eps=1e-6, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        tie_word_embeddings=False, num_nextn_predict_layers=0, bos_token_id=1, eos_token_id=2,
        initializer_range=0.2, torch_dtype="float32",
    )
    cfg.update(overrides)
    return cfg


def tiny_bailing_hybrid_dict(**overrides: Any) -> dict[str, Any]:
    """A four-layer Ling (BailingHybrid): layer_group_size 2 gives KDA, MLA, KDA, MLA; one dense
    layer first, then MoE layers of 8 experts (top 2, 2 groups keep 1) with one shared expert.
    KDA: 4 heads of 16, conv width 4. Override any field."""
    cfg: dict[str, Any] = dict(
        architectures=["BailingHybridForCausalLM"], model_type="bailing_hybrid",
        vocab_size=49152, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
        num_hidden_layers=4, layer_group_size=2, num_attention_heads=4, num_key_value_heads=4, head_dim=16,
        kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
        num_local_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1, n_shared_experts=1,
        first_k_dense_replace=1, norm_topk_prob=True, routed_scaling_factor=2.5,
        short_conv_kernel_size=4, kda_safe_gate=True, kda_lower_bound=-5.0, num_mtp_layers=0,
        max_position_embeddings=4096, rms_norm_eps=1e-6, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=2,
        initializer_range=0.2, torch_dtype="float32",
    )
    cfg.update(overrides)
    return cfg


def default_tokenizer_dir() -> Path:
    """The default model's tokenizer (from its GGUF), saved once under the tokenmill cache."""
    from tokenmill.loader.gguf import gguf_tokenizer_dir

    return gguf_tokenizer_dir(resolve_model_path(DEFAULT_MODEL))


def tiny_config_dict(arch: str = "LlamaForCausalLM", **overrides: Any) -> dict[str, Any]:
    if arch in TINY_MOE_ARCHS:
        return tiny_deepseek_v3_dict(**overrides)
    if arch in TINY_LING_ARCHS:
        return tiny_bailing_hybrid_dict(**overrides)
    if arch == TINY_QWEN3_NEXT:
        return tiny_qwen3_next_dict(**overrides)
    if arch not in TINY_ARCHS:
        raise ValueError(f"unknown tiny architecture {arch!r}; choose from "
                         f"{TINY_ARCHS + TINY_MOE_ARCHS + TINY_LING_ARCHS + (TINY_QWEN3_NEXT,)}")
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
                          max_shard_size: str | None = None, **overrides: Any) -> Path:
    """Write a random-weight HF checkpoint for ``arch`` into ``out_dir`` and return it
    (``max_shard_size``, e.g. ``"1MB"``: sharded safetensors with an index).

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
    with torch.no_grad():
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # HF starts it at zero; make it steer selection
                buf.copy_(torch.randn(buf.shape) * 0.3)
        if arch in TINY_MOE_ARCHS + TINY_LING_ARCHS:  # attention_bias: HF starts biases at zero; make them count
            for name, p in model.named_parameters():
                if name.endswith(".bias"):
                    p.copy_(torch.randn(p.shape) * 0.1)
        if arch == TINY_QWEN3_NEXT or arch in TINY_LING_ARCHS:  # HF starts norms at (1 + 0) and biases at 0; make them count
            for name, p in model.named_parameters():
                if name.endswith(("norm.weight", ".bias")):
                    p.add_(torch.randn(p.shape) * 0.1)
    extra = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(str(out), safe_serialization=True, **extra)
    tok_dir = default_tokenizer_dir()
    for f in tok_dir.iterdir():
        shutil.copy(f, out / f.name)
    # Stop tokens of the chat template: <|im_end|> is the end of an assistant turn.
    gen = {"bos_token_id": cfg_dict["bos_token_id"], "eos_token_id": cfg_dict["eos_token_id"]}
    (out / "generation_config.json").write_text(json.dumps(gen))
    return out
