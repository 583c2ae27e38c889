"""``tokenmill plan``: capacity and roofline napkin math for a model on given hardware.

Pure Python: torch is never imported at module level (``cpu-local`` imports it lazily, only to
measure bf16 matmul speed). Exit status 0 on success, 2 on bad input with a one-line message.
"""
from __future__ import annotations

import argparse
import json
import sys

from tokenmill.plan.capacity import DTYPE_BYTES, Deployment
from tokenmill.plan.hardware import HARDWARE_NAMES, PRECISIONS, PRESETS, PlanError, get_hardware, parse_torus
from tokenmill.plan.models import MODEL_PRESETS, WEIGHT_GROUPS, load_model, parse_weight_bits
from tokenmill.plan.moe import MoEBoundsInput
from tokenmill.plan.planner import make_plan
from tokenmill.plan.report import render_text, to_json


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", help=f"preset ({', '.join(MODEL_PRESETS)}) or path to an HF config.json")
    parser.add_argument("--hardware", help=f"preset: {', '.join(HARDWARE_NAMES)} (cpu-local is measured now)")
    parser.add_argument("--list", action="store_true", help="list model and hardware presets and exit")
    dep = parser.add_argument_group("deployment")
    dep.add_argument("--tp", type=int, default=1, help="tensor-parallel devices per replica")
    dep.add_argument("--ep", type=int, default=1, help="expert-parallel degree (divides --tp)")
    dep.add_argument("--dp", type=int, default=1, help="number of replicas")
    dep.add_argument("--kv-dtype", choices=sorted(DTYPE_BYTES), default="bf16")
    dep.add_argument("--kv-fp8-scales", choices=("static", "token"), default="static",
                     help="fp8 KV scales (serve's --kv-cache-fp8-scales): static = per layer and head, "
                          "nothing per token; token = one fp32 scale per token and head")
    dep.add_argument("--state-dtype", choices=sorted(DTYPE_BYTES), default="fp32",
                     help="linear-attention recurrent state dtype")
    dep.add_argument("--context", type=int, default=8192, help="tokens per session")
    dep.add_argument("--batch", type=int, default=1, help="concurrent sequences per decode step")
    dep.add_argument("--mem-fraction", type=float, default=0.9,
                     help="fraction of device memory for weights + KV (default 0.9)")
    dep.add_argument("--weight-bits", default=None,
                     help=f"bits per weight by group, e.g. experts=4.5,attention=fp8,all=16; groups: "
                          f"{', '.join(WEIGHT_GROUPS)}")
    dep.add_argument("--compute-dtype", choices=PRECISIONS, default=None,
                     help="precision of the matmuls for compute bounds (default: from the weight bits)")
    over = parser.add_argument_group("overrides (a seed's assumptions)")
    over.add_argument("--weights-gb", type=float, default=None, help="total weight GB, split evenly over tp")
    over.add_argument("--gpu-mem-gb", "--hbm-gb", dest="hbm_gb", type=float, default=None,
                      help="memory per device, GB")
    over.add_argument("--hbm-bw-tbps", type=float, default=None, help="memory bandwidth per device, TB/s")
    over.add_argument("--interconnect-gbps", type=float, default=None,
                      help="interconnect injection bandwidth per device and direction, GB/s")
    dep.add_argument("--kv-cache-memory", dest="kv_cache_memory_gib", type=float, default=None, metavar="GIB",
                     help="also report the tokens a KV pool of this many GiB per device holds (as tokenmill serve)")
    dep.add_argument("--page-size", type=int, default=16, help="KV page size in tokens (with --kv-cache-memory)")
    over.add_argument("--reserve-gb", type=float, default=0.0, help="per-device memory kept for activations")
    moe = parser.add_argument_group("MoE layer bounds")
    moe.add_argument("--moe-bounds", action="store_true", help="per-device lower bounds for one MoE layer")
    moe.add_argument("--moe-tokens", type=int, default=None, help="tokens in the MoE batch (default --context)")
    moe.add_argument("--moe-tile-rows", type=int, default=None, help="token rows per expert weight pass")
    moe.add_argument("--moe-shared-rows", type=float, default=None,
                     help="rows the shared expert runs on per device (default: the routed rows, as seed 003)")
    moe.add_argument("--torus", default=None, help="ICI torus shape for hop counts, e.g. 2x2x4")
    parser.add_argument("--json", action="store_true", help="print JSON instead of text")


def _list_presets() -> str:
    lines = ["models:"]
    lines += [f"  {name}: {p.source}" for name, p in MODEL_PRESETS.items()]
    lines.append("hardware:")
    lines += [f"  {name}: {hw.description}" for name, hw in PRESETS.items()]
    lines.append("  cpu-local: this machine, measured on the spot")
    return "\n".join(lines)


def build(args: argparse.Namespace):
    """Turn parsed arguments into a :class:`~tokenmill.plan.planner.Plan` (raises PlanError)."""
    if not args.model or not args.hardware:
        raise PlanError("--model and --hardware are required (see --list)")
    spec = load_model(args.model)
    hw = get_hardware(args.hardware).with_overrides(
        hbm_bytes=args.hbm_gb * 1e9 if args.hbm_gb is not None else None,
        hbm_bw=args.hbm_bw_tbps * 1e12 if args.hbm_bw_tbps is not None else None,
        interconnect_bw=args.interconnect_gbps * 1e9 if args.interconnect_gbps is not None else None)
    dep = Deployment(tp=args.tp, ep=args.ep, dp=args.dp, kv_dtype=args.kv_dtype, kv_fp8_scales=args.kv_fp8_scales,
                     state_dtype=args.state_dtype,
                     context=args.context, batch=args.batch, mem_fraction=args.mem_fraction,
                     weight_bits=parse_weight_bits(args.weight_bits, spec.default_bits),
                     weights_bytes=args.weights_gb * 1e9 if args.weights_gb is not None else None,
                     reserve_bytes=args.reserve_gb * 1e9, compute_dtype=args.compute_dtype,
                     kv_memory_bytes=args.kv_cache_memory_gib * 2**30 if args.kv_cache_memory_gib is not None else None,
                     page_size=args.page_size)
    moe_input = None
    if args.moe_bounds:
        moe_input = MoEBoundsInput(tokens=args.moe_tokens or args.context, tile_rows=args.moe_tile_rows,
                                   shared_rows=args.moe_shared_rows,
                                   torus=parse_torus(args.torus) if args.torus else None)
    elif any(v is not None for v in (args.moe_tokens, args.moe_tile_rows, args.moe_shared_rows, args.torus)):
        raise PlanError("--moe-tokens/--moe-tile-rows/--moe-shared-rows/--torus need --moe-bounds")
    return make_plan(spec, hw, dep, moe_input)


def run(args: argparse.Namespace) -> int:
    if args.list:
        print(_list_presets())
        return 0
    try:
        plan = build(args)
    except PlanError as exc:
        print(f"tokenmill plan: error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(to_json(plan), indent=2))
    else:
        print(render_text(plan), end="")
    return 0
