"""The agentic router policy on a fleet with a shared L3 cache tier, against session_hash.

Each cell runs ``tokenmill sim`` (the same argument parser and config builder, in process) with
``--autoscale-target 5`` on the ``kimi-k2.6-b200-tp4-l3`` profile (HBM + host tier per replica,
one storage tier shared by the fleet) for several fleet sizes and session counts, and prints,
per cell and policy, in-flight var/mean and CHR, with the issue's aims:

* in-flight variance / mean below 0.5;
* CHR no more than 2 points below session_hash's.

Policies: ``session_hash``; ``agentic`` with its defaults (tuned for fleets without L3);
``agentic`` with ``shared_cache=true shared_move_margin=2`` (the re-tune for a fleet with L3).

    .venv/bin/python benchmarks/sim_tiers.py
    .venv/bin/python benchmarks/sim_tiers.py --cells 10:57,50:288 --duration 10m
"""
from __future__ import annotations

import argparse
import sys

from tokenmill.sim.cli import add_arguments, build_config
from tokenmill.sim.fleet import simulate

POLICIES = (
    ("session_hash", ["--policy", "session_hash"]),
    ("agentic", ["--policy", "agentic"]),
    ("agentic+L3", ["--policy", "agentic", "--policy-opt", "shared_cache=true",
                    "--policy-opt", "shared_move_margin=2"]),
)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cells", default="10:57,20:115,50:288",
                    help="comma list of REPLICAS:SESSIONS (default: ~5.75 sessions per replica at 3 fleet sizes)")
    ap.add_argument("--duration", default="20m")
    ap.add_argument("--profile", default="kimi-k2.6-b200-tp4-l3")
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args(argv)
    rows = []
    for cell in args.cells.split(","):
        replicas, sessions = (int(x) for x in cell.split(":"))
        res = {}
        for name, extra in POLICIES:
            sim_argv = ["--replicas", str(replicas), "--sessions", str(sessions), "--autoscale-target", "5",
                        "--duration", args.duration, "--profile", args.profile, "--seed", str(args.seed),
                        "--no-progress", *extra]
            p = argparse.ArgumentParser()
            add_arguments(p)
            summary = dict(simulate(build_config(p.parse_args(sim_argv))))
            res[name] = summary
            print(f"  tokenmill sim {' '.join(sim_argv)}  ({summary['sim_wall_s']:.1f} s)", file=sys.stderr, flush=True)
        base = res["session_hash"]["chr"]
        for name, _ in POLICIES:
            s = res[name]
            inf = s["load"]["inflight"]
            l3 = s.get("tiers", {}).get("hit_tokens", {}).get("l3", 0)
            prompt = s["throughput"].get("prompt_tokens_per_s", 0)
            rows.append((replicas, sessions, name, inf["mean"], inf["var_over_mean"], s["chr"],
                         100 * (s["chr"] - base), s["ttft_s"]["p50"], s["ttft_s"]["p99"], s["replicas_final"], l3))
    print(f"{'fleet':>6} {'sessions':>8} {'policy':<14}{'inflight':>9}{'var/mean':>9}{'CHR':>7}{'vs hash':>9}"
          f"{'TTFT p50':>9}{'p99':>7}{'final':>6}  aims")
    for r in rows:
        aims = "" if r[2] == "session_hash" else (
            f"var/mean<0.5 {'met' if r[4] < 0.5 else 'NOT met'}; CHR>=-2pt {'met' if r[6] >= -2 else 'NOT met'}")
        print(f"{r[0]:>6} {r[1]:>8} {r[2]:<14}{r[3]:>9.2f}{r[4]:>9.2f}{r[5]:>7.3f}{r[6]:>+8.1f}p"
              f"{r[7]:>9.3f}{r[8]:>7.2f}{r[9]:>6}  {aims}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
