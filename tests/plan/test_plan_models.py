"""Model presets and HF config.json parsing."""
from __future__ import annotations

import json

import pytest

from tokenmill.plan.capacity import Deployment, kv_bytes
from tokenmill.plan.hardware import PlanError, get_hardware
from tokenmill.plan.models import (MODEL_PRESETS, NAMED_BITS, WEIGHT_GROUPS, load_model, param_groups,
                                   parse_config, parse_weight_bits)
from tokenmill.plan.planner import make_plan

# Published total parameter counts (model cards), in billions.
PUBLISHED = {"deepseek-v3": 671.0, "llama-3.1-70b": 70.6, "qwen3-235b-a22b": 235.0, "smollm2-135m": 0.135,
             "kimi-k2.6": 1030.0, "ling-2.6-1t": 1000.0}


@pytest.mark.parametrize("name", sorted(MODEL_PRESETS))
def test_preset_param_counts_match_model_cards(name: str) -> None:
    spec = load_model(name)
    total = sum(g.params for g in param_groups(spec)) / 1e9
    assert total == pytest.approx(PUBLISHED[name], rel=0.02)


def test_preset_architectures() -> None:
    kimi = load_model("kimi-k2.6")
    assert kimi.mla is not None and kimi.mla.latent_dim == 576 and kimi.num_layers == 61
    assert kimi.moe is not None and kimi.moe.num_experts == 384 and kimi.num_moe_layers == 60
    ling = load_model("ling-2.6-1t")
    assert (ling.num_full_layers, ling.num_linear_layers) == (10, 70)
    assert ling.layer_attention[7] == "full" and ling.layer_attention[0] == "linear"
    assert ling.moe is not None and (ling.moe.num_experts, ling.moe.top_k, ling.moe.num_shared) == (256, 8, 1)
    llama = load_model("llama-3.1-70b")
    assert llama.attention_kind == "GQA" and llama.moe is None
    qwen = load_model("qwen3-235b-a22b")
    assert qwen.num_moe_layers == 94 and qwen.moe is not None and qwen.moe.num_shared == 0


def test_active_params_of_moe_presets() -> None:
    """Active parameters per token (top-k experts + everything else, no embedding table)."""
    for name, active_b in (("deepseek-v3", 37.0), ("qwen3-235b-a22b", 22.0), ("ling-2.6-1t", 63.0)):
        spec = load_model(name)
        act = 0.0
        for g in param_groups(spec):
            if g.name == "embedding table":
                continue
            act += g.params * (spec.moe.top_k / spec.moe.num_experts if g.group == "experts" else 1)
        assert act / 1e9 == pytest.approx(active_b, rel=0.05), name


def test_gqa_kv_heads_shard_then_replicate() -> None:
    llama = load_model("llama-3.1-70b")
    per_layer_head = 2 * 128 * 2  # K and V, head_dim 128, bf16
    for tp, heads in ((1, 8), (2, 4), (8, 1)):
        assert kv_bytes(llama, Deployment(tp=tp)).per_token_per_device == heads * per_layer_head * 80
    qwen = load_model("qwen3-235b-a22b")  # 4 KV heads: at TP8 each rank keeps one, replicated twice
    kv8 = kv_bytes(qwen, Deployment(tp=8))
    assert kv8.per_token_per_device == 2 * 1 * 128 * 2 * 94
    assert kv8.per_token_all_devices == 2 * kv_bytes(qwen, Deployment(tp=1)).per_token_per_device


def test_uneven_sharding_is_refused() -> None:
    spec = load_model("smollm2-135m")  # 9 heads, 3 KV heads
    with pytest.raises(PlanError, match="do not split"):
        make_plan(spec, get_hardware("h100"), Deployment(tp=2, weight_bits=parse_weight_bits(None)))
    six_experts = parse_config({"hidden_size": 256, "num_hidden_layers": 2, "num_attention_heads": 8,
                                "vocab_size": 1000, "num_experts": 6, "num_experts_per_tok": 2,
                                "moe_intermediate_size": 128}, "six-experts")
    with pytest.raises(PlanError, match="experts do not split"):
        make_plan(six_experts, get_hardware("h100"), Deployment(tp=4, ep=4, weight_bits=parse_weight_bits(None)))
    with pytest.raises(PlanError, match="must divide"):
        Deployment(tp=4, ep=3)
    with pytest.raises(PlanError, match="weight_bits"):
        Deployment(weight_bits={"wheels": 4})
    assert Deployment(weight_bits={"experts": 4}).weight_bits == {**{g: 16.0 for g in WEIGHT_GROUPS}, "experts": 4}


QWEN3_NEXT = {
    "architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next", "hidden_size": 2048,
    "num_hidden_layers": 48, "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 256,
    "intermediate_size": 5120, "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512,
    "num_experts": 512, "num_experts_per_tok": 10, "decoder_sparse_step": 1, "mlp_only_layers": [],
    "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
    "linear_num_key_heads": 16, "linear_num_value_heads": 32,
    "layer_types": (["linear_attention"] * 3 + ["full_attention"]) * 12,
    "vocab_size": 151936, "tie_word_embeddings": False,
}


def test_hf_config_hybrid_linear_attention(tmp_path) -> None:
    path = tmp_path / "qwen3-next" / "config.json"
    path.parent.mkdir()
    path.write_text(json.dumps(QWEN3_NEXT))
    spec = load_model(str(path.parent))  # a directory holding config.json works too
    assert spec.name == "qwen3-next"
    assert (spec.num_full_layers, spec.num_linear_layers, spec.num_moe_layers) == (12, 36, 48)
    assert spec.moe is not None and spec.moe.num_shared == 1 and spec.moe.shared_intermediate == 512
    assert sum(g.params for g in param_groups(spec)) / 1e9 == pytest.approx(80.0, rel=0.02)
    kv = kv_bytes(spec, Deployment(tp=2, kv_dtype="fp8", kv_fp8_scales="token"))
    assert kv.per_token_per_device == (2 * 1 * 256 * 1 + 2 * 4) * 12  # 2 KV heads / tp 2, fp8 + scales
    assert kv_bytes(spec, Deployment(tp=2, kv_dtype="fp8")).per_token_per_device == 2 * 256 * 12  # static scales
    state = 36 * (16 * 128 * 128 * 4 + 3 * (8192 // 2) * 4)  # fp32 recurrent + short-conv state per rank
    assert kv.state_per_request_per_device == state


def test_hf_config_deepseek_style_mla_and_dense_layers(tmp_path) -> None:
    cfg = {"model_type": "deepseek_v3", "hidden_size": 1024, "num_hidden_layers": 6,
           "num_attention_heads": 8, "num_key_value_heads": 8, "q_lora_rank": None, "kv_lora_rank": 256,
           "qk_rope_head_dim": 32, "qk_nope_head_dim": 64, "v_head_dim": 64, "head_dim": 32,
           "intermediate_size": 4096, "moe_intermediate_size": 512, "n_routed_experts": 16,
           "n_shared_experts": 2, "num_experts_per_tok": 4, "first_k_dense_replace": 2, "moe_layer_freq": 1,
           "vocab_size": 32000, "tie_word_embeddings": True}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    spec = load_model(str(tmp_path / "config.json"))
    assert spec.mla is not None and spec.mla.latent_dim == 288 and spec.mla.q_lora_rank is None
    assert spec.layer_mlp == ("dense", "dense", "moe", "moe", "moe", "moe")
    assert kv_bytes(spec, Deployment(tp=4)).per_token_per_device == 288 * 2 * 6
    names = {g.name for g in param_groups(spec)}
    assert "lm_head" not in names  # tied embeddings


def test_hf_config_multimodal_text_config_and_errors(tmp_path) -> None:
    wrapped = {"model_type": "llava", "text_config": {"hidden_size": 512, "num_hidden_layers": 2,
                                                      "num_attention_heads": 8, "vocab_size": 1000,
                                                      "intermediate_size": 1024}}
    spec = parse_config(wrapped, "mm")
    assert spec.hidden_size == 512 and spec.num_kv_heads == 8 and spec.head_dim == 64
    with pytest.raises(PlanError, match="hidden_size"):
        parse_config({"num_hidden_layers": 2}, "broken")
    with pytest.raises(PlanError, match="mamba"):
        parse_config({**wrapped["text_config"], "layer_types": ["mamba", "attention"]}, "jamba-like")
    with pytest.raises(PlanError, match="unknown model"):
        load_model(str(tmp_path / "nowhere"))
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(PlanError, match="cannot read"):
        load_model(str(tmp_path / "bad.json"))


def test_weight_bits_parsing() -> None:
    bits = parse_weight_bits("all=8,experts=nvfp4,embeddings=bf16")
    assert bits["experts"] == NAMED_BITS["nvfp4"] == 4.5
    assert bits["embeddings"] == 16 and bits["attention"] == 8 and set(bits) == set(WEIGHT_GROUPS)
    # "all" applies before specific groups whatever the order
    assert parse_weight_bits("experts=4,all=16")["experts"] == 4
    assert parse_weight_bits(None, {"experts": 4.5})["experts"] == 4.5
    for bad in ("experts", "wheels=4", "experts=abc", "experts=0", "experts=64"):
        with pytest.raises(PlanError):
            parse_weight_bits(bad)


def test_weight_bits_change_weight_bytes() -> None:
    spec = load_model("llama-3.1-70b")
    hw = get_hardware("h100")
    b16 = make_plan(spec, hw, Deployment(tp=4, weight_bits=parse_weight_bits(None)))
    b8 = make_plan(spec, hw, Deployment(tp=4, weight_bits=parse_weight_bits("all=fp8")))
    assert b8.weights.total_bytes == pytest.approx(b16.weights.total_bytes / 2)
    params = sum(g.params for g in b16.weights.groups)
    assert b16.weights.total_bytes == 2 * params
