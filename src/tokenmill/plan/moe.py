"""Per-device lower bounds for one MoE layer (``--moe-bounds``), by seed 003's method.

For ``tokens`` routed with top-k over ``E`` experts split across ``ep`` devices:

    routed rows per device   R = tokens x top_k / ep
    local experts            L = E / ep,  rows per expert r = R / L
    routed FLOPs             L x [2 matrices x 2 r h f  (W1, W3)  + 2 r f h  (W2)] = 6 R h f
    shared-expert FLOPs      n_shared x 3 matrices x 2 x S h f_s, S = shared rows (seed: S = R)
    compute bound            (routed + shared) / peak FLOP/s
    dispatch payload         R x h x activation bytes (bf16 and fp8)
    all-to-all time          payload x average hops / injection bandwidth, for the scatter, and
                             twice that for scatter + gather
    expert weight bytes      L x 3 x h x f x expert bytes
    weight read bound        weight bytes / HBM bandwidth per pass, x ceil(r / tile rows) passes

Hops: 1 on a switched network (NVLink); on a torus the mean wrap-around distance to a random
destination (2.0 for seed 003's 2x2x4). Contention, DMA granularity and layout work are ignored.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from tokenmill.plan.capacity import Deployment, Step
from tokenmill.plan.hardware import HardwareSpec, PlanError, torus_average_hops
from tokenmill.plan.models import ModelSpec
from tokenmill.plan.roofline import default_compute_dtype


@dataclass(frozen=True)
class MoEBoundsInput:
    """What the MoE bound needs beyond the model and hardware; validated on construction."""

    tokens: int
    tile_rows: int | None = None
    shared_rows: float | None = None
    torus: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if self.tokens < 1:
            raise PlanError("--moe-tokens must be positive")
        if self.tile_rows is not None and self.tile_rows < 1:
            raise PlanError("--moe-tile-rows must be positive")
        if self.shared_rows is not None and self.shared_rows < 0:
            raise PlanError("--moe-shared-rows must not be negative")


@dataclass(frozen=True)
class MoEBoundsResult:
    routed_rows: float
    local_experts: int
    rows_per_expert: float
    routed_flops: float
    shared_flops: float
    total_flops: float
    compute_dtype: str
    compute_time_s: float
    payload_bytes: dict[str, float]
    avg_hops: float
    scatter_injection_s: dict[str, float]
    scatter_s: dict[str, float]
    scatter_gather_s: dict[str, float]
    expert_weight_bytes: float
    weight_read_pass_s: float
    passes: int
    weight_read_s: float
    steps: tuple[Step, ...]


def moe_bounds(spec: ModelSpec, hw: HardwareSpec, dep: Deployment, inp: MoEBoundsInput) -> MoEBoundsResult:
    """Seed 003's per-device cost model of one MoE layer (see the module docstring)."""
    moe = spec.moe
    if moe is None:
        raise PlanError(f"--moe-bounds: {spec.name} has no MoE layers")
    ep, h, f, k = dep.ep, spec.hidden_size, moe.expert_intermediate, moe.top_k
    if moe.num_experts % ep:
        raise PlanError(f"--moe-bounds: {moe.num_experts} experts do not split over --ep {ep}")
    rows = inp.tokens * k / ep
    local = moe.num_experts // ep
    per_expert = rows / local
    steps = [
        Step("moe.routed_rows", "routed rows per device", rows, "rows", f"{inp.tokens:,} x {k} / {ep}"),
        Step("moe.rows_per_expert", "rows per local expert", per_expert, "rows",
             f"{rows:,.0f} / ({moe.num_experts} / {ep} = {local} local experts)"),
    ]
    ffn1 = local * 2 * (2 * per_expert * h * f)
    ffn2 = local * 1 * (2 * per_expert * f * h)
    routed = ffn1 + ffn2
    steps += [
        Step("moe.ffn1_flops", "FFN1 (W1, W3)", ffn1, "FLOP",
             f"{local} experts x 2 matrices x (2 x {per_expert:,.0f} x {h} x {f})"),
        Step("moe.ffn2_flops", "FFN2 (W2)", ffn2, "FLOP",
             f"{local} experts x 1 matrix x (2 x {per_expert:,.0f} x {f} x {h})"),
        Step("moe.routed_flops", "routed FLOPs per device", routed, "FLOP", "FFN1 + FFN2"),
    ]
    shared_rows = rows if inp.shared_rows is None else inp.shared_rows
    shared = moe.num_shared * 3 * (2 * shared_rows * h * moe.shared_intermediate)
    if moe.num_shared:
        steps.append(Step("moe.shared_flops", "shared-expert FLOPs per device", shared, "FLOP",
                          f"{moe.num_shared} x 3 matrices x (2 x {shared_rows:,.0f} rows x {h} x "
                          f"{moe.shared_intermediate})"))
    total = routed + shared
    prec = default_compute_dtype(spec, hw, dep)
    peak = hw.flops(prec)
    comp = total / peak
    steps += [
        Step("moe.total_flops", "total FLOPs per device", total, "FLOP", "routed + shared"),
        Step("moe.compute_time", "compute bound", comp, "s",
             f"{total / 1e9:,.1f} GFLOP / {peak / 1e12:,.1f} TFLOP/s ({prec})"),
    ]
    payload = {name: rows * h * b for name, b in (("bf16", 2), ("fp8", 1))}
    torus = inp.torus if inp.torus is not None else hw.torus
    hops = torus_average_hops(torus) if torus else 1.0
    inj: dict[str, float] = {}
    scat: dict[str, float] = {}
    both: dict[str, float] = {}
    for name, p in payload.items():
        steps.append(Step(f"moe.payload_{name}", f"scatter payload ({name})", p, "B",
                          f"{rows:,.0f} rows x {h} hidden x {2 if name == 'bf16' else 1} B"))
        if hw.interconnect_bw:
            inj[name] = p / hw.interconnect_bw
            scat[name] = inj[name] * hops
            both[name] = 2 * scat[name]
            steps.append(Step(f"moe.scatter_gather_time_{name}", f"scatter + gather bound ({name})", both[name],
                              "s", f"2 x {p / 1e6:,.1f} MB x {hops:g} hops / {hw.interconnect_bw / 1e9:,.0f} GB/s"
                                   f" (injection only, one way: {inj[name] * 1e3:,.3f} ms)"))
    expert_bytes = local * 3 * h * f * dep.weight_bits["experts"] / 8
    per_pass = expert_bytes / hw.hbm_bw
    passes = math.ceil(per_expert / inp.tile_rows) if inp.tile_rows else 1
    steps += [
        Step("moe.expert_weight_bytes", "local expert weights", expert_bytes, "B",
             f"{local} experts x 3 x {h} x {f} x {dep.weight_bits['experts']:g} bits / 8"),
        Step("moe.weight_read_pass", "weight read bound per pass", per_pass, "s",
             f"{expert_bytes / 1e6:,.1f} MB / {hw.hbm_bw / 1e12:,.2f} TB/s"),
    ]
    if inp.tile_rows:
        steps.append(Step("moe.weight_read", f"weight reads with {inp.tile_rows}-row token tiles",
                          passes * per_pass, "s",
                          f"ceil({per_expert:,.0f} / {inp.tile_rows}) = {passes} passes x {per_pass * 1e3:,.3f} ms"))
    return MoEBoundsResult(rows, local, per_expert, routed, shared, total, prec, comp, payload, hops,
                           inj, scat, both, expert_bytes, per_pass, passes, passes * per_pass, tuple(steps))
