"""Memory arithmetic: weight bytes, KV bytes per token, recurrent state, KV capacity.

Sharding rules (one replica = ``tp`` devices; ``ep`` must divide ``tp``; ``dp`` replicas):

* weights: TP-sharded tensors and routed experts are split over the ``tp`` devices of a replica;
  replicated tensors (MLA down-projections, routers, norms) are whole on every device. With
  ``--weights-gb`` the given total is split evenly, as seed 000 does.
* MHA/GQA KV: the KV heads shard across TP; when there are fewer KV heads than TP ranks each rank
  holds one head (heads are replicated ``tp / kv_heads`` times).
* MLA KV: the latent (``kv_lora_rank + qk_rope_head_dim`` elements) does **not** shard: every TP
  rank holds the full latent of every token.
* linear attention: the recurrent state shards by head across TP; it is per request, not per token.
  It is counted as the engine's state-pool slot (:class:`~tokenmill.contracts.kv.LinearState`:
  recurrent ``[heads, key dim, value dim]`` + short-conv ``[channels, kernel - 1]``, both in
  ``--state-dtype``, fp32 by default as the engine stores them; :func:`state_layer`).

Because every TP rank holds a slice (or a copy) of every token's KV, a replica holds as many tokens
as one device does: ``tokens = free bytes per device // KV bytes per token per device``.

KV bytes per token come from the same :class:`~tokenmill.contracts.kv.KVCacheSpec` the engine
sizes its pool with (one ``LatentKV`` or ``PagedKV`` entry per attention layer, for one device's
share), so ``tokenmill plan`` and ``tokenmill serve`` agree by construction; fp8 entries carry
their fp32 scales (4 B per token and KV head for K and V, 4 B per token for an MLA latent).
With ``--kv-cache-memory`` the planner also reports what the engine's pool of that size holds
(:meth:`KVCacheSpec.capacity_tokens`, whole pages of ``--page-size``).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Mapping, NamedTuple

from tokenmill.contracts.kv import (FP8_SCALE_SCHEMES, KVCacheSpec, LatentKV, LayerKV, LinearState, PagedKV,
                                    kv_storage_dtype)
from tokenmill.plan.hardware import HardwareSpec, PlanError
from tokenmill.plan.models import WEIGHT_GROUPS, ModelSpec, param_groups

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 1, "int8": 1}


class Step(NamedTuple):
    """One line of shown working: ``label = formula = value unit``."""

    key: str
    label: str
    value: float | int | None
    unit: str
    formula: str


@dataclass(frozen=True)
class Deployment:
    """How the model is laid out and what is asked of it; validated on construction.

    ``weight_bits`` maps tensor groups (``WEIGHT_GROUPS``) to bits per weight; unset groups are 16.
    ``weights_bytes`` replaces the computed weight total (split evenly over ``tp``).
    """

    tp: int = 1
    ep: int = 1
    dp: int = 1
    kv_dtype: str = "bf16"
    kv_fp8_scales: str = "static"   # fp8 KV: "static" (per layer and head) or "token" (4 B per vector)
    state_dtype: str = "fp32"
    context: int = 8192
    batch: int = 1
    mem_fraction: float = 0.9
    weight_bits: Mapping[str, float] = field(default_factory=dict)
    weights_bytes: float | None = None
    reserve_bytes: float = 0.0
    compute_dtype: str | None = None
    kv_memory_bytes: float | None = None   # a KV pool of this size per device (the engine's --kv-cache-memory)
    page_size: int = 16

    def __post_init__(self) -> None:
        for name in ("tp", "ep", "dp", "context", "batch", "page_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise PlanError(f"--{name} must be a positive integer, got {value!r}")
        if self.tp % self.ep:
            raise PlanError(f"--ep {self.ep} must divide --tp {self.tp}: experts are split within one replica")
        for name in ("kv_dtype", "state_dtype"):
            if getattr(self, name) not in DTYPE_BYTES:
                raise PlanError(f"--{name.replace('_', '-')} must be one of {', '.join(DTYPE_BYTES)}")
        if self.kv_fp8_scales not in FP8_SCALE_SCHEMES:
            raise PlanError(f"--kv-fp8-scales must be one of {', '.join(FP8_SCALE_SCHEMES)}")
        if not 0 < self.mem_fraction <= 1:
            raise PlanError(f"--mem-fraction must be in (0, 1], got {self.mem_fraction}")
        if self.weights_bytes is not None and self.weights_bytes <= 0:
            raise PlanError("--weights-gb must be positive")
        if self.kv_memory_bytes is not None and self.kv_memory_bytes <= 0:
            raise PlanError("--kv-cache-memory must be positive")
        if self.reserve_bytes < 0:
            raise PlanError("--reserve-gb must not be negative")
        unknown = set(self.weight_bits) - set(WEIGHT_GROUPS)
        if unknown or any(not 0 < b <= 32 for b in self.weight_bits.values()):
            raise PlanError(f"weight_bits wants groups {WEIGHT_GROUPS} with bits in (0, 32], got {self.weight_bits}")
        # groups left unset are 16-bit
        object.__setattr__(self, "weight_bits", {**{g: 16.0 for g in WEIGHT_GROUPS}, **self.weight_bits})


class GroupBytes(NamedTuple):
    name: str
    group: str
    sharding: str
    params: int
    bits: float
    bytes_total: float
    bytes_per_device: float


@dataclass(frozen=True)
class WeightsResult:
    total_bytes: float
    per_device_bytes: float
    groups: tuple[GroupBytes, ...]
    given: bool
    steps: tuple[Step, ...]


def check_sharding(spec: ModelSpec, dep: Deployment) -> None:
    """Raise :class:`PlanError` when heads or experts cannot be split as asked."""
    tp = dep.tp
    if spec.num_full_layers and spec.num_heads % tp:
        raise PlanError(f"{spec.name}: {spec.num_heads} attention heads do not split over --tp {tp}")
    if spec.mla is None and spec.num_full_layers:
        kv = spec.num_kv_heads
        if (kv >= tp and kv % tp) or (kv < tp and tp % kv):
            raise PlanError(f"{spec.name}: {kv} KV heads neither split over nor replicate evenly to --tp {tp}")
    if spec.linear is not None and (spec.linear.num_value_heads % tp or spec.linear.num_key_heads % tp):
        raise PlanError(f"{spec.name}: linear-attention heads do not split over --tp {tp}")
    if spec.moe is not None and spec.moe.num_experts % dep.ep:
        raise PlanError(f"{spec.name}: {spec.moe.num_experts} experts do not split over --ep {dep.ep}")


def weights(spec: ModelSpec, dep: Deployment) -> WeightsResult:
    """Weight bytes in total and per device (see the module docstring for the sharding)."""
    bits = dep.weight_bits
    rows = []
    for g in param_groups(spec):
        b = bits[g.group]
        total = g.params * b / 8
        per_dev = total if g.sharding == "replicated" else total / dep.tp
        rows.append(GroupBytes(g.name, g.group, g.sharding, g.params, b, total, per_dev))
    computed_total = sum(r.bytes_total for r in rows)
    steps = [Step(f"weights.{r.group}.{i}", r.name, r.bytes_total, "B",
                  f"{r.params:,} params x {r.bits:g} bits / 8"
                  + (" (whole on every device)" if r.sharding == "replicated" else ""))
             for i, r in enumerate(rows)]
    if dep.weights_bytes is not None:
        total, per_dev = dep.weights_bytes, dep.weights_bytes / dep.tp
        steps.append(Step("weights.total", "weights total (given)", total, "B",
                          f"--weights-gb (the groups above add up to {computed_total / 1e9:,.1f} GB)"))
        steps.append(Step("weights.per_device", "weights per device", per_dev, "B",
                          f"{total / 1e9:,.1f} GB / tp {dep.tp} (split evenly)"))
        scale = total / computed_total
        rows = [r._replace(bytes_total=r.bytes_total * scale, bytes_per_device=r.bytes_per_device * scale)
                for r in rows]
        return WeightsResult(total, per_dev, tuple(rows), True, tuple(steps))
    per_dev = sum(r.bytes_per_device for r in rows)
    repl = sum(r.bytes_per_device for r in rows if r.sharding == "replicated")
    steps.append(Step("weights.total", "weights total", computed_total, "B", "sum of the groups above"))
    steps.append(Step("weights.per_device", "weights per device", per_dev, "B",
                      f"({computed_total / 1e9:,.2f} GB - replicated {repl / 1e9:,.2f} GB) / tp {dep.tp}"
                      f" + replicated {repl / 1e9:,.2f} GB"))
    return WeightsResult(computed_total, per_dev, tuple(rows), False, tuple(steps))


@dataclass(frozen=True)
class KVResult:
    per_token_per_device: int
    per_token_all_devices: int
    state_per_request_per_device: int
    steps: tuple[Step, ...]
    spec: KVCacheSpec | None = None   # one device's KV layout (None: no attention layers)


def kv_cache_spec(spec: ModelSpec, dep: Deployment) -> KVCacheSpec | None:
    """One device's share of the model's KV, as the engine declares it (None: no full attention)."""
    layer: LayerKV
    if spec.mla is not None:
        layer = LatentKV(spec.mla.kv_lora_rank, spec.mla.qk_rope_head_dim)   # never sharded
    else:
        kv = spec.num_kv_heads
        layer = PagedKV(kv // dep.tp if kv >= dep.tp else 1, spec.head_dim)
    layers = tuple(layer for kind in spec.layer_attention if kind == "full")
    return KVCacheSpec(layers, kv_storage_dtype(dep.kv_dtype), dep.kv_fp8_scales) if layers else None


def state_layer(spec: ModelSpec, dep: Deployment) -> LinearState | None:
    """One device's share of one linear-attention layer's state slot, as the engine declares it
    (:class:`~tokenmill.contracts.kv.LinearState`; None: no linear layers). With the default
    ``--state-dtype fp32`` its ``bytes_per_request()`` times the linear layers is exactly the
    state-pool slot the engine allocates per request."""
    la = spec.linear
    if la is None or not spec.num_linear_layers:
        return None
    conv = la.conv_channels // dep.tp if la.conv_kernel > 1 else 1
    return LinearState(max(la.num_value_heads // dep.tp, 1), la.key_head_dim, la.value_head_dim, conv,
                       max(la.conv_kernel, 1))


def _per_layer(elements: str, scales: str) -> str:
    return f"({elements}{scales})" if scales else elements


def kv_bytes(spec: ModelSpec, dep: Deployment) -> KVResult:
    """KV bytes per token per device and recurrent-state bytes per request per device."""
    tp, kvb, sb = dep.tp, DTYPE_BYTES[dep.kv_dtype], DTYPE_BYTES[dep.state_dtype]
    nf, nl = spec.num_full_layers, spec.num_linear_layers
    steps: list[Step] = []
    per_tok = 0
    kv_spec = kv_cache_spec(spec, dep)
    if kv_spec is not None:
        per_tok = kv_spec.bytes_per_token()
        scales = kv_spec.layers[0].scales_per_token() if kv_spec.per_token_scales else 0
        scale_txt = f" + {scales} x 4 B fp32 scale{'s' if scales > 1 else ''}" if scales else ""
    if kv_spec is not None and spec.mla is not None:
        m = spec.mla
        steps.append(Step("kv.per_token_per_device", "MLA KV per token per device (latent not sharded)", per_tok,
                          "B", _per_layer(f"({m.kv_lora_rank} + {m.qk_rope_head_dim}) elements x {kvb} B "
                                          f"({dep.kv_dtype})", scale_txt)
                               + f" x {nf} layers; every one of the {tp} TP ranks holds the full latent"))
        all_dev = per_tok * tp
    elif kv_spec is not None:
        kv = spec.num_kv_heads
        kv_dev = kv // tp if kv >= tp else 1
        how = (f"{kv} KV heads / tp {tp} = {kv_dev}" if kv >= tp
               else f"{kv} KV heads < tp {tp}: 1 head per rank, each replicated {tp // kv}x")
        steps.append(Step("kv.per_token_per_device", f"{spec.attention_kind} KV per token per device", per_tok,
                          "B", _per_layer(f"2 (K,V) x {kv_dev} heads x {spec.head_dim} dim x {kvb} B "
                                          f"({dep.kv_dtype})", scale_txt) + f" x {nf} layers; {how}"))
        all_dev = per_tok * tp
    else:
        all_dev = 0
    state = 0
    layer = state_layer(spec, dep)
    if nl and layer is not None and spec.linear is not None:
        la = spec.linear
        # The engine's state-pool slot of one linear layer (LinearState), in --state-dtype.
        state = (layer.state_elements() + layer.conv_elements()) * sb * nl
        formula = (f"{la.num_value_heads} heads / tp {tp} = {layer.num_heads} x {la.key_head_dim} x "
                   f"{la.value_head_dim} x {sb} B ({dep.state_dtype}) x {nl} layers")
        if la.conv_kernel > 1:
            formula += (f" + conv state ({la.conv_kernel} - 1) x {layer.conv_dim} ch x {sb} B x {nl}")
        steps.append(Step("state.per_request_per_device", "linear-attention state per request per device",
                          state, "B", formula + "; constant in context length"))
    return KVResult(per_tok, all_dev, state, tuple(steps), kv_spec)


@dataclass(frozen=True)
class CapacityResult:
    hbm_total_per_replica: float
    free_per_replica: float
    free_per_device: float
    fits: bool
    kv_tokens_per_replica: int | None
    sessions_per_replica: int
    kv_bytes_per_session: float
    memory_per_session: float
    naive_tokens_per_replica: int | None
    steps: tuple[Step, ...]
    notes: tuple[str, ...]
    kv_tokens_for_memory: int | None = None   # tokens a --kv-cache-memory pool holds (engine's formula)


def capacity(spec: ModelSpec, hw: HardwareSpec, dep: Deployment, w: WeightsResult, kv: KVResult) -> CapacityResult:
    """KV capacity in tokens per replica and concurrent sessions at ``dep.context``."""
    tp = dep.tp
    usable = hw.hbm_bytes * dep.mem_fraction
    free_dev = usable - w.per_device_bytes - dep.reserve_bytes
    steps = [Step("capacity.hbm_per_replica", "HBM per replica", hw.hbm_bytes * tp, "B",
                  f"{hw.hbm_bytes / 1e9:,.1f} GB x tp {tp}")]
    reserve = f" - reserve {dep.reserve_bytes / 1e9:,.2f} GB" if dep.reserve_bytes else ""
    steps.append(Step("capacity.free_per_replica", "left for KV per replica", free_dev * tp, "B",
                      f"{hw.hbm_bytes / 1e9:,.1f} GB x {dep.mem_fraction:g} x {tp} - weights "
                      f"{w.per_device_bytes * tp / 1e9:,.1f} GB{reserve}"))
    steps.append(Step("capacity.free_per_device", "left for KV per device", free_dev, "B",
                      f"{free_dev * tp / 1e9:,.2f} GB / tp {tp}"))
    notes: list[str] = []
    fits = free_dev > 0
    if not fits:
        notes.append(f"weights do not fit: {w.per_device_bytes / 1e9:,.1f} GB per device > "
                     f"{(usable - dep.reserve_bytes) / 1e9:,.1f} GB usable; raise --tp or lower --weight-bits")
    free = max(free_dev, 0.0)
    tokens = naive = None
    if kv.per_token_per_device:
        tokens = math.floor(free / kv.per_token_per_device)
        steps.append(Step("capacity.kv_tokens_per_replica", "KV capacity per replica", tokens, "tokens",
                          f"{free / 1e9:,.2f} GB per device / {kv.per_token_per_device:,} B per token per device"))
        logical = kv.per_token_per_device  # one copy of a token's KV, summed over ranks
        copies = 1
        if spec.mla is not None:
            copies = tp
        elif spec.num_kv_heads < tp:
            copies = tp // spec.num_kv_heads
            logical = kv.per_token_per_device * spec.num_kv_heads
        else:
            logical = kv.per_token_per_device * tp
        naive = math.floor(free * tp / logical)
        if fits and copies > 1:
            what = "the full MLA latent" if spec.mla is not None else "a replicated KV head"
            notes.append(
                f"every TP rank stores {what} for every token, so each token's KV exists {copies} times in the "
                f"replica: {tokens:,} tokens fit. Dividing the replica's free memory by one copy's bytes "
                f"({free * tp / 1e9:,.1f} GB / {logical:,} B = {naive:,}) would overcount {copies}x")
    kv_session = dep.context * kv.per_token_per_device
    if kv.per_token_per_device:
        steps.append(Step("capacity.kv_bytes_per_session", f"KV per session at {dep.context:,} tokens, per device",
                          kv_session, "B", f"{dep.context:,} tokens x {kv.per_token_per_device:,} B"))
    per_session = kv_session + kv.state_per_request_per_device
    sessions = math.floor(free / per_session) if per_session else 0
    parts = []
    if kv.per_token_per_device:
        parts.append(f"{dep.context:,} tokens x {kv.per_token_per_device:,} B")
    if kv.state_per_request_per_device:
        parts.append(f"state {kv.state_per_request_per_device:,} B")
    if kv.state_per_request_per_device:
        steps.append(Step("capacity.memory_per_session", f"memory per session at {dep.context:,} tokens, per device",
                          per_session, "B", " + ".join(parts)))
    steps.append(Step("capacity.sessions_per_replica", f"concurrent sessions at {dep.context:,} tokens",
                      sessions, "sessions", f"{free / 1e9:,.2f} GB / {per_session / 1e6:,.2f} MB per session"))
    if dep.dp > 1:
        steps.append(Step("capacity.sessions_total", f"concurrent sessions over dp {dep.dp} replicas",
                          sessions * dep.dp, "sessions", f"{sessions:,} x {dep.dp}"))
    for_memory = None
    if dep.kv_memory_bytes is not None and kv.spec is not None:
        for_memory = kv.spec.capacity_tokens(dep.kv_memory_bytes, dep.page_size)
        steps.append(Step("capacity.kv_tokens_for_memory", "tokens in a KV pool of --kv-cache-memory", for_memory,
                          "tokens", f"{dep.kv_memory_bytes / 2**30:g} GiB // {kv.per_token_per_device:,} B per "
                                    f"token, in whole pages of {dep.page_size} (as tokenmill serve sizes its pool)"))
    return CapacityResult(hw.hbm_bytes * tp, free_dev * tp, free_dev, fits, tokens, sessions, kv_session,
                          per_session, naive, tuple(steps), tuple(notes), for_memory)
