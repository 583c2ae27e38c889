"""Tiny Ling (BailingHybridForCausalLM: MLA + KDA linear attention + MoE) against HF transformers,
driven over the paged latent cache and a state pool the way the engine drives it (PagedDriver)."""
from __future__ import annotations

import json
import random
import pytest
import torch
from paged_driver import PagedDriver, hf_logits

from tokenmill.contracts.errors import ModelLoadError
from tokenmill.contracts.kv import LatentKV, LinearState
from tokenmill.loader import build_hf_reference, load_model
from tokenmill.loader.tiny import build_tiny_checkpoint

ARCH = "BailingHybridForCausalLM"
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 32,
        "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}

# name -> overrides of loader.tiny.tiny_bailing_hybrid_dict (4 layers KDA/MLA/KDA/MLA, 1 dense
# layer then MoE with 1 shared expert, safe gate)
CONFIGS = {
    "base": {},
    # groups of 3 (KDA, KDA, MLA, KDA, KDA): every MLP dense, the unbounded forget gate, YaRN + biases
    "group3_dense_unsafe_gate": dict(num_hidden_layers=5, layer_group_size=3, first_k_dense_replace=5,
                                     kda_safe_gate=False, rope_parameters=YARN, attention_bias=True,
                                     short_conv_kernel_size=3),
    # every layer MoE (no dense layer, no shared expert), 4 groups keep 2, lower bound -2
    "all_moe_no_shared": dict(num_hidden_layers=3, layer_group_size=3, first_k_dense_replace=0, n_shared_experts=0,
                              num_local_experts=16, n_group=4, topk_group=2, num_experts_per_tok=3,
                              kda_lower_bound=-2.0, norm_topk_prob=False, routed_scaling_factor=1.0),
}


def _tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(49152) for _ in range(n)]


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    out = {}
    for name, over in CONFIGS.items():
        path = build_tiny_checkpoint(tmp_path_factory.mktemp(name), ARCH, seed=3, **over)
        loaded = load_model(str(path))
        out[name] = (loaded, build_hf_reference(loaded))
    return out


def test_kv_spec_mixes_latent_and_linear_state(pairs):
    loaded, _ = pairs["base"]
    spec = loaded.model.kv_cache_spec()
    kda = LinearState(num_heads=4, k_head_dim=16, v_head_dim=16, conv_dim=3 * 64, conv_kernel=4)
    assert spec.layers == (kda, LatentKV(32, 8), kda, LatentKV(32, 8))
    assert spec.attention_layer_ids() == (1, 3) and spec.linear_layer_ids() == (0, 2)
    assert spec.bytes_per_token() == 2 * (32 + 8) * 4
    assert spec.bytes_per_request() == 2 * (4 * 16 * 16 + 192 * 3) * 4
    drv = PagedDriver(loaded.model)
    assert drv.kv[0] is None and drv.kv[2] is None and drv.kv[1].shape == (96, 4, 40)
    loaded3, _ = pairs["group3_dense_unsafe_gate"]
    kinds = [type(x).__name__ for x in loaded3.model.kv_cache_spec().layers]
    assert kinds == ["LinearState", "LinearState", "LatentKV", "LinearState", "LinearState"]


@pytest.mark.parametrize("name", list(CONFIGS))
def test_prefill_logits_match_hf(pairs, name):
    loaded, ref = pairs[name]
    toks = _tokens(70, seed=3)  # past YaRN's original 32 positions, more than one 64-token block
    ours = PagedDriver(loaded.model).step([("a", toks)], all_rows=True)
    diff = (ours - hf_logits(ref, toks)).abs().max().item()
    assert diff < 1e-4, f"{name}: max abs diff {diff}"


@pytest.mark.parametrize("name", list(CONFIGS))
def test_mixed_batch_with_chunks_and_decodes_matches_hf(pairs, name):
    """Prefill chunks beside decodes, chunks continuing from the state left by the previous chunk,
    pure-decode steps; every produced row equals HF's full-sequence logits at that position."""
    loaded, ref = pairs[name]
    a, b, c = _tokens(29, 10), _tokens(41, 11), _tokens(12, 12)
    drv = PagedDriver(loaded.model, page_size=4)
    full = {"a": hf_logits(ref, a), "b": hf_logits(ref, b), "c": hf_logits(ref, c)}
    got = []
    for chunks in ([("a", a[:26]), ("b", b[:7]), ("c", c[:9])],
                   [("a", a[26:27]), ("b", b[7:14]), ("c", c[9:10])],
                   [("c", c[10:11]), ("a", a[27:28]), ("b", b[14:36])],
                   [("b", b[36:37]), ("a", a[28:29]), ("c", c[11:12])],
                   [("b", b[37:41])]):
        for (seq, _), row in zip(chunks, drv.step(chunks)):
            got.append((seq, drv.lens[seq] - 1, row))
    for seq, pos, row in got:
        diff = (row - full[seq][pos]).abs().max().item()
        assert diff < 1e-4, f"{name} seq {seq} position {pos}: max abs diff {diff}"
        assert int(row.argmax()) == int(full[seq][pos].argmax())


def test_fresh_sequence_ignores_a_dirty_slot(pairs):
    """A slot reused by a new request (its first chunk starts at position 0) is not read."""
    loaded, ref = pairs["base"]
    toks = _tokens(15, 21)
    drv = PagedDriver(loaded.model)
    drv.step([("old", _tokens(30, 22))])
    drv.slots["new"] = drv.slots["old"]
    out = drv.step([("new", toks)], all_rows=True)
    assert (out - hf_logits(ref, toks)).abs().max().item() < 1e-4


def test_greedy_matches_hf_generate(pairs):
    """Greedy decoding of three mixed-length prompts batched together (our recurrent decode path)
    equals HF generate on each prompt alone (HF's own cache and recurrent kernel)."""
    loaded, ref = pairs["base"]
    prompts = {"a": _tokens(5, 31), "b": _tokens(19, 32), "c": _tokens(11, 33)}
    drv = PagedDriver(loaded.model)
    rows = drv.step(list(prompts.items()))
    outs = {s: [int(r.argmax())] for s, r in zip(prompts, rows)}
    for _ in range(7):
        rows = drv.step([(s, [outs[s][-1]]) for s in prompts])
        for s, r in zip(prompts, rows):
            outs[s].append(int(r.argmax()))
    for s, p in prompts.items():
        with torch.no_grad():
            want = ref.generate(torch.tensor([p]), max_new_tokens=8, do_sample=False)[0, len(p):].tolist()
        assert outs[s] == want, s


def test_checkpoint_names_and_mtp_layers(tmp_path, pairs):
    """The saved checkpoint uses Ling's own names (word_embeddings, attention.dense, q/k/v_conv1d,
    expert_bias, one tensor per expert); an MTP layer model.layers.{n} is loaded and kept, not run."""
    from safetensors.torch import load_file, save_file

    path = build_tiny_checkpoint(tmp_path / "mtp", ARCH, seed=3, num_mtp_layers=1)
    weights = load_file(str(path / "model.safetensors"))
    assert "model.word_embeddings.weight" in weights and "model.layers.0.attention.q_conv1d.weight" in weights
    assert "model.layers.1.mlp.gate.expert_bias" in weights and "model.layers.1.mlp.experts.7.up_proj.weight" in weights
    mtp = {k.replace("model.layers.3.", "model.layers.4."): v.clone() for k, v in weights.items()
           if k.startswith("model.layers.3.")}
    mtp.update({"model.layers.4.enorm.weight": torch.ones(64), "model.layers.4.hnorm.weight": torch.ones(64),
                "model.layers.4.eh_proj.weight": torch.randn(64, 128)})
    save_file({**weights, **mtp}, str(path / "model.safetensors"), metadata={"format": "pt"})
    loaded = load_model(str(path))
    assert set(loaded.model.mtp_weights) == set(mtp)
    toks = _tokens(20, 5)
    out = PagedDriver(loaded.model).step([("a", toks)], all_rows=True)
    assert (out - hf_logits(pairs["base"][1], toks)).abs().max() < 1e-4
    cfg = json.loads((path / "config.json").read_text())
    cfg["num_nextn_predict_layers"] = 0
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="num_mtp_layers=0"):
        load_model(str(path))


@pytest.mark.parametrize("field, value", [("hidden_act", "gelu"), ("num_key_value_heads", 2),
                                          ("tie_word_embeddings", True), ("num_expert_group", 3),
                                          ("layer_types", ["linear_attention", "sliding_attention"] * 2),
                                          ("mlp_layer_types", ["dense", "moe", "dense", "dense"]),
                                          ("quantization_config", {"quant_method": "fp8"}),
                                          ("partial_rotary_factor", 0.5)])
def test_unsupported_config_values_are_refused_naming_the_field(tmp_path, field, value):
    path = build_tiny_checkpoint(tmp_path / field, ARCH, seed=0)
    cfg = json.loads((path / "config.json").read_text())
    cfg[field] = value
    (path / "config.json").write_text(json.dumps(cfg))
    shown = {"num_expert_group": "n_group"}.get(field, field)
    with pytest.raises(ModelLoadError, match=shown):
        load_model(str(path))


def test_router_matches_hf_bailing_router_including_ties(pairs):
    """HF's BailingHybridTopkRouter and tokenmill's route_sigmoid_grouped pick the same experts with
    the same weights, bit for bit, with equal scores inside and across groups."""
    from tokenmill.layers.moe import route_sigmoid_grouped

    _, ref = pairs["all_moe_no_shared"]
    gate = ref.model.layers[1].mlp.gate
    x = torch.randn(48, 64, generator=torch.Generator().manual_seed(0))
    x[:12] = x[0]
    with torch.no_grad():
        w = gate.weight.clone()
        w[4:8] = w[0:4]                  # groups 0 and 1 score the same
        w[9] = w[8]                      # two equal experts inside group 2
        gate.weight.copy_(w)
        _, hf_w, hf_ids = gate(x)
    c = ref.config
    ours_w, ours_ids = route_sigmoid_grouped(
        x, w, gate.e_score_correction_bias, top_k=c.num_experts_per_tok, n_group=c.n_group,
        topk_group=c.topk_group, norm_topk_prob=c.norm_topk_prob, routed_scaling_factor=c.routed_scaling_factor)
    assert torch.equal(ours_ids, hf_ids) and torch.equal(ours_w, hf_w)


def test_bf16_model_keeps_state_and_gate_params_in_fp32(pairs):
    """In bf16 the conv weights, A_log, dt_bias and the state pool stay fp32 (as in HF), and the
    logits are as close to the fp32 oracle as HF's own bf16 model is (mean error within 2x)."""
    loaded, ref = pairs["base"]
    bf16 = load_model(str(loaded.source), dtype=torch.bfloat16)
    kda = bf16.model.layers[0].self_attn
    assert kda.conv_weight.dtype == kda.A_log.dtype == kda.dt_bias.dtype == torch.float32
    assert kda.qkv_proj.dtype == torch.bfloat16
    toks = _tokens(24, 41)
    drv = PagedDriver(bf16.model)
    assert drv.states.rec[0].dtype == torch.float32
    got = drv.step([("a", toks)], all_rows=True)
    want = hf_logits(ref, toks)
    hf_bf16 = hf_logits(build_hf_reference(bf16), toks)
    assert got.dtype == torch.float32 and torch.isfinite(got).all()
    assert (got - want).abs().mean() <= 2 * (hf_bf16 - want).abs().mean()


@pytest.mark.parametrize("name", ["base", "group3_dense_unsafe_gate"])
def test_planner_state_and_kv_bytes_equal_the_engine_pools(pairs, name):
    """`tokenmill plan` on the checkpoint's config.json computes exactly the state-pool slot and
    the per-token latent bytes the engine allocates for this model."""
    from tokenmill.layers.state_pool import StatePool
    from tokenmill.plan.capacity import Deployment, kv_bytes
    from tokenmill.plan.models import load_model as plan_model

    loaded, _ = pairs[name]
    spec = loaded.model.kv_cache_spec()
    plan = kv_bytes(plan_model(str(loaded.source)), Deployment(tp=1, kv_dtype="fp32"))
    assert plan.state_per_request_per_device == StatePool(spec, 3).bytes_per_slot == spec.bytes_per_request()
    assert plan.per_token_per_device == spec.bytes_per_token()
