"""Every way a model can fail to load gives a ModelLoadError that names what is wrong."""
from __future__ import annotations

import json

import pytest
from safetensors.torch import load_file, save_file
from test_loader_gguf import _write, write_model_gguf

from tokenmill.loader import ModelLoadError, load_model


def _edit_config(path, **changes):
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(changes)
    (path / "config.json").write_text(json.dumps(cfg))


def test_error_is_a_value_error():
    assert issubclass(ModelLoadError, ValueError)


def test_unknown_name_or_path(tmp_path):
    with pytest.raises(ModelLoadError, match="not found.*smollm2-135m-instruct"):
        load_model(str(tmp_path / "no-such-model"))


def test_unknown_architecture_lists_supported(tiny_copy):
    path = tiny_copy()
    _edit_config(path, architectures=["GPTNeoXForCausalLM"])
    with pytest.raises(ModelLoadError) as e:
        load_model(str(path))
    msg = str(e.value)
    assert "GPTNeoXForCausalLM" in msg
    assert all(a in msg for a in ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"))


def test_architecture_unknown_to_transformers_too(tiny_copy):
    path = tiny_copy()
    _edit_config(path, architectures=["MadeUpForCausalLM"], model_type="made_up")
    with pytest.raises(ModelLoadError, match="unsupported architecture 'MadeUpForCausalLM'.*LlamaForCausalLM"):
        load_model(str(path))


def test_missing_config_json(tiny_copy):
    path = tiny_copy()
    (path / "config.json").unlink()
    with pytest.raises(ModelLoadError, match="config.json is missing"):
        load_model(str(path))


def test_invalid_config_json(tiny_copy):
    path = tiny_copy()
    (path / "config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="config.json is not valid JSON"):
        load_model(str(path))


def test_missing_tokenizer(tiny_copy):
    path = tiny_copy()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (path / name).unlink()
    with pytest.raises(ModelLoadError, match="no tokenizer files"):
        load_model(str(path))


def test_missing_weights(tiny_copy):
    path = tiny_copy()
    (path / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match=r"no \*\.safetensors weight files"):
        load_model(str(path))


def test_missing_shard_named(tiny_copy):
    path = tiny_copy()
    (path / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"model.norm.weight": "model-00002-of-00002.safetensors"}}))
    with pytest.raises(ModelLoadError, match="missing: model-00002-of-00002.safetensors"):
        load_model(str(path))


def test_corrupt_safetensors_header(tiny_copy):
    path = tiny_copy()
    (path / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{garbage header}")
    with pytest.raises(ModelLoadError, match="corrupt safetensors file .*model.safetensors"):
        load_model(str(path))


def test_truncated_safetensors(tiny_copy):
    path = tiny_copy()
    f = path / "model.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    with pytest.raises(ModelLoadError, match="corrupt safetensors file"):
        load_model(str(path))


def test_missing_tensor_named(tiny_copy):
    path = tiny_copy()
    tensors = load_file(str(path / "model.safetensors"))
    del tensors["model.layers.1.mlp.down_proj.weight"]
    save_file(tensors, str(path / "model.safetensors"))
    with pytest.raises(ModelLoadError, match="missing tensor.*model.layers.1.mlp.down_proj.weight"):
        load_model(str(path))


def test_shape_mismatch_named(tiny_copy):
    path = tiny_copy()
    _edit_config(path, intermediate_size=96)
    with pytest.raises(ModelLoadError, match=r"model.layers.0.mlp.gate_proj.weight has shape \(128, 64\), "
                                             r"expected \(96, 64\)"):
        load_model(str(path))


def test_unexpected_tensor_named(tiny_copy):
    path = tiny_copy()
    tensors = load_file(str(path / "model.safetensors"))
    tensors["model.layers.0.mlp.extra_proj.weight"] = tensors["model.norm.weight"].clone()
    save_file(tensors, str(path / "model.safetensors"))
    with pytest.raises(ModelLoadError, match="does not use: model.layers.0.mlp.extra_proj.weight"):
        load_model(str(path))


def test_bad_gguf_magic(tmp_path):
    f = tmp_path / "bad.gguf"
    f.write_bytes(b"NOPE" + bytes(64))
    with pytest.raises(ModelLoadError, match="corrupt GGUF file .*bad.gguf"):
        load_model(str(f))


def test_truncated_gguf(tiny_llama_dir, tmp_path):
    f = write_model_gguf(tiny_llama_dir, tmp_path / "m.gguf", "llama")
    f.write_bytes(f.read_bytes()[:100_000])
    with pytest.raises(ModelLoadError, match="corrupt GGUF file"):
        load_model(str(f))


def test_gguf_unknown_architecture(tmp_path):
    import numpy as np

    f = _write(tmp_path / "gpt2.gguf", {"w": (np.zeros((2, 32), np.float32), None)}, arch="gpt2")
    with pytest.raises(ModelLoadError, match="unsupported GGUF architecture 'gpt2'; supported: llama, qwen2, qwen3"):
        load_model(str(f))


def test_gguf_missing_tensor_named(tiny_llama_dir, tmp_path):
    f = write_model_gguf(tiny_llama_dir, tmp_path / "m.gguf", "llama", drop="model.layers.0.self_attn.v_proj.weight")
    with pytest.raises(ModelLoadError, match="missing tensor.*model.layers.0.self_attn.v_proj.weight"):
        load_model(str(f))


def test_not_a_model_file(tmp_path):
    f = tmp_path / "weights.bin"
    f.write_bytes(b"1234")
    with pytest.raises(ModelLoadError, match="neither a model directory nor a .gguf file"):
        load_model(str(f))
