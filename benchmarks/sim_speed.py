"""Speed of the fleet simulator: one simulated hour of 50 replicas and 250 agent sessions.

The issue's bar: under 60 s on this machine. Prints, per policy, the wall time, the CPU time of
this process (the machine is shared, so wall time includes waiting for a core), the requests
simulated and the load average seen, then a JSON line per policy.

    .venv/bin/python benchmarks/sim_speed.py [--duration 1h] [--policies session_hash,agentic,random]
"""
from __future__ import annotations

import argparse
import json
import os
import time

from tokenmill.workload import AgenticWorkloadConfig
from tokenmill.sim.config import SimConfig, parse_duration
from tokenmill.sim.fleet import FleetSimulator
from tokenmill.sim.profiles import get_preset


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--duration", default="1h")
    ap.add_argument("--replicas", type=int, default=50)
    ap.add_argument("--sessions", type=int, default=250)
    ap.add_argument("--policies", default="session_hash,agentic,random")
    ap.add_argument("--profile", default="kimi-k2.6-b200-tp4")
    args = ap.parse_args()
    duration = parse_duration(args.duration)
    # the `tokenmill sim` default workload: production shape, 5-30 turns, 10% thick x4
    wl = AgenticWorkloadConfig.production(num_sessions=args.sessions, min_turns_per_session=5,
                                          thick_session_fraction=0.1, thick_session_parallel=4)
    print(f"{args.replicas} replicas, {args.sessions} sessions, {duration:.0f} simulated s, profile {args.profile}, "
          f"cpus {os.cpu_count()}")
    for policy in args.policies.split(","):
        cfg = SimConfig(replicas=args.replicas, profile=get_preset(args.profile), policy=policy,
                        duration_s=duration, sessions=args.sessions, workload=wl, warmup_s=60.0)
        load0 = os.getloadavg()[0]
        w0, c0 = time.perf_counter(), time.process_time()
        out = FleetSimulator(cfg).run()
        wall, cpu = time.perf_counter() - w0, time.process_time() - c0
        load1 = os.getloadavg()[0]
        reqs = out["requests_finished"]
        print(f"{policy:13s} wall {wall:6.1f} s  cpu {cpu:6.1f} s  {reqs} requests ({reqs / cpu:,.0f}/cpu-s)  "
              f"loadavg {load0:.1f}->{load1:.1f}  in-flight var/mean {out['load']['inflight']['var_over_mean']:.2f}  "
              f"CHR {out['chr']:.3f}")
        print(json.dumps({"policy": policy, "wall_s": round(wall, 2), "cpu_s": round(cpu, 2), "requests": reqs,
                          "simulated_s": duration, "loadavg_before": load0, "loadavg_after": load1}))


if __name__ == "__main__":
    main()
