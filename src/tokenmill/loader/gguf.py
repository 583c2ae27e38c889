"""Read a GGUF file: config from its metadata, weights (native block formats or fp32), tokenizer.

``read_gguf(path, native=True)`` keeps the weight matrices in their own block types (Q8_0, Q4_0,
Q4_1, Q4_K; Q6_K through int8): each becomes a quantized linear method of
``tokenmill.layers.quant.gguf`` and is never expanded to fp32; other types are refused, naming the
tensor. With ``native=False`` (quantization ``none``, the oracle) every tensor is dequantized with the
``gguf`` package (every type it knows: F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q2_K..Q8_K, ...).
Either way tensors are renamed to HF names. llama.cpp's converter
permutes the rows of the Q and K projections of ``llama``-architecture models (it interleaves the
two rotary halves of each head); :func:`unpermute_qk` undoes that (on quantized rows too, by
reordering whole rows) so the tensors equal the HF originals. The tokenizer and chat template come from the GGUF metadata through transformers and
are cached on disk (building them takes seconds).
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch

from tokenmill.contracts.errors import ModelLoadError
from tokenmill.loader.config import config_dict
from tokenmill.loader.gguf_file import GGUFFile

# GGUF general.architecture -> (HF architecture, HF model_type)
GGUF_ARCHS = {"llama": ("LlamaForCausalLM", "llama"), "qwen2": ("Qwen2ForCausalLM", "qwen2"),
              "qwen3": ("Qwen3ForCausalLM", "qwen3")}

_GLOBAL_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
                 "output.weight": "lm_head.weight"}
_BLOCK_NAMES = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
                "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm",
                "attn_k_norm": "self_attn.k_norm", "attn_norm": "input_layernorm",
                "ffn_norm": "post_attention_layernorm", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
                "ffn_down": "mlp.down_proj"}
_BLOCK_RE = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")


class GGUFCheckpoint(NamedTuple):
    config: Any                       # PretrainedConfig built from the metadata (loader/config.py)
    weights: dict[str, Any]           # HF names -> fp32 tensor, or a LinearMethod when native


def hf_tensor_name(gguf_name: str) -> str:
    """HF name of a GGUF tensor name; ModelLoadError for a tensor tokenmill does not know."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    m = _BLOCK_RE.match(gguf_name)
    if m and m.group(2) in _BLOCK_NAMES:
        return f"model.layers.{m.group(1)}.{_BLOCK_NAMES[m.group(2)]}.{m.group(3)}"
    raise ModelLoadError(f"GGUF tensor {gguf_name!r} is not one tokenmill knows how to use")


def unpermute_qk(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's per-head row interleave of a Q or K weight ``[n_heads * head_dim, in]``."""
    rows = w.shape[0]
    if rows % (2 * n_heads):
        raise ModelLoadError(f"cannot unpermute a Q/K tensor of {rows} rows into {n_heads} heads")
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


_SKIPPED_ARRAYS = ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type",
                   "tokenizer.ggml.scores")   # read only for their length (the tokenizer is cached)


def _open(path: Path) -> Any:
    """The file's ``fields`` and ``tensors``: read by :class:`GGUFFile`, or with
    ``TOKENMILL_GGUF_READER=gguf`` by the ``gguf`` package's ``GGUFReader`` (the reference, for
    A/B checks such as ``benchmarks/startup.py``)."""
    if not path.is_file():
        raise ModelLoadError(f"GGUF file {path} does not exist")
    try:
        if os.environ.get("TOKENMILL_GGUF_READER") == "gguf":
            return _ReferenceReader(path)
        return GGUFFile(path, skip=_SKIPPED_ARRAYS)
    except Exception as e:  # ValueError, struct or unicode errors on bad input
        raise ModelLoadError(f"corrupt GGUF file {path}: {type(e).__name__}: {e}") from e


class _ReferenceReader:
    """``gguf.GGUFReader``'s tensors, with its fields as :class:`GGUFFile` gives them."""

    def __init__(self, path: Path) -> None:
        import gguf as gguflib

        reader = gguflib.GGUFReader(str(path))
        self.tensors = reader.tensors
        self.fields: dict[str, Any] = {}
        for key, field in reader.fields.items():
            if key.startswith("GGUF."):   # the reader's header pseudo-fields
                continue
            if key in _SKIPPED_ARRAYS:
                self.fields[key + ".len"] = len(field.data)
            else:
                self.fields[key] = field.contents()


def _f32(v: float) -> float:
    """The shortest decimal that reads back to the same float32 (GGUF stores 1e-5 as 9.99e-6)."""
    return float(str(np.float32(v)))


def config_from_metadata(meta: dict[str, Any], tensor_names: set[str], path: Path) -> Any:
    """The config (``loader/config.py``'s ``PretrainedConfig`` with the model type's defaults, as
    ``transformers.AutoConfig.for_model`` would fill them) equivalent to the GGUF metadata."""
    arch = meta.get("general.architecture")
    if arch not in GGUF_ARCHS:
        raise ModelLoadError(f"{path}: unsupported GGUF architecture {arch!r}; supported: "
                             f"{', '.join(sorted(GGUF_ARCHS))}")
    hf_arch, model_type = GGUF_ARCHS[arch]

    def need(key: str) -> Any:
        full = f"{arch}.{key}"
        if full not in meta:
            raise ModelLoadError(f"{path}: GGUF metadata lacks {full!r}")
        return meta[full]

    heads = int(need("attention.head_count"))
    hidden = int(need("embedding_length"))
    cfg: dict[str, Any] = dict(
        architectures=[hf_arch],
        vocab_size=int(meta.get("tokenizer.ggml.tokens.len") or meta.get(f"{arch}.vocab_size") or 0),
        hidden_size=hidden,
        intermediate_size=int(need("feed_forward_length")),
        num_hidden_layers=int(need("block_count")),
        num_attention_heads=heads,
        num_key_value_heads=int(meta.get(f"{arch}.attention.head_count_kv", heads)),
        max_position_embeddings=int(need("context_length")),
        rms_norm_eps=_f32(need("attention.layer_norm_rms_epsilon")),
        tie_word_embeddings="output.weight" not in tensor_names,
        head_dim=int(meta.get(f"{arch}.attention.key_length", hidden // heads)),
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_id=meta.get("tokenizer.ggml.eos_token_id"),
        pad_token_id=meta.get("tokenizer.ggml.padding_token_id"),
    )
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": _f32(meta.get(f"{arch}.rope.freq_base", 10000.0))}
    scaling = meta.get(f"{arch}.rope.scaling.type", "none")
    if scaling == "linear":
        rope.update(rope_type="linear", factor=_f32(meta[f"{arch}.rope.scaling.factor"]))
    elif scaling != "none":
        raise ModelLoadError(f"{path}: GGUF rope scaling {scaling!r} is not supported (only none or linear)")
    if "rope_freqs.weight" in tensor_names:
        raise ModelLoadError(f"{path}: GGUF per-frequency rope factors (rope_freqs.weight, Llama 3.1 style) are "
                             "not supported; load the HF directory of this model instead")
    cfg["rope_parameters"] = rope
    if model_type != "llama":
        cfg["use_sliding_window"] = False
    if cfg["vocab_size"] <= 0:
        raise ModelLoadError(f"{path}: GGUF metadata gives no vocabulary (tokenizer.ggml.tokens)")
    from tokenmill.loader.config import light_config

    try:
        config = light_config({**cfg, "model_type": model_type})
        if config is None:   # TOKENMILL_CONFIG_CLASSES=1
            from transformers import AutoConfig

            config = AutoConfig.for_model(model_type, **cfg)
        return config
    except (ValueError, TypeError) as e:
        raise ModelLoadError(f"{path}: GGUF metadata makes an invalid {model_type} config: {e}") from e


def dequantize_tensor(tensor: Any) -> np.ndarray:
    """fp32 array of a GGUF tensor (``GGUFFile`` or ``GGUFReader``), in row-major ``[rows, cols]`` (GGUF shape reversed)."""
    from gguf import quants

    shape = tuple(int(x) for x in reversed(tensor.shape.tolist()))
    try:
        arr = quants.dequantize(tensor.data, tensor.tensor_type)
    except Exception as e:
        raise ModelLoadError(f"cannot dequantize GGUF tensor {tensor.name} of type "
                             f"{tensor.tensor_type.name}: {type(e).__name__}: {e}") from e
    if arr.size != int(np.prod(shape)):
        raise ModelLoadError(f"GGUF tensor {tensor.name}: {arr.size} values, shape says {shape}")
    from gguf import GGMLQuantizationType

    if tensor.tensor_type == GGMLQuantizationType.F32:  # a view of the file's memory map: copy it out
        return np.array(arr.reshape(shape), dtype=np.float32)
    return arr.reshape(shape).astype(np.float32, copy=False)  # already a fresh array


def unpermute_index(rows: int, n_heads: int) -> np.ndarray:
    """Row order that :func:`unpermute_qk` applies: ``new[i] = old[index[i]]``."""
    return unpermute_qk(np.arange(rows), n_heads)


def native_tensor(tensor: Any) -> Any:
    """A GGUF tensor as served natively: a quantized LinearMethod for a block-quantized
    matrix, an fp32 tensor for float types (F32/F16/BF16) and 1-D tensors."""
    from gguf import GGMLQuantizationType as Q

    from tokenmill.layers.quant.gguf import DENSE_TYPES, gguf_linear

    qtype = tensor.tensor_type.name
    shape = tuple(int(x) for x in reversed(tensor.shape.tolist()))
    if qtype in DENSE_TYPES or tensor.tensor_type in (Q.F32, Q.F16, Q.BF16):
        return torch.from_numpy(np.ascontiguousarray(dequantize_tensor(tensor)))
    if len(shape) != 2:
        raise ModelLoadError(f"GGUF tensor {tensor.name} has type {qtype} with shape {list(shape)}; only "
                             "2-D weight matrices can be block-quantized")
    return gguf_linear(tensor.data, qtype, shape[0], shape[1], tensor.name)


def read_gguf(path: Path, native: bool = False) -> GGUFCheckpoint:
    """Config and HF-named weights of a GGUF file: fp32 tensors, or with ``native`` the weight
    matrices as linear methods in their own block formats."""
    reader = _open(path)
    meta = reader.fields
    names = {t.name for t in reader.tensors}
    config = config_from_metadata(meta, names, path)
    config._name_or_path = str(path)
    permute = meta.get("general.architecture") == "llama"
    weights: dict[str, torch.Tensor] = {}
    for t in reader.tensors:
        hf_name = hf_tensor_name(t.name)
        if native:
            w = native_tensor(t)
            if permute and hf_name.endswith(("q_proj.weight", "k_proj.weight")):
                heads = config.num_attention_heads if hf_name.endswith("q_proj.weight") else config.num_key_value_heads
                index = torch.from_numpy(unpermute_index(int(w.shape[0]), heads))
                w = w[index] if isinstance(w, torch.Tensor) else w.select_rows(index)
            weights[hf_name] = w
            continue
        arr = dequantize_tensor(t)
        if permute and hf_name.endswith("q_proj.weight"):
            arr = unpermute_qk(arr, config.num_attention_heads)
        elif permute and hf_name.endswith("k_proj.weight"):
            arr = unpermute_qk(arr, config.num_key_value_heads)
        weights[hf_name] = torch.from_numpy(np.ascontiguousarray(arr))
    return GGUFCheckpoint(config, weights)


def read_gguf_cached(path: Path) -> GGUFCheckpoint:
    """:func:`read_gguf`, with the dequantized result kept on disk for the next load.

    The first load writes ``config.json`` + ``model.safetensors`` (fp32) under
    ``$TOKENMILL_CACHE/gguf-<key>``, keyed by the GGUF's path, size and mtime; later loads read
    that instead of parsing and dequantizing the GGUF again. ``TOKENMILL_GGUF_CACHE=0`` turns it
    off. A damaged cache entry is discarded and rebuilt; a cache that cannot be written is skipped.
    """
    if os.environ.get("TOKENMILL_GGUF_CACHE", "1") == "0":
        return read_gguf(path)
    resolved = path.resolve()
    st = resolved.stat()
    key = hashlib.sha1(f"{resolved}:{st.st_size}:{st.st_mtime_ns}:v1".encode()).hexdigest()[:12]
    entry = _cache_root() / f"gguf-{key}"
    if (entry / "model.safetensors").is_file():
        from safetensors.torch import load_file

        from tokenmill.loader.hf import load_hf_config

        try:
            config = load_hf_config(entry)
            config._name_or_path = str(path)
            return GGUFCheckpoint(config, load_file(str(entry / "model.safetensors")))
        except Exception:  # damaged entry (partial copy, disk error): rebuild it below
            shutil.rmtree(entry, ignore_errors=True)
    checkpoint = read_gguf(path)
    _write_cache_entry(entry, checkpoint)
    return checkpoint


def _write_cache_entry(entry: Path, checkpoint: GGUFCheckpoint) -> None:
    from safetensors.torch import save_file

    tmp = entry.with_name(entry.name + f".tmp{os.getpid()}")
    try:
        tmp.mkdir(parents=True, exist_ok=True)
        (tmp / "config.json").write_text(json.dumps(config_dict(checkpoint.config), indent=2, sort_keys=True))
        save_file(checkpoint.weights, str(tmp / "model.safetensors"))
        tmp.rename(entry)
    except OSError:  # read-only or full disk, or another process won the race: the cache is optional
        shutil.rmtree(tmp, ignore_errors=True)


def _cache_root() -> Path:
    return Path(os.environ.get("TOKENMILL_CACHE", Path.home() / ".cache" / "tokenmill"))


def gguf_tokenizer_dir(path: Path) -> Path:
    """Directory holding the tokenizer (and chat template) built from ``path``'s metadata.

    Built once with ``AutoTokenizer.from_pretrained(dir, gguf_file=...)`` (seconds) and saved under
    ``$TOKENMILL_CACHE`` (default ~/.cache/tokenmill), keyed by the file's path and size.
    """
    path = path.resolve()
    key = hashlib.sha1(f"{path}:{path.stat().st_size}".encode()).hexdigest()[:12]
    out = _cache_root() / f"tokenizer-{key}"
    if (out / "tokenizer.json").exists():
        return out
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    except Exception as e:
        raise ModelLoadError(f"cannot build a tokenizer from the GGUF metadata of {path}: "
                             f"{type(e).__name__}: {e}") from e
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    tok.save_pretrained(str(tmp))
    try:
        tmp.rename(out)
    except OSError:  # another process saved it first
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def gguf_tokenizer(path: Path) -> Any:
    from tokenmill.loader.hf import load_hf_tokenizer

    return load_hf_tokenizer(gguf_tokenizer_dir(path))
