"""GGUF block types served natively: repacked values equal the ``gguf`` package's dequantization,
unsupported types and bad shapes are refused naming the tensor and type, and a whole GGUF model
loads with its matrices kept in their block formats."""
from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from tokenmill._native import quant as native
from tokenmill.contracts.errors import ModelLoadError
from tokenmill.layers.quant.gguf import BLOCKS, GGUF_FORMATS, gguf_linear
from tokenmill.layers.quant.packed import Int4Linear, Int8Linear
from tokenmill.loader.gguf import read_gguf

pytestmark = pytest.mark.skipif(not native.available(), reason=str(native.unavailable_reason()))


def _random_k_blocks(rng: np.random.Generator, rows: int, cols: int, qtype: str) -> np.ndarray:
    """Random K-quant bytes with sane fp16 scales (the gguf package cannot quantize K types)."""
    per, nbytes = BLOCKS[qtype]
    raw = rng.integers(0, 256, size=(rows, cols // per, nbytes), dtype=np.uint8)
    offsets = (0, 2) if qtype == "Q4_K" else (208,)
    for off in offsets:
        raw[:, :, off:off + 2] = rng.uniform(0.005, 0.05, size=raw.shape[:2]).astype(np.float16)[..., None].view(np.uint8)
    return raw.reshape(rows, -1)


def _raw(rng: np.random.Generator, qtype: str, rows: int, cols: int) -> np.ndarray:
    if qtype in ("Q4_K", "Q6_K"):
        return _random_k_blocks(rng, rows, cols, qtype)
    return gguf.quants.quantize(rng.standard_normal((rows, cols)).astype(np.float32), Q[qtype])


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "Q4_1", "Q4_K"])
@pytest.mark.parametrize("rows,cols", [(3, 256), (7, 512), (1, 768)])
def test_native_formats_hold_exactly_the_gguf_values(qtype, rows, cols):
    rng = np.random.default_rng(rows * cols)
    raw = _raw(rng, qtype, rows, cols)
    expected = torch.from_numpy(gguf.quants.dequantize(raw, Q[qtype]).reshape(rows, cols).astype(np.float32))
    method = gguf_linear(raw, qtype, rows, cols, "blk.0.ffn_up.weight")
    assert isinstance(method, Int8Linear if qtype == "Q8_0" else Int4Linear)
    # exact up to one float rounding (the kernel computes scale*q+min with one fma)
    torch.testing.assert_close(method.dequantize(), expected, rtol=2 ** -22, atol=1e-7)
    bytes_per_value = method.weight_bytes() / (rows * cols)
    assert bytes_per_value <= {"Q8_0": 34 / 32, "Q4_0": 24 / 32, "Q4_1": 20 / 32, "Q4_K": 24 / 32}[qtype] + 1e-9
    x = torch.randn(2, cols)
    y = method(x)  # the int16-activation kernel: no fp32 copy of the weight anywhere
    xq, xd, _ = native.quantize_act(x)
    xhat = (xq.float().view(2, -1, 32) * xd.unsqueeze(-1)).view(2, -1)
    ref = xhat.double() @ expected.double().T
    assert ((y - ref).abs() <= 1e-5 * (xhat.abs().double() @ expected.abs().double().T) + 1e-6).all()


def test_q6_k_is_served_as_int8_within_half_a_step():
    rng = np.random.default_rng(2)
    raw = _raw(rng, "Q6_K", 4, 512)
    expected = torch.from_numpy(gguf.quants.dequantize(raw, Q.Q6_K).reshape(4, 512).astype(np.float32))
    method = gguf_linear(raw, "Q6_K", 4, 512, "blk.1.attn_v.weight")
    assert isinstance(method, Int8Linear) and method.group_size == 32
    step = method._expand(method.scales)
    assert ((method.dequantize() - expected).abs() <= step / 2 + 1e-6 * expected.abs() + 1e-7).all()


def test_unsupported_type_and_bad_shapes_are_refused_by_name():
    with pytest.raises(ModelLoadError, match=r"blk\.3\.ffn_down\.weight has type Q5_0.*not serve"):
        gguf_linear(np.zeros(22 * 4, np.uint8), "Q5_0", 2, 64, "blk.3.ffn_down.weight")
    with pytest.raises(ModelLoadError, match=r"blk\.0\.attn_q\.weight of type Q4_1 has rows of 48 values"):
        gguf_linear(np.zeros(40, np.uint8), "Q4_1", 2, 48, "blk.0.attn_q.weight")
    with pytest.raises(ModelLoadError, match=r"token_embd\.weight of type Q8_0: 33 bytes"):
        gguf_linear(np.zeros(33, np.uint8), "Q8_0", 1, 32, "token_embd.weight")
    assert set(GGUF_FORMATS) >= {"Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q6_K"}


# ---- a whole tiny model in GGUF block formats ------------------------------------------------------
def _write_model(path: Path, hf_dir: Path, qtype_of) -> Path:
    import json

    from safetensors.torch import load_file

    names = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
             "self_attn.o_proj": "attn_output", "input_layernorm": "attn_norm",
             "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
             "mlp.down_proj": "ffn_down"}
    cfg = json.loads((hf_dir / "config.json").read_text())
    w = gguf.GGUFWriter(str(path), "llama")
    for key, value in {"llama.block_count": cfg["num_hidden_layers"], "llama.context_length": 2048,
                       "llama.embedding_length": cfg["hidden_size"],
                       "llama.feed_forward_length": cfg["intermediate_size"],
                       "llama.attention.head_count": cfg["num_attention_heads"],
                       "llama.attention.head_count_kv": cfg["num_key_value_heads"],
                       "llama.vocab_size": cfg["vocab_size"]}.items():
        w.add_uint32(key, value)
    w.add_float32("llama.attention.layer_norm_rms_epsilon", cfg["rms_norm_eps"])
    w.add_float32("llama.rope.freq_base", 10000.0)
    for name, t in load_file(str(hf_dir / "model.safetensors")).items():
        a = t.numpy()
        if name.endswith(("q_proj.weight", "k_proj.weight")):  # llama.cpp's converter permutation
            heads = cfg["num_attention_heads"] if "q_proj" in name else cfg["num_key_value_heads"]
            a = a.reshape(heads, 2, a.shape[0] // heads // 2, a.shape[1]).swapaxes(1, 2).reshape(a.shape)
        if name == "model.embed_tokens.weight":
            gname = "token_embd.weight"
        elif name == "model.norm.weight":
            gname = "output_norm.weight"
        else:
            _, _, layer, *rest = name.split(".")
            gname = f"blk.{layer}.{names['.'.join(rest[:-1])]}.{rest[-1]}"
        qtype = qtype_of(gname) if a.ndim == 2 else None
        if qtype is None:
            w.add_tensor(gname, np.ascontiguousarray(a))
        else:
            w.add_tensor(gname, gguf.quants.quantize(np.ascontiguousarray(a), qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def tiny_hf(tmp_path_factory) -> Path:
    from tokenmill.loader.tiny import build_tiny_checkpoint

    return build_tiny_checkpoint(tmp_path_factory.mktemp("qtiny") / "hf", "LlamaForCausalLM", seed=3)


def _mixed(gname: str):
    # q/k/v in different types (a fused qkv must fall back), embeddings Q8_0, MLP Q4_1 / Q4_0
    return {"attn_q": Q.Q4_0, "attn_k": Q.Q4_1, "attn_v": Q.Q8_0, "attn_output": Q.Q4_1, "ffn_gate": Q.Q4_1,
            "ffn_up": Q.Q4_1, "ffn_down": Q.Q4_0, "token_embd": Q.Q8_0}[gname.split(".")[-2] if gname.startswith("blk")
                                                                        else gname.split(".")[0]]


def test_gguf_model_loads_natively_with_the_same_weights(tmp_path, tiny_hf):
    from tokenmill.models.registry import build_model

    path = _write_model(tmp_path / "m.gguf", tiny_hf, _mixed)
    native_ckpt, dense_ckpt = read_gguf(path, native=True), read_gguf(path, native=False)
    assert isinstance(native_ckpt.weights["model.layers.0.self_attn.q_proj.weight"], Int4Linear)
    for name, w in native_ckpt.weights.items():  # the Q/K permutation is undone on quantized rows too
        got = w if isinstance(w, torch.Tensor) else w.dequantize()
        torch.testing.assert_close(got, dense_ckpt.weights[name], rtol=2 ** -22, atol=1e-7, msg=name)
    model = build_model(native_ckpt.config)
    model.load_weights(native_ckpt.weights)
    layer = model.layers[0]
    assert isinstance(layer.gate_up_proj, Int4Linear)          # Q4_1 + Q4_1 fused exactly
    assert isinstance(layer.qkv_proj, Int8Linear)              # Q4_0 + Q4_1 + Q8_0: int8 groups of 32
    assert isinstance(model.lm_head, Int8Linear) and model.lm_head is model.embed_tokens
    ref = build_model(dense_ckpt.config)
    ref.load_weights(dense_ckpt.weights)
    ours, theirs = model.hf_state_dict(), ref.hf_state_dict()
    for name in theirs:
        step = 1e-7 if "self_attn.q_proj" not in name and "k_proj" not in name and "v_proj" not in name else 0.05
        assert (ours[name] - theirs[name]).abs().max() <= step * max(1.0, theirs[name].abs().max().item()), name


def test_unsupported_gguf_type_in_a_model_names_the_tensor(tmp_path, tiny_hf):
    from tokenmill.loader import load_model

    path = _write_model(tmp_path / "bad.gguf", tiny_hf,
                        lambda g: Q.Q5_1 if g == "blk.1.ffn_up.weight" else None)
    with pytest.raises(ModelLoadError, match=r"blk\.1\.ffn_up\.weight has type Q5_1"):
        load_model(str(path))
