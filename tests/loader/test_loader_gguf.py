"""GGUF: dequantization of each supported quant type, metadata -> config, tensor names and the
llama.cpp Q/K permutation, checked on GGUF files written here with ``gguf.GGUFWriter``."""
from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from safetensors.torch import load_file

from tokenmill.loader.gguf import dequantize_tensor, read_gguf
from tokenmill.loader.tiny import build_tiny_checkpoint

QK_K = 256


def _write(path: Path, tensors: dict[str, tuple[np.ndarray, Q | None]], arch: str = "llama",
           meta: dict[str, object] | None = None) -> Path:
    w = gguf.GGUFWriter(str(path), arch)
    for key, value in (meta or {}).items():
        if isinstance(value, bool):
            w.add_bool(key, value)
        elif isinstance(value, int):
            w.add_uint32(key, value)
        else:
            w.add_float32(key, float(value))
    for name, (data, qtype) in tensors.items():
        w.add_tensor(name, data, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _read_all(path: Path) -> dict[str, np.ndarray]:
    return {t.name: dequantize_tensor(t) for t in gguf.GGUFReader(str(path)).tensors}


@pytest.mark.parametrize("qtype", [Q.F32, Q.F16, Q.Q8_0, Q.Q4_0, Q.Q4_1])
def test_quantize_write_read_dequantize_round_trip(tmp_path, qtype):
    rng = np.random.default_rng(int(qtype))
    x = rng.standard_normal((6, 512)).astype(np.float32)
    data = x if qtype == Q.F32 else gguf.quants.quantize(x, qtype)
    out = _read_all(_write(tmp_path / "t.gguf", {"w": (data, None if qtype == Q.F32 else qtype)}))["w"]
    assert out.shape == x.shape and out.dtype == np.float32
    blocks = x.reshape(6, -1, 32)
    absmax = np.abs(blocks).max(-1, keepdims=True)
    span = blocks.max(-1, keepdims=True) - blocks.min(-1, keepdims=True)
    # Largest error each format allows: one quantization step (half a step plus rounding slack).
    tol = {Q.F32: np.zeros_like(absmax), Q.F16: absmax * 2.0 ** -10, Q.Q8_0: absmax / 127,
           Q.Q4_0: absmax / 8, Q.Q4_1: span / 15}[qtype]
    err = np.abs(out.reshape(blocks.shape) - blocks)
    assert (err <= tol + 1e-7).all()
    if qtype != Q.F32:
        assert err.max() > 0  # it really went through the quantized format


def _f16(v: np.ndarray) -> float:
    return float(v.view(np.float16)[0])


def _scale_min_k4(j: int, s: np.ndarray) -> tuple[int, int]:
    if j < 4:
        return int(s[j]) & 63, int(s[j + 4]) & 63
    return ((int(s[j + 4]) & 0xF) | ((int(s[j - 4]) >> 6) << 4),
            (int(s[j + 4]) >> 4) | ((int(s[j]) >> 6) << 4))


def _ref_q4_k(block: np.ndarray) -> np.ndarray:
    """Scalar transcription of ggml's dequantize_row_q4_K for one 144-byte block."""
    d, dmin = _f16(block[0:2]), _f16(block[2:4])
    scales, qs = block[4:16], block[16:144]
    y = np.zeros(QK_K, dtype=np.float64)
    for n, j in enumerate(range(0, QK_K, 64)):
        sc1, m1 = _scale_min_k4(2 * n, scales)
        sc2, m2 = _scale_min_k4(2 * n + 1, scales)
        q = qs[32 * n: 32 * n + 32]
        for lane in range(32):
            y[j + lane] = d * sc1 * (int(q[lane]) & 0xF) - dmin * m1
            y[j + 32 + lane] = d * sc2 * (int(q[lane]) >> 4) - dmin * m2
    return y


def _ref_q6_k(block: np.ndarray) -> np.ndarray:
    """Scalar transcription of ggml's dequantize_row_q6_K for one 210-byte block."""
    ql, qh, sc = block[0:128], block[128:192], block[192:208].view(np.int8)
    d = _f16(block[208:210])
    y = np.zeros(QK_K, dtype=np.float64)
    for half in range(2):
        l0, h0, s0, y0 = 64 * half, 32 * half, 8 * half, 128 * half
        for lane in range(32):
            i = lane // 16
            low0, low1, high = int(ql[l0 + lane]), int(ql[l0 + lane + 32]), int(qh[h0 + lane])
            q1 = ((low0 & 0xF) | (((high >> 0) & 3) << 4)) - 32
            q2 = ((low1 & 0xF) | (((high >> 2) & 3) << 4)) - 32
            q3 = ((low0 >> 4) | (((high >> 4) & 3) << 4)) - 32
            q4 = ((low1 >> 4) | (((high >> 6) & 3) << 4)) - 32
            y[y0 + lane] = d * sc[s0 + i] * q1
            y[y0 + lane + 32] = d * sc[s0 + i + 2] * q2
            y[y0 + lane + 64] = d * sc[s0 + i + 4] * q3
            y[y0 + lane + 96] = d * sc[s0 + i + 6] * q4
    return y


@pytest.mark.parametrize("qtype,block_bytes,scale_at,reference", [
    (Q.Q4_K, 144, (0, 2), _ref_q4_k),
    (Q.Q6_K, 210, (208,), _ref_q6_k),
])
def test_k_quant_blocks_match_ggml_reference(tmp_path, qtype, block_bytes, scale_at, reference):
    """The python gguf package cannot quantize K-quants, so blocks are built by hand (random
    bytes with sane fp16 scales) and checked against a scalar transcription of ggml's decoder."""
    rng = np.random.default_rng(7)
    rows, blocks_per_row = 3, 2
    raw = rng.integers(0, 256, size=(rows, blocks_per_row * block_bytes), dtype=np.uint8)
    for r in range(rows):
        for b in range(blocks_per_row):
            for off in scale_at:
                scale = np.array([rng.uniform(0.01, 0.1)], dtype=np.float16).view(np.uint8)
                raw[r, b * block_bytes + off: b * block_bytes + off + 2] = scale
    out = _read_all(_write(tmp_path / "k.gguf", {"w": (raw, qtype)}))["w"]
    assert out.shape == (rows, blocks_per_row * QK_K)
    expected = np.concatenate([
        np.concatenate([reference(raw[r, b * block_bytes:(b + 1) * block_bytes]) for b in range(blocks_per_row)])
        for r in range(rows)]).reshape(out.shape)
    np.testing.assert_allclose(out, expected, rtol=1e-6, atol=1e-6)


# ---- a whole model in GGUF form -------------------------------------------------------------------
_HF_TO_GGUF = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
               "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
               "self_attn.k_norm": "attn_k_norm", "input_layernorm": "attn_norm",
               "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
               "mlp.down_proj": "ffn_down"}


def _gguf_name(hf_name: str) -> str:
    fixed = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    if hf_name in fixed:
        return fixed[hf_name]
    _, _, layer, *rest = hf_name.split(".")
    module, kind = ".".join(rest[:-1]), rest[-1]
    return f"blk.{layer}.{_HF_TO_GGUF[module]}.{kind}"


def _llama_cpp_permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """What llama.cpp's converter does to llama Q/K weights."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_model_gguf(hf_dir: Path, out: Path, arch: str, drop: str | None = None) -> Path:
    cfg = json.loads((hf_dir / "config.json").read_text())
    tensors = {}
    for name, t in load_file(str(hf_dir / "model.safetensors")).items():
        if name == drop:
            continue
        w = t.numpy()
        if arch == "llama" and name.endswith("q_proj.weight"):
            w = _llama_cpp_permute(w, cfg["num_attention_heads"])
        elif arch == "llama" and name.endswith("k_proj.weight"):
            w = _llama_cpp_permute(w, cfg["num_key_value_heads"])
        tensors[_gguf_name(name)] = (np.ascontiguousarray(w), None)
    meta = {f"{arch}.block_count": cfg["num_hidden_layers"], f"{arch}.context_length": 2048,
            f"{arch}.embedding_length": cfg["hidden_size"], f"{arch}.feed_forward_length": cfg["intermediate_size"],
            f"{arch}.attention.head_count": cfg["num_attention_heads"],
            f"{arch}.attention.head_count_kv": cfg["num_key_value_heads"],
            f"{arch}.attention.layer_norm_rms_epsilon": cfg["rms_norm_eps"],
            f"{arch}.rope.freq_base": 10000.0, f"{arch}.vocab_size": cfg["vocab_size"],
            "tokenizer.ggml.eos_token_id": 2}
    if "head_dim" in cfg:
        meta[f"{arch}.attention.key_length"] = cfg["head_dim"]
    return _write(out, tensors, arch=arch, meta=meta)


@pytest.mark.parametrize("arch,hf_arch", [("llama", "LlamaForCausalLM"), ("qwen2", "Qwen2ForCausalLM"),
                                          ("qwen3", "Qwen3ForCausalLM")])
def test_model_gguf_gives_hf_config_and_original_tensors(tmp_path, arch, hf_arch):
    hf_dir = build_tiny_checkpoint(tmp_path / "hf", hf_arch, seed=5)
    ckpt = read_gguf(write_model_gguf(hf_dir, tmp_path / "m.gguf", arch))
    c = ckpt.config
    assert c.architectures == [hf_arch]
    assert (c.hidden_size, c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads) == (64, 2, 4, 2)
    assert c.rms_norm_eps == 1e-5 and c.tie_word_embeddings is True and c.max_position_embeddings == 2048
    assert c.eos_token_id == 2
    original = load_file(str(hf_dir / "model.safetensors"))
    assert set(ckpt.weights) == set(original)
    for name, tensor in original.items():
        assert torch.equal(ckpt.weights[name], tensor), name  # llama Q/K permutation undone


def test_dequantized_gguf_cache_round_trip_and_repair(tmp_path, monkeypatch, tiny_llama_dir):
    from tokenmill.loader.gguf import read_gguf_cached

    monkeypatch.setenv("TOKENMILL_CACHE", str(tmp_path / "cache"))
    f = write_model_gguf(tiny_llama_dir, tmp_path / "m.gguf", "llama")
    fresh = read_gguf(f)
    first = read_gguf_cached(f)
    entries = list((tmp_path / "cache").glob("gguf-*"))
    assert len(entries) == 1 and (entries[0] / "model.safetensors").is_file()
    (entries[0] / "model.safetensors").write_bytes(b"damaged")
    for ckpt in (first, read_gguf_cached(f), read_gguf_cached(f)):  # built, repaired, then read back
        assert ckpt.config.to_dict() == fresh.config.to_dict()
        assert set(ckpt.weights) == set(fresh.weights)
        assert all(torch.equal(ckpt.weights[n], fresh.weights[n]) for n in fresh.weights)
    monkeypatch.setenv("TOKENMILL_GGUF_CACHE", "0")
    monkeypatch.setenv("TOKENMILL_CACHE", str(tmp_path / "cache2"))
    read_gguf_cached(f)
    assert not (tmp_path / "cache2").exists()
