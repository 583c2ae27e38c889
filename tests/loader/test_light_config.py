"""The Llama-family configs built without transformers' per-model classes (loader/config.py)
against those classes: the defaults table equals each class's field defaults, and every config
variant (each optional field left out in turn, legacy rope fields, GQA, tied embeddings) gives
the same model arguments, context length and token ids as the class would."""
from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import pytest
from transformers import AutoConfig

from tokenmill.contracts.errors import ModelLoadError
from tokenmill.loader.config import LIGHT_ARCHITECTURES, LIGHT_DEFAULTS, config_dict, hf_config, is_light, light_config
from tokenmill.models.registry import ARCHITECTURES

ARCH_OF = {mt: arch for arch, mt in LIGHT_ARCHITECTURES.items()}


def _class_defaults(model_type: str) -> dict[str, object]:
    cls = type(AutoConfig.for_model(model_type))
    return {f.name: f.default for f in dataclasses.fields(cls) if f.default is not dataclasses.MISSING}


@pytest.mark.parametrize("model_type", sorted(LIGHT_DEFAULTS))
def test_defaults_table_is_the_classes_own(model_type):
    ours, theirs = LIGHT_DEFAULTS[model_type], _class_defaults(model_type)
    for key, value in ours.items():
        assert key in theirs, f"{model_type}: {key} is not a field of the transformers class"
        assert theirs[key] == value, f"{model_type}.{key}: ours {value!r}, transformers {theirs[key]!r}"
    # every field the registry reads that the class defaults is in the table
    read = {"vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "rms_norm_eps", "max_position_embeddings", "tie_word_embeddings",
            "hidden_act", "attention_bias", "mlp_bias", "use_sliding_window", "head_dim", "eos_token_id"}
    missing = sorted(k for k in read & set(theirs) if k not in ours)
    assert not missing, f"{model_type}: class defaults not in the table: {missing}"


def _base(model_type: str) -> dict[str, object]:
    return {"architectures": [ARCH_OF[model_type]], "model_type": model_type, "vocab_size": 512,
            "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
            "num_key_value_heads": 2, "head_dim": 16, "rms_norm_eps": 1e-5, "max_position_embeddings": 4096,
            "tie_word_embeddings": True, "hidden_act": "silu", "rope_parameters": {"rope_theta": 5e5, "rope_type": "default"},
            "bos_token_id": 7, "eos_token_id": [8, 9], "attention_bias": False}


def _variants(model_type: str):
    base = _base(model_type)
    yield "as written", base
    for key in base:
        if key not in ("architectures", "model_type"):
            yield f"without {key}", {k: v for k, v in base.items() if k != key}
    legacy = {k: v for k, v in base.items() if k != "rope_parameters"}
    yield "legacy rope_theta", {**legacy, "rope_theta": 1e6}
    yield "legacy linear scaling", {**legacy, "rope_theta": 1e6, "rope_scaling": {"type": "linear", "factor": 2.0}}
    yield "legacy llama3 scaling", {**legacy, "rope_scaling": {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 1024}}
    yield "yarn parameters", {**base, "rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0,
                                                          "original_max_position_embeddings": 1024}}
    yield "no kv heads, no head_dim", {k: v for k, v in base.items() if k not in ("num_key_value_heads", "head_dim")}


def _case_ids():
    return [(mt, name, raw) for mt in sorted(LIGHT_DEFAULTS) for name, raw in _variants(mt)]


@pytest.mark.parametrize("model_type,name,raw", _case_ids(), ids=[f"{mt}-{n}" for mt, n, _ in _case_ids()])
def test_every_variant_gives_what_the_class_gives(model_type, name, raw):
    light = light_config(json.loads(json.dumps(raw)))
    ref = AutoConfig.for_model(model_type, **{k: v for k, v in json.loads(json.dumps(raw)).items() if k != "model_type"})
    assert is_light(light) and not is_light(ref)
    args_of = ARCHITECTURES[ARCH_OF[model_type]].args_from_config
    try:
        expected = args_of(ref)
    except ModelLoadError as e:   # refused either way, with the same message
        with pytest.raises(ModelLoadError, match=str(e)[:40]):
            args_of(light)
        return
    assert args_of(light) == expected
    for key in ("max_position_embeddings", "eos_token_id", "bos_token_id", "tie_word_embeddings", "architectures"):
        assert getattr(light, key) == getattr(ref, key), key
    back = hf_config(light)
    assert type(back) is type(ref) and args_of(back) == expected
    assert config_dict(light)["model_type"] == model_type


def test_other_types_and_mismatched_architectures_keep_their_class():
    assert light_config({"model_type": "deepseek_v3", "architectures": ["DeepseekV3ForCausalLM"]}) is None
    assert light_config({"model_type": "llama", "architectures": ["Qwen2ForCausalLM"]}) is None
    assert light_config({"model_type": "llama"}) is None
    with pytest.raises(ValueError, match="hidden_size must be a positive integer, got 'abc'"):
        light_config({**_base("llama"), "hidden_size": "abc"})


def test_loading_the_default_model_imports_no_model_config_class():
    """What it is for: a served Llama-family model never imports transformers.activations (and
    with it torch._dynamo); checked in a fresh interpreter. The first load of a GGUF on a machine
    builds its tokenizer with transformers' GGUF reader, which does import them, and caches it; so
    the check is on a second load, after the first has filled the cache if nothing had. The answer
    must not depend on which tests ran before this one (a parallel run failed it on a cold cache)."""
    code = ("import sys; from tokenmill.loader import load_model; lm = load_model('smollm2-135m-instruct'); "
            "print(type(lm.hf_config).__name__, 'transformers.activations' in sys.modules, 'torch._dynamo' in sys.modules)")
    runs = [subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True)
            for _ in range(2)]
    assert runs[1].stdout.split() == ["PreTrainedConfig", "False", "False"], runs[1].stdout + runs[1].stderr
    assert runs[0].stdout.split()[0] == "PreTrainedConfig", runs[0].stdout + runs[0].stderr


def test_config_classes_switch_gives_the_same_arguments(tiny_llama_dir, monkeypatch):
    """TOKENMILL_CONFIG_CLASSES=1 (the A/B switch) loads the transformers class instead: same arguments."""
    from tokenmill.loader.hf import load_hf_config

    light = load_hf_config(tiny_llama_dir)
    monkeypatch.setenv("TOKENMILL_CONFIG_CLASSES", "1")
    ref = load_hf_config(tiny_llama_dir)
    assert is_light(light) and type(ref).__name__ == "LlamaConfig"
    args_of = ARCHITECTURES["LlamaForCausalLM"].args_from_config
    assert args_of(light) == args_of(ref)


@pytest.mark.parametrize("tokenizer_class", [None, "LlamaTokenizer", "GPT2Tokenizer", "Qwen2Tokenizer"])
def test_tokenizer_loads_the_same_with_the_light_config(tiny_llama_dir, tmp_path, tokenizer_class):
    """AutoTokenizer is given the loaded config (so it need not read config.json itself); the
    plain PretrainedConfig must pick the same tokenizer as the model's class would, whatever
    tokenizer_config.json names (or when it names nothing)."""
    import shutil

    from tokenmill.loader.hf import load_hf_config, load_hf_tokenizer

    d = tmp_path / "m"
    shutil.copytree(tiny_llama_dir, d)
    tc = json.loads((d / "tokenizer_config.json").read_text())
    tc.pop("tokenizer_class", None)
    if tokenizer_class:
        tc["tokenizer_class"] = tokenizer_class
    (d / "tokenizer_config.json").write_text(json.dumps(tc))
    light = load_hf_config(d)
    ours, ref = load_hf_tokenizer(d, light), load_hf_tokenizer(d, hf_config(light))
    assert type(ours) is type(ref)
    text = "def f(x):\n    return x + 1  # héllo"
    assert ours.encode(text) == ref.encode(text) and ours.eos_token_id == ref.eos_token_id
    chat = [{"role": "user", "content": text}]
    assert ours.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) == \
        ref.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
