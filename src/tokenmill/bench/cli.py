"""``tokenmill bench``: closed-loop agentic benchmark (or trace replay) against any
OpenAI-compatible server, and ``tokenmill bench compare DIR...``.

Exit status: 0 when every level is valid (<= 1% errors), 1 when a level is invalid, 2 on bad
arguments or an unreachable server.
"""
from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import sys
from typing import Any

from tokenmill.workload import AgenticWorkloadConfig, TraceReplayConfig

SUMMARY_FIELDS = ("concurrency", "num_requests", "errors", "ttft_p50_s", "tpot_mean_s",
                  "output_tokens_per_s_per_user", "output_tokens_per_s", "total_tokens_per_s",
                  "cache_hit_rate", "cache_hit_rate_theoretical", "littles_law_concurrency")


def _levels(text: str) -> tuple[int, ...]:
    try:
        levels = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"concurrency must be a comma-separated list of ints, got {text!r}") from None
    if not levels or any(c < 1 for c in levels):
        raise argparse.ArgumentTypeError(f"concurrency levels must be >= 1, got {text!r}")
    return levels


def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = AgenticWorkloadConfig()
    t = TraceReplayConfig()
    sub = parser.add_subparsers(dest="bench_command", metavar="[compare]")
    cmp = sub.add_parser("compare", help="overlay several result dirs and print ratios to the first")
    cmp.add_argument("dirs", nargs="+", help="result directories (or results.json files); the first is the baseline")
    cmp.add_argument("--out", default=None, help="chart path (default: DIR1/compare_pareto.png)")

    g = parser.add_argument_group("endpoint")
    g.add_argument("--base-url", default="http://127.0.0.1:8000", help="server root or .../v1")
    g.add_argument("--model", default=None, help="model name to request (default: first of /v1/models)")
    g.add_argument("--label", default=None, help="name of this endpoint in charts and compare tables")
    g.add_argument("--api-key", default=None)
    g.add_argument("--prompt-format", choices=("tokens", "text", "chat"), default="tokens")
    g.add_argument("--tokenizer", default=None,
                   help="HF tokenizer dir for text/chat prompts and re-encoding outputs (default: the default model's)")
    g.add_argument("--no-session-header", action="store_true", help="do not send X-Session-ID")
    g.add_argument("--no-ignore-eos", action="store_true", help="do not send ignore_eos: true")
    g.add_argument("--no-return-token-ids", action="store_true", help="do not send return_token_ids: true")
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--timeout", type=float, default=600.0, help="per-request timeout (s)")
    g.add_argument("--extra-body", default=None, help="JSON object merged into every request body")

    w = parser.add_argument_group("workload")
    w.add_argument("--workload", choices=("agentic", "trace"), default="agentic")
    w.add_argument("--seed", type=int, default=0)
    w.add_argument("--production-shape", action="store_true",
                   help="agentic preset of production shape (~100k input, 500 output at turn 30); "
                        "explicit shape flags still override it")
    w.add_argument("--turns", type=int, default=None, help=f"turns per session (max if --min-turns) [{d.turns_per_session}]")
    w.add_argument("--min-turns", type=int, default=None, help="heterogeneous sessions: turns uniform in [min, --turns]")
    w.add_argument("--first-turn-tokens", type=int, default=None, help=f"[{d.first_turn_tokens}]")
    w.add_argument("--new-tokens", type=int, default=None, help=f"new tokens per later turn [{d.new_tokens_per_turn}]")
    w.add_argument("--output-tokens", type=int, default=None, help=f"output tokens per turn [{d.output_tokens_per_turn}]")
    w.add_argument("--shared-prompt-tokens", type=int, default=None, help=f"system prompt shared by all sessions [{d.shared_prompt_tokens}]")
    w.add_argument("--tool-think-median", type=float, default=None, help=f"s [{d.tool_think_median_s}]")
    w.add_argument("--tool-think-sigma", type=float, default=None, help=f"[{d.tool_think_sigma}]")
    w.add_argument("--user-turn-prob", type=float, default=None, help=f"[{d.user_turn_probability}]")
    w.add_argument("--user-think-median", type=float, default=None, help=f"s [{d.user_think_median_s}]")
    w.add_argument("--user-think-sigma", type=float, default=None, help=f"[{d.user_think_sigma}]")
    w.add_argument("--think-scale", type=float, default=None, help=f"multiplies every think time [{d.think_time_scale}]")
    w.add_argument("--max-think", type=float, default=None, help=f"cap on a think time, s [{d.max_think_s}]")
    w.add_argument("--thick-fraction", type=float, default=None, help=f"fraction of sessions sending parallel requests [{d.thick_session_fraction}]")
    w.add_argument("--thick-parallel", type=int, default=None, help=f"parallel requests per turn of a thick session [{d.thick_session_parallel}]")
    w.add_argument("--trace", default=None, help="Mooncake-format JSONL (for --workload trace)")
    w.add_argument("--block-tokens", type=int, default=t.block_tokens, help="tokens per trace block (512 in the trace)")
    w.add_argument("--time-scale", type=float, default=t.time_scale, help="multiplies trace arrival times")
    w.add_argument("--max-output-tokens", type=int, default=t.max_output_tokens, help="cap on trace output lengths")
    w.add_argument("--request-rate", type=float, default=None, help="trace: Poisson arrivals at this rate (req/s) instead of trace times")
    w.add_argument("--num-requests", type=int, default=None, help="trace: requests per level (default: all)")

    r = parser.add_argument_group("load")
    r.add_argument("--concurrency", type=_levels, default=(1, 2, 4),
                   help="comma-separated levels: active sessions (agentic) or max in-flight requests (trace)")
    r.add_argument("--sessions", type=int, default=None, help="agentic: sessions per level (default 2 x concurrency, >= 4)")
    r.add_argument("--duration", type=float, default=None, help="seconds per level (no request sent after it)")
    r.add_argument("--warmup", type=float, default=0.0, help="seconds at the start of each level excluded from metrics")
    r.add_argument("--flush-cache", action="store_true", help="POST /flush_cache before each level")
    r.add_argument("--devices", type=int, default=1, help="devices serving the endpoint (for per-device throughput)")
    r.add_argument("--no-progress", action="store_true")
    r.add_argument("--out", default=None, help="directory for results.json/csv, requests.jsonl and charts")


def _agentic_config(args: argparse.Namespace) -> AgenticWorkloadConfig:
    mapping = {"turns": "turns_per_session", "min_turns": "min_turns_per_session",
               "first_turn_tokens": "first_turn_tokens", "new_tokens": "new_tokens_per_turn",
               "output_tokens": "output_tokens_per_turn", "shared_prompt_tokens": "shared_prompt_tokens",
               "tool_think_median": "tool_think_median_s", "tool_think_sigma": "tool_think_sigma",
               "user_turn_prob": "user_turn_probability", "user_think_median": "user_think_median_s",
               "user_think_sigma": "user_think_sigma", "think_scale": "think_time_scale",
               "max_think": "max_think_s", "thick_fraction": "thick_session_fraction",
               "thick_parallel": "thick_session_parallel"}
    kw: dict[str, Any] = {field: getattr(args, flag) for flag, field in mapping.items()
                          if getattr(args, flag) is not None}
    kw["seed"] = args.seed
    if args.sessions is not None:
        kw["num_sessions"] = args.sessions
    if args.production_shape:
        return AgenticWorkloadConfig.production(**kw)
    return AgenticWorkloadConfig(**kw)


def _print_summary(runs: list[dict[str, Any]]) -> None:
    print("  ".join(f"{f:>14.14}" for f in SUMMARY_FIELDS))
    for r in runs:
        cells = []
        for f in SUMMARY_FIELDS:
            v = r.get(f)
            cells.append(f"{'-':>14}" if v is None else f"{v:>14.4g}" if isinstance(v, float) else f"{v!s:>14}")
        print("  ".join(cells) + ("" if r["valid"] else "  INVALID (>1% errors)"))


def run(args: argparse.Namespace) -> int:
    if args.bench_command == "compare":
        from tokenmill.bench.report import compare

        try:
            table, chart = compare(args.dirs, args.out)
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        print(table)
        print(f"chart: {chart}")
        return 0
    try:
        return asyncio.run(_run(args))
    except (ValueError, ConnectionError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


async def _run(args: argparse.Namespace) -> int:
    from tokenmill.bench.client import BenchClient, EndpointConfig
    from tokenmill.bench.prompts import load_codec
    from tokenmill.bench.runner import BenchRunner, RunConfig
    from tokenmill.workload import load_mooncake_trace, trace_requests

    extra = json.loads(args.extra_body) if args.extra_body else {}
    if not isinstance(extra, dict):
        raise ValueError("--extra-body must be a JSON object")
    endpoint = EndpointConfig(base_url=args.base_url, model=args.model, session_header=not args.no_session_header,
                              ignore_eos=not args.no_ignore_eos, return_token_ids=not args.no_return_token_ids,
                              temperature=args.temperature, timeout_s=args.timeout, api_key=args.api_key,
                              label=args.label, extra_body=extra)
    run_cfg = RunConfig(concurrency=tuple(args.concurrency), sessions=args.sessions, num_requests=args.num_requests,
                        duration_s=args.duration, warmup_s=args.warmup, flush_cache=args.flush_cache,
                        devices=args.devices, request_rate=args.request_rate, progress=not args.no_progress,
                        prompt_format=args.prompt_format, seed=args.seed)
    codec = load_codec(args.tokenizer)
    if args.workload == "agentic":
        if args.trace or args.request_rate is not None:
            raise ValueError("--trace/--request-rate apply to --workload trace")
        workload = _agentic_config(args)
        workload_desc = workload.describe()
        runner_kw: dict[str, Any] = {"agentic": workload}
    else:
        if not args.trace:
            raise ValueError("--workload trace needs --trace FILE")
        tcfg = TraceReplayConfig(block_tokens=args.block_tokens, time_scale=args.time_scale,
                                 max_output_tokens=args.max_output_tokens, seed=args.seed)
        try:
            records = load_mooncake_trace(args.trace, limit=args.num_requests)
        except OSError as e:
            raise ValueError(f"cannot read trace {args.trace}: {e}") from None
        workload_desc = {**tcfg.describe(), "trace": str(args.trace), "num_records": len(records),
                         "request_rate": args.request_rate}
        runner_kw = {"trace": trace_requests(records, tcfg)}
    started = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
    async with BenchClient(endpoint, max_connections=max(run_cfg.concurrency) * 4 + 8) as client:
        result = await BenchRunner(client, run_cfg, codec=codec, **runner_kw).run()
        extras = dict(client.extras)
    for wmsg in result.warnings:
        print(f"warning: {wmsg}", file=sys.stderr)
    runs = []
    for lvl in result.levels:
        m = dict(lvl.metrics)
        m["ttft_samples_s"] = [r.ttft for r in lvl.records if not r.warmup and r.ok and r.ttft is not None]
        runs.append(m)
    doc = {
        "endpoint": {"base_url": endpoint.base_url, "model": result.model, "label": args.label or str(result.model).rstrip("/").rsplit("/", 1)[-1],
                     "prompt_format": args.prompt_format, "session_header": endpoint.session_header,
                     "extras": extras},
        "workload": workload_desc,
        "run": {"concurrency": list(run_cfg.concurrency), "sessions": run_cfg.sessions,
                "num_requests": run_cfg.num_requests, "duration_s": run_cfg.duration_s,
                "warmup_s": run_cfg.warmup_s, "flush_cache": run_cfg.flush_cache, "devices": run_cfg.devices,
                "request_rate": run_cfg.request_rate, "seed": run_cfg.seed},
        "created_at": started,
        "command": "tokenmill " + " ".join(sys.argv[1:]),
        "warnings": result.warnings,
        "runs": runs,
    }
    _print_summary(runs)
    if args.out:
        from tokenmill.bench.report import write_results

        paths = write_results(args.out, doc, [(lvl.concurrency, [r.to_dict() for r in lvl.records])
                                              for lvl in result.levels])
        print(f"wrote {', '.join(str(p) for p in paths)}")
    invalid = [r["concurrency"] for r in runs if not r["valid"]]
    if invalid:
        print(f"invalid levels (more than 1% errors): {invalid}; examples: "
              f"{[e for r in runs for e in r['error_examples']][:3]}", file=sys.stderr)
        return 1
    return 0
