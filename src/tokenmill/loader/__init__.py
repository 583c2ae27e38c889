"""Model loading: a name or path -> :class:`LoadedModel` (model with weights, HF config, tokenizer).

``load_model`` accepts the bundled default ``smollm2-135m-instruct``, an HF checkpoint directory
(config.json + safetensors + tokenizer files) or a ``.gguf`` file. All failures raise
:class:`ModelLoadError` (a ``ValueError``) naming the file, tensor or setting at fault.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from tokenmill.contracts.errors import ModelLoadError
from tokenmill.loader.resolve import DEFAULT_MODEL, ModelNotFoundError, resolve_model_path
from tokenmill.models.base import CausalLM

if TYPE_CHECKING:
    from tokenmill.layers.quant.methods import QuantConfig

__all__ = ["DEFAULT_MODEL", "LoadedModel", "ModelLoadError", "build_hf_reference", "load_model",
           "resolve_model_path"]


@dataclass
class LoadedModel:
    """A model ready to run, with what the engine needs around it."""

    model: CausalLM
    hf_config: Any                 # transformers.PretrainedConfig (loader/config.py: the base class for the Llama family)
    tokenizer: Any                 # HF fast tokenizer with the chat template
    eos_token_ids: list[int]
    max_model_len: int
    name: str
    source: Path

    def __post_init__(self) -> None:
        if self.max_model_len <= 0:
            raise ValueError(f"max_model_len must be positive, got {self.max_model_len}")


def _unique(ids: list[int | None]) -> list[int]:
    out: list[int] = []
    for i in ids:
        if i is not None and int(i) not in out:
            out.append(int(i))
    return out


def _config_eos(config: Any) -> list[int | None]:
    eos = getattr(config, "eos_token_id", None)
    return list(eos) if isinstance(eos, (list, tuple)) else [eos]


def load_model(name_or_path: str, dtype: torch.dtype = torch.float32,
               quantization: "QuantConfig | str | None" = None) -> LoadedModel:
    """Load ``name_or_path`` (bundled name, HF directory or GGUF file) with weights in ``dtype``.

    ``quantization`` (a :class:`~tokenmill.layers.quant.methods.QuantConfig` or its method name):
    ``auto`` (default) serves a GGUF file in its own block formats and an HF checkpoint dense;
    ``none`` dequantizes everything to ``dtype`` (the oracle); ``int8`` / ``int4`` quantize the
    dense weights at load.
    """
    from tokenmill.layers.quant.methods import QuantConfig, apply_quantization, finalize_linears
    from tokenmill.loader import gguf as gguf_loader
    from tokenmill.loader import hf
    from tokenmill.models.registry import architecture_of, build_model

    quant = QuantConfig.of(quantization)

    try:
        path = resolve_model_path(name_or_path)
    except ModelNotFoundError as e:
        raise ModelLoadError(str(e)) from e
    if path.is_dir():
        config = hf.load_hf_config(path)
        architecture_of(config)  # fail on an unknown architecture before reading weights
        weights = hf.read_safetensors(path)
        extra_eos: list[int | None] = list(hf.generation_eos_ids(path))
    elif path.suffix.lower() == ".gguf":
        if quant.method == "auto":
            config, weights = gguf_loader.read_gguf(path, native=True)
        else:
            config, weights = gguf_loader.read_gguf_cached(path)
        extra_eos = []
    else:
        raise ModelLoadError(f"{path} is neither a model directory nor a .gguf file")
    model = build_model(config, dtype=dtype)
    model.load_weights(weights)
    del weights
    apply_quantization(model, quant)
    finalize_linears(model, dtype)
    model.eval()
    # The tokenizer comes last: building one from GGUF metadata is the slow step on a first load.
    tokenizer = hf.load_hf_tokenizer(path, config) if path.is_dir() else gguf_loader.gguf_tokenizer(path)
    eos = _unique(extra_eos + _config_eos(config) + [getattr(tokenizer, "eos_token_id", None)])
    return LoadedModel(model=model, hf_config=config, tokenizer=tokenizer, eos_token_ids=eos,
                       max_model_len=int(config.max_position_embeddings),
                       name=name_or_path, source=path)


def build_hf_reference(loaded: LoadedModel) -> Any:
    """The HF transformers model for ``loaded.hf_config`` holding the same tensors (fp32, eval).

    For oracle tests: weights come from ``loaded.model.hf_state_dict()``, so a GGUF model's HF
    twin runs on exactly the dequantized values tokenmill runs on.
    """
    from transformers import AutoModelForCausalLM
    from transformers.initialization import no_init_weights

    from tokenmill.loader.config import hf_config

    dtype = loaded.model.dtype
    with no_init_weights():  # every weight is overwritten below; skip the random init
        ref = AutoModelForCausalLM.from_config(hf_config(loaded.hf_config), dtype=dtype)
    state = loaded.model.hf_state_dict()  # includes lm_head.weight even when tied: set it either way
    result = ref.load_state_dict(state, strict=False)
    missing = [k for k in result.missing_keys if not k.endswith("rotary_emb.inv_freq")]
    if missing or result.unexpected_keys:
        raise ModelLoadError(f"HF reference does not match tokenmill's weights: missing {missing}, "
                             f"unexpected {result.unexpected_keys}")
    return ref.eval()
