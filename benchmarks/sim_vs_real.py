"""How far the simulator's predictions lie from a real fleet: 2 tiny-model replicas.

1. Start N ``tokenmill serve`` replicas of the tiny random-weight model (built here) and
   calibrate a profile against the first one (``tokenmill sim calibrate``); flush their caches.
2. Start ``tokenmill route`` in front of them and run ``tokenmill bench`` (closed-loop agent
   sessions) through it.
3. Run ``tokenmill sim`` with the calibrated profile, the same workload flags, the same number
   of concurrent sessions, duration and warm-up, all sessions starting cold at once (as the
   bench does).
4. Print both side by side with the ratio sim / real, and write them to --out.

    .venv/bin/python benchmarks/sim_vs_real.py --out /tmp/sim-vs-real [--concurrency 8] [--duration 120]
        [--replicas 2] [--calibrate alone|together]
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import httpx

from tokenmill.utils.proc import ServiceProcess

# workload flags shared verbatim by `tokenmill bench` and `tokenmill sim`
WORKLOAD = ["--turns", "6", "--min-turns", "2", "--first-turn-tokens", "256", "--new-tokens", "64",
            "--output-tokens", "16", "--shared-prompt-tokens", "64", "--tool-think-median", "0.2",
            "--tool-think-sigma", "0.8", "--user-turn-prob", "0.1", "--user-think-median", "2.0",
            "--user-think-sigma", "0.7", "--max-think", "30", "--thick-fraction", "0.25", "--thick-parallel", "2"]

# the replicas run `tokenmill serve` defaults, whose engine bounds prefill while decodes run
SERVE_BOUND = ["--decode-slowdown", "2.0"]

METRICS = [  # (label, bench results key, sim summary path)
    ("TTFT p50 (s)", "ttft_p50_s", ("ttft_s", "p50")),
    ("TTFT p99 (s)", "ttft_p99_s", ("ttft_s", "p99")),
    ("TPOT mean (s)", "tpot_mean_s", ("tpot_s", "mean")),
    ("e2e p50 (s)", "e2e_latency_p50_s", ("e2e_s", "p50")),
    ("output tok/s", "output_tokens_per_s", ("throughput", "output_tokens_per_s")),
    ("prompt tok/s", "input_tokens_per_s", ("throughput", "prompt_tokens_per_s")),
    ("cache hit rate", "cache_hit_rate", ("chr",)),
    ("requests", "num_ok", ("requests_finished",)),
]


def tm(*args: str, timeout: float = 1800) -> subprocess.CompletedProcess[str]:
    p = subprocess.run([sys.executable, "-m", "tokenmill.cli", *args], capture_output=True, text=True, timeout=timeout)
    if p.returncode != 0:
        raise RuntimeError(f"tokenmill {' '.join(args[:2])} failed ({p.returncode}): {p.stderr[-2000:]}")
    return p


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--model", default=None, help="HF dir to serve (default: build the tiny random model)")
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--concurrency", type=int, default=8, help="concurrent agent sessions")
    ap.add_argument("--duration", type=int, default=120)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--policy", default="agentic")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--serve-args", default="", help="extra `tokenmill serve` flags, space-separated")
    ap.add_argument("--calibrate", choices=("alone", "together"), default="alone",
                    help="alone: calibrate replica 0 while the others idle; together: calibrate every "
                         "replica at the same time (they share the CPU as in the fleet run) and use replica 0's")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model = args.model
    if model is None:
        from tokenmill.loader.tiny import build_tiny_checkpoint

        model = tempfile.mkdtemp(prefix="tiny-")
        build_tiny_checkpoint(model, arch="LlamaForCausalLM", seed=0)
    serve = ["serve", "--model", model, *args.serve_args.split()]
    replicas = [ServiceProcess(serve, log_path=out / f"replica{i}.log") for i in range(args.replicas)]
    try:
        for r in replicas:
            r.start()
        profile = out / "profile.json"
        if args.calibrate == "alone":
            tm("sim", "calibrate", "--base-url", replicas[0].base_url, "--out", str(profile), *SERVE_BOUND)
        else:
            procs = [subprocess.Popen([sys.executable, "-m", "tokenmill.cli", "sim", "calibrate", "--base-url",
                                       r.base_url, "--out", str(profile if i == 0 else out / f"profile{i}.json"),
                                       *SERVE_BOUND],
                                      stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
                     for i, r in enumerate(replicas)]
            for pr in procs:
                _, err = pr.communicate(timeout=1800)
                if pr.returncode != 0:
                    raise RuntimeError(f"tokenmill sim calibrate failed: {err[-2000:]}")
        for r in replicas:
            httpx.post(r.base_url + "/flush_cache", timeout=30).raise_for_status()
        route = ["route", "--policy", args.policy, "--seed", str(args.seed)]
        for r in replicas:
            route += ["--replica", r.base_url]
        with ServiceProcess(route, log_path=out / "router.log") as router:
            tm("bench", "--base-url", router.base_url, "--concurrency", str(args.concurrency),
               "--sessions", str(10**6), "--duration", str(args.duration), "--warmup", str(args.warmup),
               "--seed", str(args.seed), "--no-progress", "--out", str(out / "bench"), "--workload", "agentic",
               *WORKLOAD)
    finally:
        for r in replicas:
            r.stop()
    p = tm("sim", "--profile", str(profile), "--replicas", str(args.replicas), "--sessions", str(args.concurrency),
           "--policy", args.policy, "--duration", str(args.duration), "--warmup", str(args.warmup),
           "--workload", "small", "--start", "cold", "--start-spread", "0", "--seed", str(args.seed),
           "--no-progress", "--json", "--out", str(out / "sim"), *WORKLOAD)
    sim = json.loads(p.stdout)
    real = json.loads((out / "bench" / "results.json").read_text())["runs"][0]
    rows = []
    print(f"{'metric':16s} {'real':>10s} {'sim':>10s} {'sim/real':>9s}")
    for label, bkey, spath in METRICS:
        rv = real.get(bkey)
        sv: object = sim
        for k in spath:
            sv = sv[k]  # type: ignore[index]
        ratio = (sv / rv) if isinstance(rv, (int, float)) and rv else None  # type: ignore[operator]
        rows.append({"metric": label, "real": rv, "sim": sv, "sim_over_real": ratio})
        print(f"{label:16s} {rv if rv is not None else float('nan'):10.4g} {sv:10.4g} "
              f"{ratio if ratio is not None else float('nan'):9.2f}")
    (out / "comparison.json").write_text(json.dumps({"rows": rows, "args": vars(args), "workload": WORKLOAD,
                                                     "profile": json.loads(profile.read_text())}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
