"""``tokenmill sim``: the fleet simulator; ``tokenmill sim calibrate``; ``tokenmill sim static``.

    tokenmill sim --replicas 50 --sessions 250 --policy agentic --duration 1h \\
                  --scale-at 30m:+5 --out runs/agentic --json
    tokenmill sim calibrate --base-url http://127.0.0.1:8000 --out profile.json
    tokenmill sim static --sessions 250 --replicas 50 --seeds 500
"""
from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from tokenmill.sim.config import (
    AutoscaleRule, SimConfig, parse_duration, parse_population_change, parse_scale_event,
)

WORKLOAD_SHAPES = ("production", "small")
# argparse dest -> AgenticWorkloadConfig field
_SHAPE_FLAGS = {
    "first_turn_tokens": "first_turn_tokens", "new_tokens": "new_tokens_per_turn",
    "output_tokens": "output_tokens_per_turn", "shared_prompt_tokens": "shared_prompt_tokens",
    "tool_think_median": "tool_think_median_s", "tool_think_sigma": "tool_think_sigma",
    "user_turn_prob": "user_turn_probability", "user_think_median": "user_think_median_s",
    "user_think_sigma": "user_think_sigma", "max_think": "max_think_s",
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="sim_command", metavar="{calibrate,static}")
    sub.required = False
    cal = sub.add_parser("calibrate", help="measure a running tokenmill server and write a replica profile")
    from tokenmill.sim.calibrate import add_calibrate_arguments

    add_calibrate_arguments(cal)
    st = sub.add_parser("static", help="static hashing analysis: sessions hashed onto replicas")
    st.add_argument("--sessions", type=int, default=250)
    st.add_argument("--replicas", type=int, default=50)
    st.add_argument("--seeds", type=int, default=500, help="Monte-Carlo repetitions (default 500)")
    st.add_argument("--policy", default="session_hash")
    st.add_argument("--json", action="store_true", help="print the result as JSON")

    g = parser.add_argument_group("fleet")
    g.add_argument("--replicas", type=int, default=50, help="replicas at the start (default 50)")
    g.add_argument("--profile", default="kimi-k2.6-b200-tp4",
                   help="replica profile: a preset name or a profile JSON (default kimi-k2.6-b200-tp4)")
    g.add_argument("--list-profiles", action="store_true", help="print the presets and their assumptions, then exit")
    g.add_argument("--host-cache-tokens", type=int, default=None,
                   help="L2 host tier per replica, in tokens (overrides the profile; 0 = none)")
    g.add_argument("--storage-tokens", type=int, default=None,
                   help="L3 storage tier shared by the fleet, in tokens (overrides the profile; 0 = none)")
    g.add_argument("--kv-bytes-per-token", type=int, default=None, help="KV bytes per token (tier transfer sizes)")
    g.add_argument("--host-bandwidth-gbs", type=float, default=None, help="L2 -> device GB/s")
    g.add_argument("--storage-bandwidth-gbs", type=float, default=None, help="L3 -> device GB/s")
    g.add_argument("--storage-latency", default=None, help="L3 latency per admission, e.g. 2ms")
    g.add_argument("--policy", default="agentic", help="router policy: random, session_hash, agentic, ... (default agentic)")
    g.add_argument("--policy-opt", action="append", default=[], metavar="KEY=VALUE",
                   help="option of the policy, e.g. session_max_inflight=2 (repeatable)")
    g.add_argument("--scale-at", action="append", default=[], metavar="T:+K",
                   help="add (+K) or drain (-K) replicas at time T, e.g. 30m:+5 (repeatable)")
    g.add_argument("--autoscale-target", type=float, default=None,
                   help="target in-flight requests per replica: resize the fleet to follow it")
    g.add_argument("--autoscale-interval", default="30s")
    g.add_argument("--autoscale-min", type=int, default=1)
    g.add_argument("--autoscale-max", type=int, default=1000)
    g.add_argument("--replica-startup", default="60s", help="time for an autoscaled replica to come up")
    g.add_argument("--report-interval", default="0", help="staleness of replicas' load reports (default 0: fresh)")
    g.add_argument("--retention", default="60s", help="cache retention window of a finished session's prefix")
    g.add_argument("--block-tokens", type=int, default=None, help="cache resolution in tokens (default: auto)")

    w = parser.add_argument_group("workload")
    w.add_argument("--sessions", type=int, default=250, help="agent sessions running at once (default 250)")
    w.add_argument("--sessions-at", action="append", default=[], metavar="T:S",
                   help="from time T keep S sessions running (repeatable)")
    w.add_argument("--workload", choices=WORKLOAD_SHAPES, default="production",
                   help="production: ~100k input / 500 output tokens at turn 30; small: the CPU bench's shape")
    # shape flags: the same names as `tokenmill bench`; unset ones come from --workload
    w.add_argument("--turns", type=int, default=None, help="turns per session (max if --min-turns)")
    w.add_argument("--min-turns", type=int, default=None,
                   help="sessions draw their turns in [min, --turns] (default: --turns / 6)")
    for flag, kind, helptext in (
            ("--first-turn-tokens", int, "the session's own first block"),
            ("--new-tokens", int, "new tokens per later turn"),
            ("--output-tokens", int, "output tokens per turn"),
            ("--shared-prompt-tokens", int, "system prompt shared by all sessions"),
            ("--tool-think-median", float, "s"), ("--tool-think-sigma", float, "lognormal sigma"),
            ("--user-turn-prob", float, "share of turns that wait for the user"),
            ("--user-think-median", float, "s"), ("--user-think-sigma", float, "lognormal sigma"),
            ("--max-think", float, "cap on a think time, s")):
        w.add_argument(flag, type=kind, default=None, help=helptext)
    w.add_argument("--think-scale", type=float, default=1.0, help="multiply every think time")
    w.add_argument("--thick-fraction", type=float, default=0.1, help="share of sessions sending parallel requests")
    w.add_argument("--thick-parallel", type=int, default=4, help="parallel requests per turn of a thick session")
    w.add_argument("--start", choices=("stationary", "cold"), default="stationary",
                   help="stationary: the first sessions start at a random turn, spread over --start-spread; "
                        "cold: all start at turn 0 at once (like `tokenmill bench`)")
    w.add_argument("--start-spread", default="10s")
    w.add_argument("--trace", default=None, help="replay a Mooncake JSONL trace instead of agent sessions")
    w.add_argument("--trace-limit", type=int, default=None)
    w.add_argument("--trace-time-scale", type=float, default=1.0)

    r = parser.add_argument_group("run")
    r.add_argument("--duration", default="10m", help="simulated time, e.g. 600, 10m, 1h (default 10m)")
    r.add_argument("--warmup", default="60s", help="left out of the summary (default 60s)")
    r.add_argument("--sample-interval", default="1s")
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--out", default=None, help="directory for summary.json, load.csv, requests.csv, load_hist.png")
    r.add_argument("--json", action="store_true", help="print the summary as JSON on stdout")
    r.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")


def _policy_options(items: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for item in items:
        if "=" not in item:
            raise ValueError(f"--policy-opt {item!r} must be KEY=VALUE")
        k, v = item.split("=", 1)
        try:
            out[k.strip()] = json.loads(v)
        except json.JSONDecodeError:
            out[k.strip()] = v
    return out


def build_config(args: argparse.Namespace) -> SimConfig:
    """SimConfig from parsed ``tokenmill sim`` arguments (raises ValueError on bad input)."""
    from tokenmill.workload import AgenticWorkloadConfig, load_mooncake_trace
    from tokenmill.sim.profiles import load_profile

    profile = load_profile(args.profile)
    tier_overrides = {name: value for name, value in (
        ("host_cache_tokens", args.host_cache_tokens), ("storage_tokens", args.storage_tokens),
        ("kv_bytes_per_token", args.kv_bytes_per_token), ("host_bandwidth_gb_s", args.host_bandwidth_gbs),
        ("storage_bandwidth_gb_s", args.storage_bandwidth_gbs),
        ("storage_latency_s", parse_duration(args.storage_latency) if args.storage_latency else None),
    ) if value is not None}
    if tier_overrides:
        import dataclasses

        profile = dataclasses.replace(profile, **tier_overrides)
    workload = trace = None
    if args.trace:
        trace = tuple(load_mooncake_trace(args.trace, limit=args.trace_limit))
    else:
        if args.workload == "production":
            base = AgenticWorkloadConfig.production(num_sessions=max(1, args.sessions))
        else:
            base = AgenticWorkloadConfig(num_sessions=max(1, args.sessions))
        turns = args.turns or base.turns_per_session
        min_turns = args.min_turns if args.min_turns is not None else max(1, turns // 6)
        shape = {field: getattr(args, flag) for flag, field in _SHAPE_FLAGS.items() if getattr(args, flag) is not None}
        workload = AgenticWorkloadConfig(**{
            **vars(base), **shape,
            "turns_per_session": turns, "min_turns_per_session": min(min_turns, turns),
            "thick_session_fraction": args.thick_fraction, "thick_session_parallel": args.thick_parallel,
            "think_time_scale": args.think_scale, "seed": args.seed,
        })
    autoscale = None
    if args.autoscale_target is not None:
        autoscale = AutoscaleRule(target=args.autoscale_target, interval_s=parse_duration(args.autoscale_interval),
                                  min_replicas=args.autoscale_min, max_replicas=args.autoscale_max,
                                  startup_s=parse_duration(args.replica_startup))
    return SimConfig(
        replicas=args.replicas, profile=profile, policy=args.policy, duration_s=parse_duration(args.duration),
        sessions=args.sessions if trace is None else 0, workload=workload, trace=trace,
        trace_time_scale=args.trace_time_scale, policy_options=_policy_options(args.policy_opt),
        scale_events=tuple(parse_scale_event(s) for s in args.scale_at),
        population_changes=tuple(parse_population_change(s) for s in args.sessions_at),
        autoscale=autoscale, sample_interval_s=parse_duration(args.sample_interval),
        warmup_s=parse_duration(args.warmup), report_interval_s=parse_duration(args.report_interval),
        block_tokens=args.block_tokens, session_retention_s=parse_duration(args.retention), seed=args.seed,
        stationary_start=args.start == "stationary", start_spread_s=parse_duration(args.start_spread),
    )


def _print_human(summary: dict[str, Any]) -> None:
    cfg = summary["config"]
    p = print
    p(f"policy {cfg['policy']}, {cfg['replicas']} replicas ({summary['replicas_final']} at the end), "
      f"{cfg['sessions']} sessions, profile {cfg['profile']}, {cfg['duration_s']:.0f} s simulated "
      f"in {summary['sim_wall_s']:.1f} s", file=sys.stderr)
    for metric, st in summary["load"].items():
        p(f"  load {metric:18s} mean {st['mean']:6.2f}  var {st['variance']:6.2f}  var/mean {st['var_over_mean']:5.2f}"
          f"  <=1 {st['frac_le_1']:6.1%}  >=12 {st['frac_ge_12']:6.2%}  max {st['max']}", file=sys.stderr)
    t = summary["ttft_s"]
    p(f"  TTFT p50 {t['p50']:.3f} s  p99 {t['p99']:.3f} s   CHR {summary['chr']:.3f}   "
      f"output {summary['throughput']['output_tokens_per_s']:.0f} tok/s   "
      f"{summary['requests_finished']} requests", file=sys.stderr)
    for ev in summary["scale_events"]:
        frac = ev["moved_fraction"]
        p(f"  scale {ev['source']} at {ev['time_s']:.0f} s: {ev['replicas_before']} -> {ev['replicas_after']}, "
          f"moved {ev['moved_sessions']}/{ev['observed_sessions']} live sessions"
          + (f" ({frac:.1%})" if frac is not None else ""), file=sys.stderr)
    p(f"  decisions: {summary['decisions']}", file=sys.stderr)
    if "tiers" in summary:
        t = summary["tiers"]
        p(f"  cache hits by tier (tokens): {t['hit_tokens']}; L3 holds {t['storage_pages']} pages", file=sys.stderr)


def run(args: argparse.Namespace) -> int:
    if args.sim_command == "calibrate":
        from tokenmill.sim.calibrate import run_calibrate

        return run_calibrate(args)
    if args.sim_command == "static":
        return _run_static(args)
    if args.list_profiles:
        from tokenmill.sim.profiles import get_preset, preset_names

        for name in preset_names():
            print(json.dumps(get_preset(name).to_dict(), indent=2))
        return 0
    try:
        cfg = build_config(args)
    except (ValueError, OSError) as e:
        print(f"tokenmill sim: {e}", file=sys.stderr)
        return 2
    from tokenmill.sim.fleet import simulate
    from tokenmill.sim.metrics import write_outputs

    try:
        result = simulate(cfg, progress=not args.no_progress)
    except ValueError as e:
        print(f"tokenmill sim: {e}", file=sys.stderr)
        return 2
    summary = dict(result)
    if args.out:
        paths = write_outputs(args.out, result.recorder, summary)
        print(f"wrote {', '.join(str(p) for p in paths)}", file=sys.stderr)
    if args.json:
        print(json.dumps(summary, indent=2, default=str))
    else:
        _print_human(summary)
    return 0


def _run_static(args: argparse.Namespace) -> int:
    from tokenmill.sim.static import static_hash_analysis

    if args.seeds < 1:
        print("tokenmill sim static: --seeds must be >= 1", file=sys.stderr)
        return 2
    try:
        res = static_hash_analysis(args.sessions, args.replicas, range(args.seeds), args.policy)
    except ValueError as e:
        print(f"tokenmill sim static: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(res.to_dict(), indent=2))
    else:
        print(f"{res.sessions} sessions on {res.replicas} replicas by {args.policy}, {res.seeds} seeds: "
              f"mean {res.mean:.2f}, var/mean {res.var_over_mean:.3f}\n"
              f"  replicas with <= 1 session: {res.frac_le_1:.2%} (Binomial {res.binomial_le_1:.2%}, "
              f"Poisson {res.poisson_le_1:.2%})\n"
              f"  replicas with >= 12 sessions: {res.frac_ge_12:.2%} (Binomial {res.binomial_ge_12:.2%}, "
              f"Poisson {res.poisson_ge_12:.2%})")
    return 0
