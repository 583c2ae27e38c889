"""Tiny DeepSeek-V3 (MLA + MoE) checkpoints over the paged latent cache against HF transformers."""
from __future__ import annotations

import json
import random

import pytest
import torch
from paged_driver import PagedDriver, hf_logits

from tokenmill.contracts.errors import ModelLoadError
from tokenmill.contracts.kv import LatentKV
from tokenmill.layers.attention import MLAAttention
from tokenmill.layers.moe import GroupedExperts, route_sigmoid_grouped
from tokenmill.loader import build_hf_reference, load_model
from tokenmill.loader.tiny import build_tiny_checkpoint

YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 32,
        "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}

# name -> overrides of loader.tiny.tiny_deepseek_v3_dict (q_lora 32, 2 groups keep 1, 1 dense
# layer first, 1 shared expert, interleaved rope, no YaRN)
CONFIGS = {
    "base": {},
    # Kimi K2's router (one group), DeepSeek-V2-Lite's attention (no query compression), all MoE
    "kimi_no_qlora": dict(q_lora_rank=None, n_group=1, topk_group=1, first_k_dense_replace=0,
                          n_shared_experts=0, rope_interleave=False, norm_topk_prob=False,
                          routed_scaling_factor=1.0),
    "yarn_4groups": dict(rope_parameters=YARN, n_routed_experts=16, n_group=4, topk_group=2,
                         num_experts_per_tok=3, num_hidden_layers=3, first_k_dense_replace=2,
                         attention_bias=True),
}


def _tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(49152) for _ in range(n)]


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    out = {}
    for name, over in CONFIGS.items():
        shard = {"max_shard_size": "2MB"} if name == "base" else {}
        path = build_tiny_checkpoint(tmp_path_factory.mktemp(name), "DeepseekV3ForCausalLM", seed=3, **shard, **over)
        loaded = load_model(str(path))
        out[name] = (loaded, build_hf_reference(loaded))
    return out


def test_sharded_checkpoint_and_latent_kv_spec(pairs):
    loaded, _ = pairs["base"]
    assert (loaded.source / "model.safetensors.index.json").is_file()
    spec = loaded.model.kv_cache_spec()
    assert spec.layers == (LatentKV(32, 8),) * 2
    assert spec.bytes_per_token() == 2 * (32 + 8) * 4
    assert spec.with_dtype("float8_e4m3fn").bytes_per_token() == 2 * 40                 # static scales
    assert spec.with_dtype("float8_e4m3fn").with_fp8_scales("token").bytes_per_token() == 2 * (40 + 4)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_prefill_logits_match_hf(pairs, name):
    loaded, ref = pairs[name]
    toks = _tokens(70, seed=3)  # past YaRN's original 32 positions
    ours = PagedDriver(loaded.model).step([("a", toks)], all_rows=True)
    assert (ours - hf_logits(ref, toks)).abs().max().item() < 1e-4


@pytest.mark.parametrize("name", list(CONFIGS))
def test_mixed_batch_with_cached_context_matches_hf(pairs, name):
    """Prefill chunks beside decodes, chunks after cached context, pure-decode steps (absorbed)."""
    loaded, ref = pairs[name]
    a, b, c = _tokens(29, 10), _tokens(41, 11), _tokens(12, 12)
    drv = PagedDriver(loaded.model, page_size=4)
    assert isinstance(drv.attn, MLAAttention) and drv.attn.absorb_decode
    full = {"a": hf_logits(ref, a), "b": hf_logits(ref, b), "c": hf_logits(ref, c)}
    got = []
    for chunks in ([("a", a[:26]), ("b", b[:17]), ("c", c[:9])],
                   [("a", a[26:27]), ("b", b[17:35]), ("c", c[9:10])],
                   [("c", c[10:11]), ("a", a[27:28]), ("b", b[35:36])],
                   [("b", b[36:41]), ("a", a[28:29]), ("c", c[11:12])]):
        for (seq, _), row in zip(chunks, drv.step(chunks)):
            got.append((seq, drv.lens[seq] - 1, row))
    for seq, pos, row in got:
        diff = (row - full[seq][pos]).abs().max().item()
        assert diff < 1e-4, f"{name} seq {seq} position {pos}: max abs diff {diff}"
        assert int(row.argmax()) == int(full[seq][pos].argmax())


def test_absorbed_decode_equals_expanded(pairs):
    loaded, _ = pairs["yarn_4groups"]
    seqs = {"a": _tokens(37, 1), "b": _tokens(5, 2), "c": _tokens(50, 4)}
    absorbed, expanded = PagedDriver(loaded.model, seed=1), PagedDriver(loaded.model, seed=1)
    expanded.attn = MLAAttention(expanded.attn.spec, expanded.attn.device, loaded.model.dtype, absorb_decode=False)
    for drv in (absorbed, expanded):
        drv.step([(s, t[:-3]) for s, t in seqs.items()])
    worst = scale = 0.0
    for i in (3, 2, 1):  # three decode steps of all sequences
        chunks = [(s, t[-i:len(t) - i + 1]) for s, t in seqs.items()]
        got, want = absorbed.step(chunks), expanded.step(chunks)
        worst = max(worst, (got - want).abs().max().item())
        scale = max(scale, want.abs().max().item())
    # absorption re-associates the latent matmuls (q W_uk against W_uk c, W_uv after the
    # weights): at fp32 that moves logits of magnitude ~8 by up to ~1.1e-5 (about 24 ulps,
    # depending on the BLAS kernels the CPU gets); a wrong absorption moves them by O(1)
    assert worst < 3e-6 * scale, (worst, scale)


def test_router_matches_hf_including_ties(pairs):
    """Equal scores inside and across groups: the same experts as HF's router, bit for bit."""
    _, ref = pairs["yarn_4groups"]
    gate = ref.model.layers[2].mlp.gate
    x = torch.randn(64, 64)
    x[:16] = x[0]                        # identical tokens
    with torch.no_grad():
        w = gate.weight.clone()
        w[4:8] = w[0:4]                  # groups 0 and 1 score the same
        w[9] = w[8]                      # two equal experts inside group 2
        gate.weight.copy_(w)
        _, hf_w, hf_ids = gate(x)
    a = ref.config
    ours_w, ours_ids = route_sigmoid_grouped(
        x, w, gate.e_score_correction_bias, top_k=a.num_experts_per_tok, n_group=a.n_group,
        topk_group=a.topk_group, norm_topk_prob=a.norm_topk_prob, routed_scaling_factor=a.routed_scaling_factor)
    assert torch.equal(ours_ids, hf_ids) and torch.equal(ours_w, hf_w)


@pytest.mark.parametrize("mode", GroupedExperts.MODES)
def test_grouped_experts_match_a_dense_reference(mode):
    torch.manual_seed(0)
    e, h, f, t, k = 8, 32, 16, 40, 3
    gate_up, down = torch.randn(e, 2 * f, h) * 0.2, torch.randn(e, h, f) * 0.2
    x = torch.randn(t, h)
    ids = torch.stack([torch.randperm(e)[:k] for _ in range(t)])
    ids[:, 0] = 5                        # a crowded expert; others get few or none
    weights = torch.rand(t, k)
    experts = GroupedExperts(gate_up, down, mode=mode)
    assert experts.mode == mode
    got = experts(x, weights, ids)
    shared = torch.randn(t, h)
    assert torch.allclose(experts(x, weights, ids, out=shared.clone()), got + shared, atol=1e-5)
    want = torch.zeros(t, h)
    for i in range(t):
        for j in range(k):
            g, u = (gate_up[ids[i, j]] @ x[i]).split(f)
            want[i] += weights[i, j] * (down[ids[i, j]] @ (torch.nn.functional.silu(g) * u))
    assert (got - want).abs().max().item() < 1e-4
    # the dense (shared-expert) path: every token through expert 0
    g, u = (x @ gate_up[0].T).split(f, dim=-1)
    assert (experts.dense(x) - (torch.nn.functional.silu(g) * u) @ down[0].T).abs().max().item() < 1e-4
    # a token's result does not depend on the other tokens in the batch
    assert (experts(x[3:4], weights[3:4], ids[3:4]) - got[3:4]).abs().max().item() < 1e-5
    # expert parallelism: two shards of 4 experts each sum to the whole
    halves = [GroupedExperts(gate_up[i:i + 4], down[i:i + 4], mode=mode).local_sum(x, weights, ids, i) for i in (0, 4)]
    assert (halves[0] + halves[1] - got).abs().max().item() < 1e-5


@pytest.mark.parametrize("mode", GroupedExperts.MODES)
def test_expert_shards_local_sums_add_up_to_all_experts(mode):
    """Expert parallelism: shards holding experts [0, 3), [3, 6), [6, 8) each sum only the pairs
    routed to them (zero rows elsewhere); the shards' sums add up to the whole layer's output."""
    torch.manual_seed(1)
    e, h, f, t, k = 8, 32, 16, 40, 3
    gate_up, down = torch.randn(e, 2 * f, h) * 0.2, torch.randn(e, h, f) * 0.2
    x = torch.randn(t, h)
    ids = torch.stack([torch.randperm(e)[:k] for _ in range(t)])
    ids[:5] = torch.tensor([0, 1, 2])     # tokens with no expert on the later shards
    weights = torch.rand(t, k)
    whole = GroupedExperts(gate_up, down, mode=mode)(x, weights, ids)
    parts = [GroupedExperts(gate_up[lo:hi], down[lo:hi], mode=mode).local_sum(x, weights, ids, lo)
             for lo, hi in ((0, 3), (3, 6), (6, 8))]
    assert parts[1][:5].abs().max().item() == 0 and parts[2][:5].abs().max().item() == 0
    assert all(p.abs().sum().item() > 0 for p in parts)
    assert (sum(parts) - whole).abs().max().item() < 1e-5


def test_grouped_experts_pick_prepacked_onednn_on_cpu():
    gate_up, down = torch.randn(4, 16, 8), torch.randn(4, 8, 8)
    if torch.backends.mkldnn.is_available():
        assert GroupedExperts(gate_up, down).mode == "packed"
    assert GroupedExperts(gate_up, down, use_grouped_mm=False).mode == "loop"
    with pytest.raises(ValueError, match="mode must be one of"):
        GroupedExperts(gate_up, down, mode="fast")


@pytest.mark.parametrize("scales", ["static", "token"])
def test_fp8_latent_cache_holds_the_fp32_latents_within_e4m3_rounding(pairs, scales):
    """Same steps into an fp32 and an fp8 pool: every stored latent dequantizes to the fp32 one
    within e4m3's half-ulp (2^-4 relative) plus the scale's subnormal step. Static scales are
    calibrated by a prefill first: one value for the latent, one for the rope key, per layer."""
    from tokenmill.layers.attention.fp8 import FP8_MAX, calibrate_static_scales, dequantize, dequantize_static

    loaded, ref = pairs["base"]
    toks = _tokens(40, 7)
    exact, fp8 = PagedDriver(loaded.model), PagedDriver(loaded.model)
    spec = exact.attn.spec.with_dtype("float8_e4m3fn").with_fp8_scales(scales)
    fp8.attn = MLAAttention(spec, fp8.attn.device, loaded.model.dtype)
    fp8.kv = fp8.attn.allocate(96, 4)
    assert fp8.kv[0].data.dtype == torch.uint8
    if scales == "static":
        assert fp8.kv[0].scale.shape == (1, 1, 40) and not fp8.kv[0].per_token
        with torch.inference_mode():
            calibrate_static_scales(fp8.kv, lambda: fp8.step([("cal", _tokens(24, 3))]), fp8.attn.fp8_scale_segments)
        sc = fp8.kv[0].scale.view(-1)
        assert (sc[:32] == sc[0]).all() and (sc[32:] == sc[32]).all() and sc[0] != sc[32]
    else:
        assert fp8.kv[0].scale.shape == (96, 4)
    outs = []
    for drv in (exact, fp8):
        outs.append(torch.cat([drv.step([("s", toks[:30])]), *[drv.step([("s", [t])]) for t in toks[30:]]]))
    pages, fp8_pages = torch.tensor(exact.pages["s"]), torch.tensor(fp8.pages["s"])
    for layer in range(1):  # the first layer's latents depend on the embeddings only
        want = exact.kv[layer][pages].reshape(-1, 40)[:40]
        entry = fp8.kv[layer]
        if scales == "static":
            got = dequantize_static(entry.data[fp8_pages], entry.scale, torch.float32).reshape(-1, 40)[:40]
            scale = entry.scale.view(1, 40)
            # static scales saturate (clamp at 448, never NaN) for values past the calibrated headroom
            assert (want.abs() < FP8_MAX * scale).all()
        else:
            got = dequantize(entry.data[pages], entry.scale[pages], torch.float32).reshape(-1, 40)[:40]
            scale = entry.scale[pages].reshape(-1)[:40, None]
        assert ((got - want).abs() <= want.abs() / 16 + scale * 2 ** -9).all()
    want = hf_logits(ref, toks)[29:]
    assert (outs[0] - want).abs().max().item() < 1e-4
    # this checkpoint's init-0.2 MoE flips routing under small changes; static scales measured 0.13
    assert (outs[1] - want).abs().mean().item() < (0.1 if scales == "token" else 0.2)


def test_static_fp8_scales_saturate_instead_of_overflowing():
    from tokenmill.layers.attention.fp8 import FP8_MAX, FP8Pages, dequantize_static, write_fp8

    pages = FP8Pages(torch.zeros(2, 4, 3, dtype=torch.uint8), torch.full((1, 1, 3), 0.01), False)
    write_fp8(pages, torch.tensor([0, 5]), torch.tensor([[1.0, -100.0, 0.5], [1e6, 2.0, -1e9]]))
    got = dequantize_static(pages.data, pages.scale, torch.float32).view(-1, 3)
    assert torch.isfinite(got).all()
    assert got[0].tolist() == pytest.approx([1.0, -FP8_MAX * 0.01, 0.5], rel=1 / 16)
    assert got[5].tolist() == pytest.approx([FP8_MAX * 0.01, 2.0, -FP8_MAX * 0.01], rel=1 / 16)


def test_mtp_layers_are_loaded_and_kept(tmp_path, pairs):
    """A checkpoint with one MTP layer (model.layers.{num_hidden_layers}) loads; its tensors are
    kept for a drafter and do not change the main model."""
    from safetensors.torch import load_file, save_file

    path = build_tiny_checkpoint(tmp_path / "mtp", "DeepseekV3ForCausalLM", seed=3, num_nextn_predict_layers=1)
    weights = load_file(str(path / "model.safetensors"))
    mtp = {k.replace("model.layers.1.", "model.layers.2."): v.clone() for k, v in weights.items()
           if k.startswith("model.layers.1.")}
    mtp.update({"model.layers.2.enorm.weight": torch.ones(64), "model.layers.2.hnorm.weight": torch.ones(64),
                "model.layers.2.eh_proj.weight": torch.randn(64, 128)})
    save_file({**weights, **mtp}, str(path / "model.safetensors"), metadata={"format": "pt"})
    loaded = load_model(str(path))
    assert set(loaded.model.mtp_weights) == set(mtp)
    toks = _tokens(20, 5)
    ref = build_hf_reference(loaded)
    assert (PagedDriver(loaded.model).step([("a", toks)], all_rows=True) - hf_logits(ref, toks)).abs().max() < 1e-4
    cfg = json.loads((path / "config.json").read_text())
    cfg["num_nextn_predict_layers"] = 0
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="num_mtp_layers=0"):
        load_model(str(path))


def test_kimi_k2_model_type_loads_as_deepseek_v3(tmp_path):
    """Kimi K2's config.json says model_type "kimi_k2" (remote code) with the DeepSeek-V3 class and
    an old-style rope_scaling dict; it loads without remote code and matches HF's DeepSeek-V3."""
    path = build_tiny_checkpoint(tmp_path / "kimi", "DeepseekV3ForCausalLM", seed=5, n_group=1, topk_group=1)
    cfg = json.loads((path / "config.json").read_text())
    cfg.pop("rope_parameters")
    cfg.update(model_type="kimi_k2",
               rope_theta=50000.0, rope_scaling={"type": "yarn", "factor": 8.0, "original_max_position_embeddings": 16,
                                                 "beta_fast": 1.0, "beta_slow": 1.0, "mscale": 1.0,
                                                 "mscale_all_dim": 1.0})
    (path / "config.json").write_text(json.dumps(cfg))
    loaded = load_model(str(path))
    assert loaded.model.args.rope_scaling["rope_type"] == "yarn" and loaded.model.args.rope_theta == 50000.0
    toks = _tokens(40, 6)
    ours = PagedDriver(loaded.model).step([("a", toks)], all_rows=True)
    assert (ours - hf_logits(build_hf_reference(loaded), toks)).abs().max().item() < 1e-4


@pytest.mark.parametrize("field, value", [("topk_method", "greedy"), ("scoring_func", "softmax"),
                                          ("n_group", 3), ("topk_group", 5),
                                          ("quantization_config", {"quant_method": "fp8"})])
def test_unsupported_config_values_are_refused_naming_the_field(tmp_path, field, value):
    path = build_tiny_checkpoint(tmp_path / field, "DeepseekV3ForCausalLM", seed=0)
    cfg = json.loads((path / "config.json").read_text())
    cfg[field] = value
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match=field):
        load_model(str(path))


@pytest.mark.parametrize("kv_dtype", ["float32", "float8_e4m3fn"])
@pytest.mark.parametrize("shape", ["decode", "chunk_after_context", "fresh_prefill"])
def test_alone_equals_in_a_batch_of_24(pairs, kv_dtype, shape):
    """Batch invariance of MLA + MoE (the expert groups change size with the batch): one request's
    logits alone and inside a batch of mixed decodes, fresh prefills and chunks agree within 1e-5,
    with an fp32 and an fp8 latent pool (per-token scales do not depend on the neighbours)."""
    loaded, _ = pairs["base"]
    model = loaded.model
    rng = random.Random(11)
    history = [rng.randrange(49152) for _ in range(37)]
    n = {"decode": 1, "chunk_after_context": 9, "fresh_prefill": 23}[shape]
    step = [rng.randrange(49152) for _ in range(n)]
    if shape == "fresh_prefill":
        history = []
    others = []
    for i in range(23):
        kind = i % 3
        ctx = rng.randrange(5, 60) if kind != 1 else 0
        others.append((f"o{i}", [rng.randrange(49152) for _ in range(ctx)],
                       [rng.randrange(49152) for _ in range(1 if kind == 0 else rng.randrange(2, 20))]))

    def driver(seed: int) -> PagedDriver:
        drv = PagedDriver(model, num_pages=500, page_size=4, seed=seed)
        drv.attn = MLAAttention(drv.attn.spec.with_dtype(kv_dtype), drv.attn.device, model.dtype)
        drv.kv = drv.attn.allocate(500, 4)
        return drv

    alone = driver(0)
    if history:
        alone.step([("me", history)])
    want = alone.step([("me", step)], all_rows=True)
    batched = driver(5)
    batched.step([(name, ctx) for name, ctx, _ in others if ctx] + ([("me", history)] if history else []))
    chunks = [(name, t) for name, _, t in others[:12]] + [("me", step)] + [(name, t) for name, _, t in others[12:]]
    got_all = batched.step(chunks, all_rows=True)
    start = sum(len(t) for _, t in chunks[:12])
    got = got_all[start:start + n]
    assert (got - want).abs().max().item() <= 1e-5
    assert torch.equal(got.argmax(-1), want.argmax(-1))
