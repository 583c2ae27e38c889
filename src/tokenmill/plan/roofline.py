"""Roofline lower bounds for one replica: decode step time and prefill throughput.

Decode (one step, ``batch`` sequences each holding ``context`` tokens), per device:

    bytes  = weights read + KV read (batch x context x KV bytes/token/device)
             + recurrent state read and written (2 x batch x state bytes)
    flops  = 2 x active params per device x batch + attention FLOPs
    step  >= max(bytes / HBM bandwidth, flops / peak FLOP/s)

Weights read: every non-expert tensor once (an untied embedding table only for the batch's rows;
a tied one is read whole as the LM head);
routed experts only where some token was routed, in expectation under uniform routing:
``1 - (1 - top_k / experts) ** batch`` of them per layer.

Prefill (one prompt of ``context`` tokens on one replica):

    flops = 2 x active params x context (+ one token's logits) + causal attention
            (full attention: heads x context^2 / 2 x 2 x (qk dim + v dim) per layer;
             linear attention: 4 x heads x key dim x value dim per token per layer)
    time >= max(flops / (tp x peak FLOP/s), weights per device / HBM bandwidth)

These are bounds: no communication, kernel launch or scheduling cost is included.
"""
from __future__ import annotations

from dataclasses import dataclass

from tokenmill.plan.capacity import CapacityResult, Deployment, KVResult, Step, WeightsResult
from tokenmill.plan.hardware import HardwareSpec, PlanError
from tokenmill.plan.models import ModelSpec

_FALLBACK = ("fp4", "fp8", "bf16", "fp16", "fp32")


def default_compute_dtype(spec: ModelSpec, hw: HardwareSpec, dep: Deployment) -> str:
    """``--compute-dtype`` when set; else the narrowest format the bulk of the weights allow
    (experts' bits for MoE models, attention's otherwise) that the hardware runs, widening when
    the hardware lacks it (fp4 -> fp8 -> bf16 -> fp16 -> fp32)."""
    if dep.compute_dtype:
        hw.flops(dep.compute_dtype)  # raises a clear error if absent
        return dep.compute_dtype
    bits = dep.weight_bits["experts" if spec.moe is not None else "attention"]
    want = "fp4" if bits <= 4.5 else "fp8" if bits <= 8 else "bf16"
    for prec in _FALLBACK[_FALLBACK.index(want):]:
        if prec in hw.peak_flops:
            return prec
    raise PlanError(f"hardware {hw.name} lists no usable peak FLOP/s")


def _active_params(spec: ModelSpec, w: WeightsResult, *, per_device: bool, tp: int) -> float:
    """Parameters multiplied per token (embedding lookup excluded, routed experts x top_k / E)."""
    total = 0.0
    for g in w.groups:
        if g.name == "embedding table" or (g.name == "lm_head"):
            continue
        n = g.params if not per_device else (g.params if g.sharding == "replicated" else g.params / tp)
        if g.group == "experts" and spec.moe is not None:
            n *= spec.moe.top_k / spec.moe.num_experts
        total += n
    return total


def _lm_head_params(spec: ModelSpec) -> int:
    return spec.vocab_size * spec.hidden_size


@dataclass(frozen=True)
class DecodeResult:
    compute_dtype: str
    weight_bytes_read: float
    kv_bytes_read: float
    state_bytes: float
    memory_time_s: float
    flops: float
    compute_time_s: float
    step_time_s: float
    bound: str
    tokens_per_s_per_user: float
    tokens_per_s_per_replica: float
    steps: tuple[Step, ...]
    notes: tuple[str, ...]


def decode_bound(spec: ModelSpec, hw: HardwareSpec, dep: Deployment, w: WeightsResult, kv: KVResult,
                 cap: CapacityResult) -> DecodeResult:
    """Lower bound on one decode step of ``dep.batch`` sequences at ``dep.context`` tokens."""
    b, c, tp = dep.batch, dep.context, dep.tp
    prec = default_compute_dtype(spec, hw, dep)
    steps: list[Step] = []
    touched = 1.0
    if spec.moe is not None:
        touched = 1 - (1 - spec.moe.top_k / spec.moe.num_experts) ** b
    weight_read = 0.0
    for g in w.groups:
        if g.name == "embedding table" and not spec.tie_embeddings:  # a lookup reads only the batch's rows
            weight_read += g.bytes_per_device * min(1.0, b / spec.vocab_size)
        elif g.group == "experts":
            weight_read += g.bytes_per_device * touched
        else:
            weight_read += g.bytes_per_device
    formula = "non-expert weights per device"
    if spec.moe is not None:
        formula += (f" + routed experts per device x (1 - (1 - {spec.moe.top_k}/{spec.moe.num_experts})"
                    f"^{b} = {touched:.3f} touched)")
    steps.append(Step("decode.weight_bytes", "weights read per step per device", weight_read, "B", formula))
    kv_read = b * c * kv.per_token_per_device
    steps.append(Step("decode.kv_bytes", "KV read per step per device", kv_read, "B",
                      f"{b} seqs x {c:,} tokens x {kv.per_token_per_device:,} B"))
    state = 2 * b * kv.state_per_request_per_device
    if state:
        steps.append(Step("decode.state_bytes", "recurrent state read + written per step per device", state, "B",
                          f"2 x {b} x {kv.state_per_request_per_device:,} B"))
    total_bytes = weight_read + kv_read + state
    mem_t = total_bytes / hw.hbm_bw
    steps.append(Step("decode.memory_time", "memory bound per step", mem_t, "s",
                      f"{total_bytes / 1e9:,.3f} GB / {hw.hbm_bw / 1e12:,.2f} TB/s"))

    active = _active_params(spec, w, per_device=True, tp=tp) + _lm_head_params(spec) / tp
    heads_dev = spec.num_heads / tp
    if spec.mla is not None:  # absorbed MLA decode: scores over the latent, values from kv_lora
        per_tok_attn = 2 * heads_dev * (spec.mla.latent_dim + spec.mla.kv_lora_rank) * spec.num_full_layers
    else:
        per_tok_attn = 2 * heads_dev * 2 * spec.head_dim * spec.num_full_layers
    lin = 0.0
    if spec.linear is not None:
        la = spec.linear
        lin = 4 * (la.num_value_heads / tp) * la.key_head_dim * la.value_head_dim * spec.num_linear_layers
    flops = b * (2 * active + per_tok_attn * c + lin)
    comp_t = flops / hw.flops(prec)
    steps.append(Step("decode.flops", "FLOPs per step per device", flops, "FLOP",
                      f"{b} x (2 x {active / 1e9:,.3f} G active params + attention {per_tok_attn:,.0f} x {c:,}"
                      + (f" + linear state {lin:,.0f}" if lin else "") + ")"))
    steps.append(Step("decode.compute_time", "compute bound per step", comp_t, "s",
                      f"{flops / 1e12:,.3f} TFLOP / {hw.flops(prec) / 1e12:,.1f} TFLOP/s ({prec})"))
    step = max(mem_t, comp_t)
    bound = "memory" if mem_t >= comp_t else "compute"
    steps.append(Step("decode.step_time", f"decode step lower bound ({bound}-bound)", step, "s",
                      f"max({mem_t * 1e3:,.3f} ms, {comp_t * 1e3:,.3f} ms)"))
    steps.append(Step("decode.tokens_per_s_per_user", "best tokens/s per user", 1 / step, "tok/s",
                      f"1 / {step * 1e3:,.3f} ms"))
    steps.append(Step("decode.tokens_per_s_per_replica", "best tokens/s per replica", b / step, "tok/s",
                      f"{b} / {step * 1e3:,.3f} ms"))
    notes = []
    if b > cap.sessions_per_replica:
        notes.append(f"batch {b} at {c:,} tokens exceeds the {cap.sessions_per_replica:,} sessions that fit "
                     f"in one replica's KV memory")
    return DecodeResult(prec, weight_read, kv_read, state, mem_t, flops, comp_t, step, bound,
                        1 / step, b / step, tuple(steps), tuple(notes))


@dataclass(frozen=True)
class PrefillResult:
    compute_dtype: str
    flops: float
    compute_time_s: float
    memory_time_s: float
    time_s: float
    tokens_per_s: float
    steps: tuple[Step, ...]


def prefill_bound(spec: ModelSpec, hw: HardwareSpec, dep: Deployment, w: WeightsResult) -> PrefillResult:
    """Lower bound on prefilling one prompt of ``dep.context`` tokens on one replica."""
    c, tp = dep.context, dep.tp
    prec = default_compute_dtype(spec, hw, dep)
    active = _active_params(spec, w, per_device=False, tp=tp)
    dense = 2 * active * c + 2 * _lm_head_params(spec)
    if spec.mla is not None:
        qk, v = spec.mla.qk_nope_head_dim + spec.mla.qk_rope_head_dim, spec.mla.v_head_dim
    else:
        qk = v = spec.head_dim
    attn = spec.num_full_layers * spec.num_heads * (c * c / 2) * 2 * (qk + v)
    lin = 0.0
    if spec.linear is not None:
        la = spec.linear
        lin = spec.num_linear_layers * c * 4 * la.num_value_heads * la.key_head_dim * la.value_head_dim
    flops = dense + attn + lin
    peak = hw.flops(prec) * tp
    comp_t = flops / peak
    mem_t = w.per_device_bytes / hw.hbm_bw
    t = max(comp_t, mem_t)
    steps = [
        Step("prefill.flops", f"FLOPs to prefill {c:,} tokens", flops, "FLOP",
             f"2 x {active / 1e9:,.2f} G active params x {c:,} + logits 2 x {_lm_head_params(spec):,}"
             f" + causal attention {spec.num_full_layers} layers x {spec.num_heads} heads x {c:,}^2/2 x 2 x "
             f"({qk} + {v})" + (f" + linear state {lin / 1e12:,.2f} TFLOP" if lin else "")),
        Step("prefill.compute_time", "compute bound", comp_t, "s",
             f"{flops / 1e12:,.2f} TFLOP / ({tp} x {hw.flops(prec) / 1e12:,.1f} TFLOP/s {prec})"),
        Step("prefill.memory_time", "weights read once", mem_t, "s",
             f"{w.per_device_bytes / 1e9:,.2f} GB / {hw.hbm_bw / 1e12:,.2f} TB/s"),
        Step("prefill.tokens_per_s", "best prefill tokens/s per replica", c / t, "tok/s",
             f"{c:,} / max({comp_t * 1e3:,.2f} ms, {mem_t * 1e3:,.2f} ms)"),
    ]
    return PrefillResult(prec, flops, comp_t, mem_t, t, c / t, tuple(steps))
