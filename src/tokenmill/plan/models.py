"""Model architecture specs for the planner: presets and HF ``config.json`` parsing.

A preset is stored in the same form as an HF ``config.json`` and goes through the same parser, so
the parser is exercised by every preset. :func:`parse_config` reads:

* attention: MLA when ``kv_lora_rank`` is set (latent = ``kv_lora_rank + qk_rope_head_dim``),
  otherwise MHA/GQA from ``num_key_value_heads`` and ``head_dim``;
* linear-attention layers from ``layer_types`` (``"linear_attention"``), or from
  ``layer_group_size`` (Bailing/Ling: every g-th layer is full attention, the rest linear);
  recurrent state per layer = value heads x key dim x value dim (plus a short-conv state when
  ``linear_conv_kernel_dim`` is given, as in Qwen3-Next);
* MoE from ``n_routed_experts`` / ``num_experts`` / ``num_local_experts``, with dense layers from
  ``first_k_dense_replace``, ``moe_layer_freq``, ``decoder_sparse_step`` and ``mlp_only_layers``.

Parameter counts come from the shapes; biases and norm weights are counted as ``other``.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, NamedTuple

from tokenmill.plan.hardware import PlanError

# Tensor groups that --weight-bits can set. "other" is routers, norms and biases.
WEIGHT_GROUPS = ("experts", "shared_experts", "attention", "dense_mlp", "embeddings", "other")

# Named storage formats, in bits per weight including their scales.
NAMED_BITS = {
    "fp32": 32.0, "bf16": 16.0, "fp16": 16.0, "fp8": 8.0, "int8": 8.0,
    "int4": 4.0, "fp4": 4.0, "nvfp4": 4.5, "mxfp4": 4.25,
}


@dataclass(frozen=True)
class MLASpec:
    """Multi-head latent attention: one latent of ``kv_lora_rank + qk_rope_head_dim`` per token."""

    kv_lora_rank: int
    qk_rope_head_dim: int
    qk_nope_head_dim: int
    v_head_dim: int
    q_lora_rank: int | None

    @property
    def latent_dim(self) -> int:
        return self.kv_lora_rank + self.qk_rope_head_dim


@dataclass(frozen=True)
class LinearAttnSpec:
    """Linear-attention (GLA / Lightning / Gated DeltaNet) layer shape: fixed recurrent state."""

    num_key_heads: int
    num_value_heads: int
    key_head_dim: int
    value_head_dim: int
    conv_kernel: int = 0  # short causal conv (Qwen3-Next); 0 = none (Lightning / GLA)

    @property
    def conv_channels(self) -> int:
        return 2 * self.num_key_heads * self.key_head_dim + self.num_value_heads * self.value_head_dim


@dataclass(frozen=True)
class MoESpec:
    num_experts: int
    top_k: int
    expert_intermediate: int
    num_shared: int
    shared_intermediate: int

    def __post_init__(self) -> None:
        if not 0 < self.top_k <= self.num_experts:
            raise PlanError(f"MoE top_k must be in 1..{self.num_experts}, got {self.top_k}")
        if self.expert_intermediate <= 0:
            raise PlanError("MoE expert intermediate size must be positive")


@dataclass(frozen=True)
class ModelSpec:
    """Architecture facts the planner needs. ``layer_attention[i]`` is ``"full"`` or
    ``"linear"``; ``layer_mlp[i]`` is ``"dense"`` or ``"moe"``."""

    name: str
    source: str
    hidden_size: int
    vocab_size: int
    tie_embeddings: bool
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    layer_attention: tuple[str, ...]
    layer_mlp: tuple[str, ...]
    mla: MLASpec | None = None
    linear: LinearAttnSpec | None = None
    moe: MoESpec | None = None
    default_bits: Mapping[str, float] = field(default_factory=dict)
    notes: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        for attr in ("hidden_size", "vocab_size", "num_heads", "num_kv_heads", "head_dim"):
            if getattr(self, attr) <= 0:
                raise PlanError(f"model {self.name}: {attr} must be positive")
        if len(self.layer_attention) != len(self.layer_mlp) or not self.layer_attention:
            raise PlanError(f"model {self.name}: needs at least one layer")
        if "moe" in self.layer_mlp and self.moe is None:
            raise PlanError(f"model {self.name}: MoE layers without an MoE spec")
        if "dense" in self.layer_mlp and self.intermediate_size <= 0:
            raise PlanError(f"model {self.name}: dense MLP layers need intermediate_size")
        if "linear" in self.layer_attention and self.linear is None:
            raise PlanError(f"model {self.name}: linear-attention layers without their shape")

    @property
    def num_layers(self) -> int:
        return len(self.layer_attention)

    @property
    def num_full_layers(self) -> int:
        return self.layer_attention.count("full")

    @property
    def num_linear_layers(self) -> int:
        return self.layer_attention.count("linear")

    @property
    def num_moe_layers(self) -> int:
        return self.layer_mlp.count("moe")

    @property
    def attention_kind(self) -> str:
        if self.mla is not None:
            return "MLA"
        return "MHA" if self.num_kv_heads == self.num_heads else "GQA"


class ParamGroup(NamedTuple):
    """A set of tensors with one storage precision (``group``) and one sharding rule.

    ``sharding``: ``"tp"`` split across tensor-parallel ranks; ``"experts"`` routed experts, split
    across EP ranks and the rest of the TP group; ``"replicated"`` whole on every rank.
    """

    name: str
    group: str
    params: int
    sharding: str


def param_groups(spec: ModelSpec) -> list[ParamGroup]:
    """Parameter count per tensor group, summed over layers (biases and norms in ``other``)."""
    h = spec.hidden_size
    nf, nl = spec.num_full_layers, spec.num_linear_layers
    groups: list[ParamGroup] = [ParamGroup("embedding table", "embeddings", spec.vocab_size * h, "tp")]
    if not spec.tie_embeddings:
        groups.append(ParamGroup("lm_head", "embeddings", spec.vocab_size * h, "tp"))
    if nf:
        if spec.mla is not None:
            m = spec.mla
            qk = m.qk_nope_head_dim + m.qk_rope_head_dim
            if m.q_lora_rank:
                down = h * m.q_lora_rank + h * m.latent_dim
                up = m.q_lora_rank * spec.num_heads * qk
            else:
                down = h * m.latent_dim
                up = h * spec.num_heads * qk
            up += m.kv_lora_rank * spec.num_heads * (m.qk_nope_head_dim + m.v_head_dim)
            up += spec.num_heads * m.v_head_dim * h
            groups.append(ParamGroup("MLA q/kv/o projections", "attention", nf * up, "tp"))
            groups.append(ParamGroup("MLA down-projections (q_a, kv_a)", "attention", nf * down, "replicated"))
        else:
            per = h * spec.head_dim * (2 * spec.num_heads + 2 * spec.num_kv_heads)
            groups.append(ParamGroup("attention q/k/v/o", "attention", nf * per, "tp"))
    if nl and spec.linear is not None:
        la = spec.linear
        inner_k = la.num_key_heads * la.key_head_dim
        inner_v = la.num_value_heads * la.value_head_dim
        per = h * (2 * inner_k + 2 * inner_v) + inner_v * h  # q, k, v, output gate, o
        groups.append(ParamGroup("linear-attention q/k/v/gate/o", "attention", nl * per, "tp"))
    n_dense = spec.layer_mlp.count("dense")
    if n_dense:
        groups.append(ParamGroup("dense MLP", "dense_mlp", n_dense * 3 * h * spec.intermediate_size, "tp"))
    if spec.moe is not None and spec.num_moe_layers:
        moe, n = spec.moe, spec.num_moe_layers
        groups.append(ParamGroup("routed experts", "experts",
                                 n * moe.num_experts * 3 * h * moe.expert_intermediate, "experts"))
        if moe.num_shared:
            groups.append(ParamGroup("shared experts", "shared_experts",
                                     n * moe.num_shared * 3 * h * moe.shared_intermediate, "tp"))
        groups.append(ParamGroup("routers", "other", n * h * moe.num_experts, "replicated"))
    groups.append(ParamGroup("norms", "other", (2 * spec.num_layers + 1) * h, "replicated"))
    return groups


def parse_weight_bits(text: str | None, defaults: Mapping[str, float] | None = None) -> dict[str, float]:
    """Parse ``"experts=4.5,attention=fp8,other=16"`` over ``defaults`` (16 bits where unset).

    Keys are ``WEIGHT_GROUPS`` or ``all`` (applied first); values are bits per weight including
    scales, a number or a name from ``NAMED_BITS``.
    """
    bits = {g: 16.0 for g in WEIGHT_GROUPS}
    bits.update(defaults or {})
    if not text:
        return bits
    items: list[tuple[str, float]] = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        key, sep, value = part.partition("=")
        key, value = key.strip().lower(), value.strip().lower()
        if not sep or not value:
            raise PlanError(f"--weight-bits entries look like GROUP=BITS, got {part!r}")
        if key not in WEIGHT_GROUPS and key != "all":
            raise PlanError(f"--weight-bits: unknown group {key!r}; use all or {', '.join(WEIGHT_GROUPS)}")
        if value in NAMED_BITS:
            number = NAMED_BITS[value]
        else:
            try:
                number = float(value)
            except ValueError:
                raise PlanError(f"--weight-bits: {value!r} is not a number of bits nor one of "
                                f"{', '.join(NAMED_BITS)}") from None
        if not 0 < number <= 32:
            raise PlanError(f"--weight-bits: bits must be in (0, 32], got {number}")
        items.append((key, number))
    for key, number in sorted(items, key=lambda kv: kv[0] != "all"):
        for g in (WEIGHT_GROUPS if key == "all" else (key,)):
            bits[g] = number
    return bits


def _first(cfg: Mapping[str, Any], *keys: str, default: Any = None) -> Any:
    for key in keys:
        if cfg.get(key) is not None:
            return cfg[key]
    return default


def _need_int(cfg: Mapping[str, Any], key: str, name: str) -> int:
    value = cfg.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise PlanError(f"model {name}: config.json needs a positive integer {key!r}, got {value!r}")
    return value


_FULL_TYPES = {"full_attention", "attention", "sliding_attention", "global", "local", "full"}
_LINEAR_TYPES = {"linear_attention", "linear"}


def parse_config(cfg: Mapping[str, Any], name: str, source: str = "config.json",
                 default_bits: Mapping[str, float] | None = None, notes: tuple[str, ...] = ()) -> ModelSpec:
    """Build a :class:`ModelSpec` from an HF ``config.json`` dict (see the module docstring)."""
    if not isinstance(cfg, Mapping):
        raise PlanError(f"model {name}: config.json must be a JSON object")
    if "hidden_size" not in cfg and isinstance(cfg.get("text_config"), Mapping):
        cfg = {**cfg, **cfg["text_config"]}  # multimodal wrappers keep the LM under text_config
    notes_l = list(notes)
    h = _need_int(cfg, "hidden_size", name)
    n_layers = _need_int(cfg, "num_hidden_layers", name)
    heads = _need_int(cfg, "num_attention_heads", name)
    vocab = _need_int(cfg, "vocab_size", name)
    kv_heads = int(_first(cfg, "num_key_value_heads", default=heads))
    head_dim = int(_first(cfg, "head_dim", default=h // heads))
    inter = int(_first(cfg, "intermediate_size", default=0))

    mla = None
    if cfg.get("kv_lora_rank"):
        mla = MLASpec(kv_lora_rank=int(cfg["kv_lora_rank"]),
                      qk_rope_head_dim=int(_first(cfg, "qk_rope_head_dim", default=64)),
                      qk_nope_head_dim=int(_first(cfg, "qk_nope_head_dim", default=128)),
                      v_head_dim=int(_first(cfg, "v_head_dim", default=128)),
                      q_lora_rank=cfg.get("q_lora_rank") or None)

    layer_types = cfg.get("layer_types") or cfg.get("layers_block_type")
    if layer_types:
        if len(layer_types) != n_layers:
            raise PlanError(f"model {name}: layer_types has {len(layer_types)} entries for {n_layers} layers")
        attention = []
        for t in layer_types:
            if t in _LINEAR_TYPES:
                attention.append("linear")
            elif t in _FULL_TYPES:
                attention.append("full")
            else:
                raise PlanError(f"model {name}: layer type {t!r} is not supported by the planner "
                                f"(supported: full/sliding attention and linear_attention)")
        if "sliding_attention" in layer_types:
            notes_l.append("sliding-window layers are counted as full attention: KV figures are an upper bound")
    elif cfg.get("layer_group_size"):
        g = int(cfg["layer_group_size"])
        attention = ["full" if (i + 1) % g == 0 else "linear" for i in range(n_layers)]
    else:
        attention = ["full"] * n_layers

    linear = None
    if "linear" in attention:
        if cfg.get("linear_num_value_heads"):
            linear = LinearAttnSpec(
                num_key_heads=int(_first(cfg, "linear_num_key_heads", default=cfg["linear_num_value_heads"])),
                num_value_heads=int(cfg["linear_num_value_heads"]),
                key_head_dim=int(_first(cfg, "linear_key_head_dim", default=head_dim)),
                value_head_dim=int(_first(cfg, "linear_value_head_dim", default=head_dim)),
                conv_kernel=int(_first(cfg, "linear_conv_kernel_dim", default=0)))
        elif cfg.get("linear_head_dim") or cfg.get("short_conv_kernel_size"):
            # BailingHybrid as HF saves it (KDA): linear_num_heads states of linear_head_dim^2 and a
            # short conv over q, k and v (its "head_dim" is then the MLA rope dim, not the KDA one)
            lh = int(_first(cfg, "linear_num_heads", default=heads))
            ld = int(_first(cfg, "linear_head_dim", default=head_dim))
            linear = LinearAttnSpec(lh, lh, ld, ld,
                                    conv_kernel=int(_first(cfg, "linear_conv_kernel_dim", "short_conv_kernel_size",
                                                           default=0)))
        else:  # Lightning / GLA (Bailing): one head_dim x head_dim state per attention head
            linear = LinearAttnSpec(heads, heads, head_dim, head_dim)

    n_experts = _first(cfg, "n_routed_experts", "num_experts", "num_local_experts", "moe_num_experts")
    moe = None
    mlp = ["dense"] * n_layers
    if n_experts:
        top_k = int(_first(cfg, "num_experts_per_tok", "num_experts_per_token", "moe_topk", "top_k", default=0))
        expert_inter = int(_first(cfg, "moe_intermediate_size", default=inter))
        n_shared = int(_first(cfg, "n_shared_experts", "num_shared_experts", default=0))
        shared_inter = int(_first(cfg, "moe_shared_expert_intermediate_size", default=expert_inter))
        if cfg.get("shared_expert_intermediate_size"):  # Qwen2-MoE style: one wide shared expert
            n_shared, shared_inter = max(n_shared, 1), int(cfg["shared_expert_intermediate_size"])
        moe = MoESpec(int(n_experts), top_k, expert_inter, n_shared, shared_inter)
        first_dense = int(_first(cfg, "first_k_dense_replace", default=0))
        freq = int(_first(cfg, "moe_layer_freq", default=1)) or 1
        step = int(_first(cfg, "decoder_sparse_step", default=1)) or 1
        dense_only = set(cfg.get("mlp_only_layers") or [])
        listed = cfg.get("mlp_layer_types")   # BailingHybrid as HF saves it: "dense" / "sparse" per layer
        for i in range(n_layers):
            if listed and len(listed) == n_layers:
                mlp[i] = "moe" if listed[i] == "sparse" else "dense"
            elif i >= first_dense and i % freq == 0 and (i + 1) % step == 0 and i not in dense_only:
                mlp[i] = "moe"
    return ModelSpec(name=name, source=source, hidden_size=h, vocab_size=vocab,
                     tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                     num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim, intermediate_size=inter,
                     layer_attention=tuple(attention), layer_mlp=tuple(mlp), mla=mla, linear=linear,
                     moe=moe, default_bits=dict(default_bits or {}), notes=tuple(notes_l))


class ModelPreset(NamedTuple):
    config: dict[str, Any]
    source: str
    default_bits: dict[str, float]
    notes: tuple[str, ...]


_DSV3_SHAPE = {"hidden_size": 7168, "num_hidden_layers": 61, "intermediate_size": 18432,
               "moe_intermediate_size": 2048, "num_experts_per_tok": 8, "n_shared_experts": 1,
               "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_rope_head_dim": 64, "qk_nope_head_dim": 128,
               "v_head_dim": 128, "tie_word_embeddings": False}

MODEL_PRESETS: dict[str, ModelPreset] = {
    "kimi-k2.6": ModelPreset(
        {**_DSV3_SHAPE, "model_type": "kimi_k2", "num_attention_heads": 64, "num_key_value_heads": 64,
         "n_routed_experts": 384, "first_k_dense_replace": 1, "vocab_size": 163840},
        "Kimi K2 family config.json (https://huggingface.co/moonshotai/Kimi-K2-Instruct): DeepSeek-V3 "
        "architecture; seed 000 (576-element MLA latent, 61 layers)",
        {"experts": 4.5},
        ("routed experts are INT4 with a bf16 scale per 32 weights (4.5 bits); the rest bf16",
         "the vision tower of the multimodal checkpoint (< 1 B parameters) is not counted")),
    "deepseek-v3": ModelPreset(
        {**_DSV3_SHAPE, "model_type": "deepseek_v3", "num_attention_heads": 128, "num_key_value_heads": 128,
         "n_routed_experts": 256, "first_k_dense_replace": 3, "vocab_size": 129280},
        "DeepSeek-V3 config.json (https://huggingface.co/deepseek-ai/DeepSeek-V3)",
        {"experts": 8, "shared_experts": 8, "attention": 8, "dense_mlp": 8},
        ("linear layers are fp8 (block scales ignored); embeddings, norms and routers bf16",
         "the multi-token-prediction layer (about 14 B parameters) is not counted")),
    "ling-2.6-1t": ModelPreset(
        {"model_type": "bailing_hybrid", "hidden_size": 8192, "num_hidden_layers": 80,
         "num_attention_heads": 64, "num_key_value_heads": 64, "head_dim": 128, "layer_group_size": 8,
         "kv_lora_rank": 512, "qk_rope_head_dim": 128, "qk_nope_head_dim": 128, "v_head_dim": 128,
         "q_lora_rank": 1536, "intermediate_size": 18432, "moe_intermediate_size": 2048,
         "num_experts": 256, "num_experts_per_tok": 8, "num_shared_experts": 1,
         "first_k_dense_replace": 4, "vocab_size": 157184, "tie_word_embeddings": False},
        "seed 003 (256 routed experts top-8 + 1 shared, hidden 8192, expert intermediate 2048, "
        "10 MLA + 70 Lightning/GLA layers, 1 T total / 63 B active); Ling-2.5-1T model card "
        "(https://huggingface.co/inclusionAI/Ling-2.5-1T); layer pattern as Bailing linear configs "
        "(layer_group_size: every 8th layer full attention)",
        {"experts": 8, "shared_experts": 8},
        ("MLA latent 512 + 128 = 640 elements is chosen to match seed 003's 12.5 KiB per token per "
         "device over 10 MLA layers in bf16; the exact rank/rope split is an assumption",
         "Lightning state: 64 heads x 128 x 128 per layer (hidden 8192 / head_dim 128), which matches "
         "seed 003's 70 MiB per request at TP=4 in fp32",
         "first_k_dense_replace 4, dense intermediate 18432, q_lora_rank 1536 and vocab 157184 are "
         "assumptions from the Ling 2.0 family",
         "MoE weights per-channel fp8 (seed 003); attention and embeddings bf16")),
    "llama-3.1-70b": ModelPreset(
        {"model_type": "llama", "hidden_size": 8192, "num_hidden_layers": 80, "num_attention_heads": 64,
         "num_key_value_heads": 8, "intermediate_size": 28672, "vocab_size": 128256,
         "tie_word_embeddings": False},
        "Llama-3.1-70B config.json (https://huggingface.co/meta-llama/Llama-3.1-70B)", {}, ()),
    "qwen3-235b-a22b": ModelPreset(
        {"model_type": "qwen3_moe", "hidden_size": 4096, "num_hidden_layers": 94, "num_attention_heads": 64,
         "num_key_value_heads": 4, "head_dim": 128, "intermediate_size": 12288, "moe_intermediate_size": 1536,
         "num_experts": 128, "num_experts_per_tok": 8, "decoder_sparse_step": 1, "mlp_only_layers": [],
         "vocab_size": 151936, "tie_word_embeddings": False},
        "Qwen3-235B-A22B config.json (https://huggingface.co/Qwen/Qwen3-235B-A22B)", {}, ()),
    "smollm2-135m": ModelPreset(
        {"model_type": "llama", "hidden_size": 576, "num_hidden_layers": 30, "num_attention_heads": 9,
         "num_key_value_heads": 3, "intermediate_size": 1536, "vocab_size": 49152,
         "tie_word_embeddings": True},
        "SmolLM2-135M config.json (https://huggingface.co/HuggingFaceTB/SmolLM2-135M)", {}, ()),
}


def load_model(name_or_path: str) -> ModelSpec:
    """A preset by name, or a path to an HF ``config.json`` (or a directory holding one)."""
    key = name_or_path.strip().lower()
    if key in MODEL_PRESETS:
        p = MODEL_PRESETS[key]
        return parse_config(p.config, key, p.source, p.default_bits, p.notes)
    path = Path(name_or_path)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise PlanError(f"unknown model {name_or_path!r}: not a preset ({', '.join(MODEL_PRESETS)}) "
                        f"and no config.json at that path")
    try:
        cfg = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise PlanError(f"cannot read {path}: {exc}") from None
    return parse_config(cfg, path.parent.name or path.name, str(path))
