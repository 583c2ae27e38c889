"""HF checkpoint directories: single-file and sharded safetensors, tokenizer, config."""
from __future__ import annotations

import json

import torch
from safetensors.torch import load_file, save_file

from tokenmill.loader import load_model, resolve_model_path
from tokenmill.loader.hf import INDEX_FILE


def test_hf_directory_loads_with_tokenizer_and_chat_template(tiny_llama_dir):
    loaded = load_model(str(tiny_llama_dir))
    assert loaded.source == tiny_llama_dir
    assert loaded.hf_config.architectures == ["LlamaForCausalLM"]
    assert loaded.max_model_len == 4096
    assert 2 in loaded.eos_token_ids
    chat = loaded.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                                add_generation_prompt=True)
    assert chat.endswith("<|im_start|>assistant\n") and "hi" in chat
    # Every tensor of the checkpoint ends up in the model unchanged (q/k/v and gate/up are fused).
    saved = load_file(str(tiny_llama_dir / "model.safetensors"))
    ours = loaded.model.hf_state_dict()
    for name, tensor in saved.items():
        assert torch.equal(ours[name], tensor), name
    layer = loaded.model.layers[0]
    assert layer.qkv_proj.shape == (64 + 2 * 32, 64) and layer.qkv_proj.is_contiguous()
    assert layer.gate_up_proj.shape == (256, 64) and layer.gate_up_proj.is_contiguous()


def test_sharded_safetensors_with_index(tiny_copy):
    path = tiny_copy()
    tensors = load_file(str(path / "model.safetensors"))
    (path / "model.safetensors").unlink()
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[: len(names) // 2],
              "model-00002-of-00002.safetensors": names[len(names) // 2:]}
    weight_map = {}
    for shard, shard_names in shards.items():
        save_file({n: tensors[n] for n in shard_names}, str(path / shard), metadata={"format": "pt"})
        weight_map.update({n: shard for n in shard_names})
    (path / INDEX_FILE).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    loaded = load_model(str(path))
    ours = loaded.model.hf_state_dict()
    for name, tensor in tensors.items():
        assert torch.equal(ours[name], tensor), name


def test_bfloat16_load_casts_weights_and_kv(tiny_llama_dir):
    loaded = load_model(str(tiny_llama_dir), dtype=torch.bfloat16)
    assert loaded.model.layers[1].down_proj.dtype == torch.bfloat16
    assert loaded.model.kv_cache_spec().dtype == "bfloat16"
    assert loaded.model.kv_cache_spec().bytes_per_token() == 2 * 2 * 2 * 16 * 2


def test_default_model_name_resolves_to_bundled_gguf():
    path = resolve_model_path("smollm2-135m-instruct")
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.is_file()
    assert resolve_model_path("SmolLM2-135M-Instruct") == path
    with open(path, "rb") as f:
        assert f.read(4) == b"GGUF"
