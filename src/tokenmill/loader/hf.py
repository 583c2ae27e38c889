"""Read an HF checkpoint directory: config.json, safetensors weights (single file or sharded with
``model.safetensors.index.json``) and tokenizer files."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from tokenmill.contracts.errors import ModelLoadError

INDEX_FILE = "model.safetensors.index.json"


def load_hf_config(model_dir: Path) -> Any:
    """The transformers config of ``model_dir``; ModelLoadError if config.json is absent or bad."""
    cfg_path = model_dir / "config.json"
    if not cfg_path.is_file():
        raise ModelLoadError(f"{model_dir} is not a model directory: config.json is missing")
    try:
        raw = json.loads(cfg_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ModelLoadError(f"{cfg_path} is not valid JSON: {e}") from e
    if not isinstance(raw, dict) or "model_type" not in raw:
        raise ModelLoadError(f"{cfg_path} has no 'model_type' field")
    from tokenmill.models.registry import ARCHITECTURES, supported_architectures

    archs = raw.get("architectures") or []
    if archs and archs[0] not in ARCHITECTURES:  # say so before transformers trips on an unknown model_type
        raise ModelLoadError(f"unsupported architecture {archs[0]!r} in {cfg_path}; supported: "
                             f"{', '.join(supported_architectures())}")
    from tokenmill.loader.config import light_config

    try:
        config = light_config(raw)   # the Llama family, without importing its transformers class
    except (ValueError, TypeError) as e:
        raise ModelLoadError(f"{cfg_path}: invalid config: {e}") from e
    if config is not None:
        config._name_or_path = str(model_dir)
        return config
    from transformers import AutoConfig

    if archs and archs[0] == "DeepseekV3ForCausalLM" and raw["model_type"] != "deepseek_v3":
        # Kimi K2 ships model_type "kimi_k2" (remote code) with the DeepSeek-V3 architecture:
        # read it as the DeepseekV3Config it is, without running the repository's code.
        from transformers import DeepseekV3Config

        try:
            fields = {k: v for k, v in raw.items() if k not in ("model_type", "auto_map", "transformers_version")}
            return DeepseekV3Config(**fields)
        except (ValueError, KeyError, TypeError) as e:
            raise ModelLoadError(f"{cfg_path}: not a valid DeepSeek-V3 config ({raw['model_type']}): {e}") from e
    from huggingface_hub.errors import StrictDataclassError  # transformers 5 configs validate their fields

    try:
        return AutoConfig.from_pretrained(str(model_dir), local_files_only=True)
    except (ValueError, KeyError, OSError, TypeError, StrictDataclassError) as e:
        raise ModelLoadError(f"{cfg_path}: transformers cannot read this config: {e}") from e


def safetensors_files(model_dir: Path) -> list[Path]:
    """The weight files of ``model_dir``, from the shard index when there is one."""
    index = model_dir / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            names = sorted(set(weight_map.values()))
        except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as e:
            raise ModelLoadError(f"{index} is not a valid safetensors index: {e}") from e
        files = [model_dir / n for n in names]
        absent = [f.name for f in files if not f.is_file()]
        if absent:
            raise ModelLoadError(f"{index} lists weight shard(s) that are missing: {', '.join(absent)}")
        return files
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        others = [p.name for p in model_dir.iterdir() if p.suffix in (".bin", ".pt", ".pth", ".gguf")]
        hint = f" (found {', '.join(others)}; only safetensors are read from a directory)" if others else ""
        raise ModelLoadError(f"no *.safetensors weight files in {model_dir}{hint}")
    return files


def read_safetensors(model_dir: Path) -> dict[str, torch.Tensor]:
    """All tensors of the directory's safetensors files, by name (memory-mapped where possible)."""
    from safetensors import SafetensorError, safe_open

    out: dict[str, torch.Tensor] = {}
    for f in safetensors_files(model_dir):
        try:
            with safe_open(str(f), framework="pt") as st:
                for name in st.keys():
                    if name in out:
                        raise ModelLoadError(f"tensor {name} appears in more than one shard ({f.name})")
                    out[name] = st.get_tensor(name)
        except (SafetensorError, OSError, RuntimeError) as e:
            raise ModelLoadError(f"corrupt safetensors file {f}: {e}") from e
    return out


def load_hf_tokenizer(model_dir: Path, config: Any = None) -> Any:
    """The fast tokenizer (with chat template) saved in ``model_dir`` (``config``: the model's
    config as loaded, so transformers need not re-read a config.json it cannot parse itself)."""
    if not any((model_dir / n).is_file() for n in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        raise ModelLoadError(f"no tokenizer files (tokenizer.json / tokenizer_config.json) in {model_dir}")
    from transformers import AutoTokenizer

    try:
        extra = {"config": config} if config is not None else {}
        return AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True, **extra)
    except (ValueError, OSError, KeyError, TypeError) as e:
        raise ModelLoadError(f"cannot load the tokenizer in {model_dir}: {e}") from e


def generation_eos_ids(model_dir: Path) -> list[int]:
    """``eos_token_id`` of generation_config.json (int or list), if the file exists."""
    path = model_dir / "generation_config.json"
    if not path.is_file():
        return []
    try:
        eos = json.loads(path.read_text()).get("eos_token_id")
    except (json.JSONDecodeError, AttributeError) as e:
        raise ModelLoadError(f"{path} is not valid JSON: {e}") from e
    if eos is None:
        return []
    return [int(x) for x in (eos if isinstance(eos, list) else [eos])]
