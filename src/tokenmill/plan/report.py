"""Render a :class:`~tokenmill.plan.planner.Plan` as text (with the working shown) or as JSON.

The JSON has one key per section with plain numbers in base units (bytes, seconds, FLOP,
tokens), plus ``steps``: every shown line as ``{key, label, value, unit, formula}``.
"""
from __future__ import annotations

from dataclasses import asdict
from typing import Any

from tokenmill.plan.capacity import Step
from tokenmill.plan.planner import Plan


def fmt_bytes(b: float) -> str:
    """``70272`` -> ``70,272 B (68.6 KiB)``; ``31.25e9`` -> ``31.25 GB (29.10 GiB)``."""
    if b < 0:
        return "-" + fmt_bytes(-b)
    if b < 1e3:
        return f"{b:,.0f} B"
    if b < 1e6:
        return f"{b:,.0f} B ({b / 1024:,.1f} KiB)"
    if b < 1e9:
        return f"{b / 1e6:,.2f} MB ({b / 2 ** 20:,.1f} MiB)"
    return f"{b / 1e9:,.2f} GB ({b / 2 ** 30:,.2f} GiB)"


def fmt_value(value: float | int | None, unit: str) -> str:
    if value is None:
        return "n/a"
    if unit == "B":
        return fmt_bytes(value)
    if unit == "s":
        return f"{value * 1e3:,.3f} ms" if value < 10 else f"{value:,.1f} s"
    if unit == "FLOP":
        return f"{value / 1e9:,.1f} GFLOP" if value < 1e13 else f"{value / 1e12:,.1f} TFLOP"
    if unit in ("tokens", "sessions", "rows"):
        text = f"{value:,.0f} {unit}"
        return text + (f" ({value / 1e6:.2f} M)" if unit == "tokens" and value >= 1e5 else "")
    if unit == "tok/s":
        return f"{value:,.1f} tok/s"
    return f"{value:,} {unit}"


def _rate(value: float, unit: str) -> str:
    """``8e12, "B/s"`` -> ``8.00 TB/s``; ``2.3e11, "FLOP/s"`` -> ``230.0 GFLOP/s``."""
    for scale, prefix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M")):
        if value >= scale:
            return f"{value / scale:,.2f} {prefix}{unit}"
    return f"{value:,.0f} {unit}"


def _steps_block(title: str, steps: tuple[Step, ...]) -> list[str]:
    lines = [title]
    for s in steps:
        lines.append(f"  {s.label}: {s.formula} = {fmt_value(s.value, s.unit)}")
    return lines + [""]


def _model_line(plan: Plan) -> list[str]:
    m = plan.model
    att = m.attention_kind
    if m.mla is not None:
        att += f" (latent {m.mla.kv_lora_rank} + {m.mla.qk_rope_head_dim} = {m.mla.latent_dim})"
    else:
        att += f" ({m.num_heads} q heads, {m.num_kv_heads} KV heads x {m.head_dim})"
    parts = [f"{m.num_layers} layers: {m.num_full_layers} {att}"]
    if m.num_linear_layers and m.linear is not None:
        la = m.linear
        parts.append(f"{m.num_linear_layers} linear attention ({la.num_value_heads} heads, state "
                     f"{la.key_head_dim}x{la.value_head_dim})")
    if m.moe is not None:
        parts.append(f"MoE in {m.num_moe_layers} layers: {m.moe.num_experts} experts top-{m.moe.top_k}"
                     f" x {m.moe.expert_intermediate}" + (f" + {m.moe.num_shared} shared" if m.moe.num_shared else ""))
    bits = ", ".join(f"{k}={v:g}" for k, v in plan.deployment.weight_bits.items())
    return [f"Model     {m.name}: " + "; ".join(parts), f"          weight bits: {bits}",
            f"          source: {m.source}"]


def _hardware_lines(plan: Plan) -> list[str]:
    hw = plan.hardware
    flops = ", ".join(f"{p} {_rate(v, 'FLOP/s')}" for p, v in hw.peak_flops.items())
    ic = f"{_rate(hw.interconnect_bw, 'B/s')} per direction" if hw.interconnect_bw else "none"
    lines = [f"Hardware  {hw.name} ({hw.description}): {hw.hbm_bytes / 1e9:,.1f} GB, "
             f"{_rate(hw.hbm_bw, 'B/s')}; peak {flops}; interconnect {hw.interconnect_name}: {ic}"]
    lines += [f"          {k}: {v}" for k, v in hw.sources.items()]
    return lines


def render_text(plan: Plan) -> str:
    """Human-readable report: every number with the arithmetic that produced it."""
    d = plan.deployment
    head = (f"tokenmill plan: {plan.model.name} on {plan.hardware.name}; tp {d.tp} x dp {d.dp} = "
            f"{d.tp * d.dp} devices, ep {d.ep}, KV {d.kv_dtype}, context {d.context:,}, batch {d.batch}, "
            f"mem-fraction {d.mem_fraction:g}")
    lines = [head, ""] + _model_line(plan) + _hardware_lines(plan) + [""]
    lines += _steps_block("Weights", plan.weights.steps)
    lines += _steps_block("KV cache and recurrent state", plan.kv.steps or (Step("", "no attention state", 0, "B",
                                                                                    "model has no KV"),))
    lines += _steps_block("Capacity (per replica)", plan.capacity.steps)
    lines += _steps_block(f"Decode lower bound (batch {d.batch}, {d.context:,} tokens each)", plan.decode.steps)
    lines += _steps_block(f"Prefill lower bound (one {d.context:,}-token prompt)", plan.prefill.steps)
    if plan.moe is not None:
        lines += _steps_block(f"MoE layer lower bounds per device ({plan.moe.avg_hops:g} average hops)",
                              plan.moe.steps)
    if plan.notes:
        lines.append("Notes")
        lines += [f"  - {n}" for n in plan.notes]
    return "\n".join(lines).rstrip() + "\n"


def _plain(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {str(k): _plain(v) for k, v in obj.items() if k != "steps"}
    if isinstance(obj, (list, tuple)):
        return [_plain(v) for v in obj]
    return obj


def to_json(plan: Plan) -> dict[str, Any]:
    """JSON-ready dict (see the module docstring)."""
    m, hw, d = plan.model, plan.hardware, plan.deployment
    sections = [plan.weights.steps, plan.kv.steps, plan.capacity.steps, plan.decode.steps, plan.prefill.steps]
    if plan.moe is not None:
        sections.append(plan.moe.steps)
    return {
        "model": {"name": m.name, "source": m.source, "attention": m.attention_kind, "layers": m.num_layers,
                  "full_attention_layers": m.num_full_layers, "linear_attention_layers": m.num_linear_layers,
                  "moe_layers": m.num_moe_layers,
                  "mla_latent_dim": m.mla.latent_dim if m.mla is not None else None,
                  "params": sum(g.params for g in plan.weights.groups)},
        "hardware": {"name": hw.name, "description": hw.description, "hbm_bytes": hw.hbm_bytes,
                     "hbm_bw": hw.hbm_bw, "peak_flops": dict(hw.peak_flops),
                     "interconnect_bw": hw.interconnect_bw, "sources": dict(hw.sources),
                     "measured": hw.measured},
        "deployment": {**_plain(asdict(d)), "weight_bits": dict(d.weight_bits),
                       "devices": d.tp * d.dp},
        "weights": {"total_bytes": plan.weights.total_bytes, "per_device_bytes": plan.weights.per_device_bytes,
                    "given": plan.weights.given,
                    "groups": [g._asdict() for g in plan.weights.groups]},
        "kv": {"per_token_per_device_bytes": plan.kv.per_token_per_device,
               "per_token_all_devices_bytes": plan.kv.per_token_all_devices,
               "state_per_request_per_device_bytes": plan.kv.state_per_request_per_device},
        "capacity": _plain(asdict(plan.capacity)),
        "decode": _plain(asdict(plan.decode)),
        "prefill": _plain(asdict(plan.prefill)),
        "moe": _plain(asdict(plan.moe)) if plan.moe is not None else None,
        "notes": list(plan.notes),
        "steps": [s._asdict() for sec in sections for s in sec],
    }
