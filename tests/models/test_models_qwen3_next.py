"""Tiny Qwen3-Next checkpoints (Gated DeltaNet + gated attention, MoE) against HF transformers."""
from __future__ import annotations

import json
import random

import pytest
import torch
from paged_driver import PagedDriver, hf_logits

from tokenmill.contracts.errors import ModelLoadError
from tokenmill.contracts.kv import LinearState, PagedKV
from tokenmill.loader import build_hf_reference, load_model
from tokenmill.loader.tiny import build_tiny_checkpoint

# name -> overrides of loader.tiny.tiny_qwen3_next_dict (3 linear layers then full attention,
# dense layer 0 then MoE with a shared expert, rotary on a quarter of the head)
CONFIGS = {
    "base": {},
    # MoE off (every layer in mlp_only_layers), attention first and last, a bias on q/k/v/o, half
    # rotary, equal key and value heads, tied embeddings
    "dense": dict(layer_types=["full_attention", "linear_attention", "linear_attention", "full_attention"],
                  mlp_only_layers=[0, 1, 2, 3], attention_bias=True, partial_rotary_factor=0.5,
                  linear_num_key_heads=4, linear_value_head_dim=8, tie_word_embeddings=True),
    # MoE on every other layer (decoder_sparse_step 2), no renormalised top-k, no shared expert,
    # attention every second layer, conv width 3, full rotary
    "sparse_step": dict(full_attention_interval=2, decoder_sparse_step=2, mlp_only_layers=[], norm_topk_prob=False,
                        shared_expert_intermediate_size=0, linear_conv_kernel_dim=3, partial_rotary_factor=1.0,
                        num_experts_per_tok=3),
}


def _tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(49152) for _ in range(n)]


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    out = {}
    for name, over in CONFIGS.items():
        path = build_tiny_checkpoint(tmp_path_factory.mktemp(name), "Qwen3NextForCausalLM", seed=3, **over)
        loaded = load_model(str(path))
        out[name] = (loaded, build_hf_reference(loaded))
    return out


def test_kv_spec_lists_state_and_attention_layers(pairs):
    spec = pairs["base"][0].model.kv_cache_spec()
    lin = LinearState(num_heads=4, k_head_dim=16, v_head_dim=16, conv_dim=2 * 2 * 16 + 4 * 16, conv_kernel=4)
    assert spec.layers == (lin, lin, lin, PagedKV(2, 16))
    assert spec.is_hybrid and spec.linear_layer_ids() == (0, 1, 2) and spec.attention_layer_ids() == (3,)
    assert spec.bytes_per_token() == 2 * 2 * 16 * 4               # one attention layer, fp32 K and V
    assert spec.bytes_per_request() == 3 * (4 * 16 * 16 + 128 * 3) * 4
    model = pairs["sparse_step"][0].model
    assert [type(layer.mlp).__name__ for layer in model.layers] == ["DenseMLP", "SparseMoE"] * 2
    assert [type(layer.mixer).__name__ for layer in model.layers] == ["GatedDeltaNet", "GatedAttention"] * 2
    assert all(type(layer.mlp).__name__ == "DenseMLP" for layer in pairs["dense"][0].model.layers)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_prefill_logits_match_hf(pairs, name):
    loaded, ref = pairs[name]
    toks = _tokens(75, seed=3)   # longer than one 64-token block of the chunked delta rule
    ours = PagedDriver(loaded.model).step([("a", toks)], all_rows=True)
    assert (ours - hf_logits(ref, toks)).abs().max().item() < 1e-4


@pytest.mark.parametrize("name", ["base", "dense"])
def test_mixed_steps_of_decodes_and_chunks_equal_each_request_alone(pairs, name):
    """Prefill chunks beside decodes, chunks continuing from the slot's state, 1-token steps."""
    loaded, ref = pairs[name]
    a, b, c = _tokens(29, 10), _tokens(41, 11), _tokens(12, 12)
    drv = PagedDriver(loaded.model, page_size=4)
    full = {"a": hf_logits(ref, a), "b": hf_logits(ref, b), "c": hf_logits(ref, c)}
    got = []
    for chunks in ([("a", a[:26]), ("b", b[:17]), ("c", c[:9])],
                   [("a", a[26:27]), ("b", b[17:35]), ("c", c[9:10])],
                   [("c", c[10:11]), ("a", a[27:28]), ("b", b[35:36])],
                   [("b", b[36:41]), ("a", a[28:29]), ("c", c[11:12])]):
        got.extend(zip([seq for seq, _ in chunks], drv.step(chunks)))
    # each row is the logits after the chunk's last token; compare with the full HF pass
    ends = {"a": [26, 27, 28, 29], "b": [17, 35, 36, 41], "c": [9, 10, 11, 12]}
    seen = {"a": 0, "b": 0, "c": 0}
    for seq, row in got:
        pos = ends[seq][seen[seq]] - 1
        seen[seq] += 1
        assert (row - full[seq][pos]).abs().max().item() < 1e-4, (seq, pos)


def test_alone_state_slots_do_not_leak_between_sequences(pairs):
    """A sequence reusing a slot another one left state in starts from zero (position 0 rule)."""
    loaded, ref = pairs["base"]
    a, b = _tokens(20, 21), _tokens(9, 22)
    drv = PagedDriver(loaded.model, page_size=4, num_state_slots=1)
    drv.step([("a", a)])
    drv.slots["b"] = drv.slots["a"]     # b takes a's slot, which holds a's state now
    row = drv.step([("b", b)])[0]
    assert (row - hf_logits(ref, b)[-1]).abs().max().item() < 1e-4


def _edit_config(path, **changes):
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(changes)
    for k in [k for k, v in changes.items() if v is None]:
        cfg.pop(k)
    (path / "config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize("changes, field", [
    (dict(layer_types=["linear_attention", "sliding_attention", "linear_attention", "full_attention"]), "layer_types"),
    (dict(layer_types=["linear_attention"] * 4), "layer_types"),
    (dict(layer_types=["linear_attention", "full_attention"]), "layer_types"),
    (dict(hidden_act="gelu"), "hidden_act"),
    (dict(quantization_config={"quant_method": "fp8"}), "quantization_config"),
    (dict(linear_num_value_heads=3), "linear_num_value_heads"),
    (dict(partial_rotary_factor=0.1, rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                      "partial_rotary_factor": 0.1}), "partial_rotary_factor"),
    (dict(rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}), "rope type"),
])
def test_unsupported_config_refused_naming_the_field(tmp_path, changes, field):
    path = build_tiny_checkpoint(tmp_path / "m", "Qwen3NextForCausalLM", seed=0, num_hidden_layers=4)
    _edit_config(path, **changes)
    with pytest.raises((ModelLoadError, ValueError), match=field):
        load_model(str(path))


def test_missing_and_misshapen_tensors_refused(tmp_path):
    from safetensors.torch import load_file, save_file

    path = build_tiny_checkpoint(tmp_path / "m", "Qwen3NextForCausalLM", seed=0)
    weights = load_file(str(path / "model.safetensors"))
    weights["model.layers.0.linear_attn.A_log"] = torch.zeros(5)
    save_file(weights, str(path / "model.safetensors"))
    with pytest.raises(ModelLoadError, match="linear_attn.A_log"):
        load_model(str(path))
    del weights["model.layers.3.self_attn.q_norm.weight"]
    weights["model.layers.0.linear_attn.A_log"] = torch.zeros(4)
    save_file(weights, str(path / "model.safetensors"))
    with pytest.raises(ModelLoadError, match="q_norm"):
        load_model(str(path))
