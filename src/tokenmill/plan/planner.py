"""One call that runs every planner calculation: :func:`make_plan` -> :class:`Plan`.

It also compares the result with the figures the seeds publish when the deployment uses the same
assumptions (``SEED_KV_CLAIMS``), so a disagreement is reported next to the number, not hidden.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from tokenmill.plan.capacity import (CapacityResult, Deployment, KVResult, WeightsResult, capacity,
                                     check_sharding, kv_bytes, weights)
from tokenmill.plan.hardware import HardwareSpec
from tokenmill.plan.models import ModelSpec
from tokenmill.plan.moe import MoEBoundsInput, MoEBoundsResult, moe_bounds
from tokenmill.plan.roofline import DecodeResult, PrefillResult, decode_bound, prefill_bound


class SeedClaim(NamedTuple):
    """A KV-capacity figure a seed publishes, with the assumptions it was made under."""

    model: str
    tp: int
    hbm_bytes: float
    weights_bytes: float
    kv_dtype: str
    tokens: float
    source: str


SEED_KV_CLAIMS = (
    SeedClaim("kimi-k2.6", 4, 180e9, 595e9, "bf16", 0.45e6, "seed 000 table, TP4 row"),
    SeedClaim("kimi-k2.6", 8, 180e9, 595e9, "bf16", 3.0e6, "seed 000 table, TP8 row"),
)


def seed_notes(spec: ModelSpec, hw: HardwareSpec, dep: Deployment, kv: KVResult,
               cap: CapacityResult) -> list[str]:
    """Compare with a seed's published capacity when this plan uses the seed's assumptions."""
    out = []
    for c in SEED_KV_CLAIMS:
        same = (spec.name == c.model and dep.tp == c.tp and hw.hbm_bytes == c.hbm_bytes
                and dep.weights_bytes == c.weights_bytes and dep.kv_dtype == c.kv_dtype
                and dep.mem_fraction == 1.0 and not dep.reserve_bytes)
        if not same or cap.kv_tokens_per_replica is None:
            continue
        got = cap.kv_tokens_per_replica
        if abs(got - c.tokens) <= 0.05 * c.tokens:
            out.append(f"{c.source}: {c.tokens / 1e6:.2f} M tokens; this plan gives {got / 1e6:.3f} M, which agrees")
            continue
        free_total = cap.free_per_replica
        divisor = free_total / kv.per_token_per_device / c.tokens
        out.append(
            f"{c.source} says {c.tokens / 1e6:.1f} M tokens, but under the same assumptions this plan gives "
            f"{got / 1e6:.2f} M. The seed's figure is {free_total / 1e9:,.0f} GB / {kv.per_token_per_device:,} B "
            f"/ {divisor:.0f}, i.e. the replica's free memory divided as if it had {divisor:.0f} ranks "
            f"instead of {dep.tp}. Every one of the {dep.tp} ranks holds the full MLA latent of "
            f"every token, so capacity = per-device KV memory ({cap.free_per_device / 1e9:,.1f} GB) / "
            f"{kv.per_token_per_device:,} B = {got / 1e6:.2f} M tokens.")
    return out


@dataclass(frozen=True)
class Plan:
    model: ModelSpec
    hardware: HardwareSpec
    deployment: Deployment
    weights: WeightsResult
    kv: KVResult
    capacity: CapacityResult
    decode: DecodeResult
    prefill: PrefillResult
    moe: MoEBoundsResult | None
    notes: tuple[str, ...]


def make_plan(spec: ModelSpec, hw: HardwareSpec, dep: Deployment,
              moe_input: MoEBoundsInput | None = None) -> Plan:
    """Run every calculation; raises ``PlanError`` for layouts the model cannot take."""
    check_sharding(spec, dep)
    w = weights(spec, dep)
    kv = kv_bytes(spec, dep)
    cap = capacity(spec, hw, dep, w, kv)
    dec = decode_bound(spec, hw, dep, w, kv, cap)
    pre = prefill_bound(spec, hw, dep, w)
    moe = moe_bounds(spec, hw, dep, moe_input) if moe_input is not None else None
    notes = list(spec.notes) + list(cap.notes) + list(dec.notes) + seed_notes(spec, hw, dep, kv, cap)
    notes += [f"{hw.name}: {n}" for n in hw.notes]
    return Plan(spec, hw, dep, w, kv, cap, dec, pre, moe, tuple(notes))
