"""The integer kernels' row limit end to end: the same engine workload with two limits, in one
process, taking turns.

Two engines on the default model's bundled Q4_1 GGUF (``--quantization auto``), one built and
run under ``packed.set_gemv_max_rows(A)`` and one under ``B`` (``--limits 16,auto``: 16 rows, the
limit before it was set per kernel set, against ``packed.gemv_max_rows()``'s own value). Each
runs a burst of ``--requests`` requests of ``--prompt`` random prompt tokens (unique per request,
so no prefix-cache hits) and ``--output`` greedy output tokens, with serve's settings of
``benchmarks/quant_vs_llamacpp.py`` (512-token step budget, the step-time prefill bound on). The
engines alternate for ``--rounds`` rounds (the order reversed every other round) so a change of
load hits both alike. Prints per limit the median total tok/s (prompt + output over the burst's
wall time), output tok/s, the steps by kind and their mean time, and the ratio.

    .venv/bin/python benchmarks/quant_rows_limit_ab.py [--threads 1] [--rounds 4] [--limits 16,auto]
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import torch


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--output", type=int, default=64)
    ap.add_argument("--limits", default="16,auto", help="two row limits: integers or 'auto' (the per-kernel value)")
    args = ap.parse_args(argv)

    from tokenmill._native import quant as native
    from tokenmill.contracts.sampling import SamplingParams
    from tokenmill.engine.config import EngineConfig
    from tokenmill.engine.engine import Engine
    from tokenmill.layers.quant import packed

    torch.set_num_threads(args.threads)
    limits: list[int | None] = [None if v == "auto" else int(v) for v in args.limits.split(",")]
    if len(limits) != 2:
        ap.error("--limits takes two values")
    engines = {}
    for lim in limits:
        packed.set_gemv_max_rows(lim)
        cfg = EngineConfig(quantization="auto", num_threads=args.threads, max_running_requests=args.requests,
                           kv_cache_tokens=args.requests * 1024, max_batch_tokens=512)
        engines[lim] = (Engine(cfg), packed.gemv_max_rows())
    packed.set_gemv_max_rows(None)
    name = {lim: f"limit {rows}" + (" (auto)" if lim is None else "") for lim, (_, rows) in engines.items()}
    print(f"load average at start {os.getloadavg()}; {args.threads} thread(s); kernel set {native.kernel()}; "
          f"{args.requests} x {args.prompt}/{args.output}; engines: {', '.join(name.values())}")
    gen = torch.Generator().manual_seed(0)
    params = SamplingParams(max_tokens=args.output, temperature=0.0, ignore_eos=True)
    res: dict[int | None, list[tuple[float, float]]] = {lim: [] for lim in limits}
    kinds: dict[int | None, dict[str, list[float]]] = {lim: {} for lim in limits}
    counter = 0
    for r in range(args.rounds + 1):   # round 0 warms both engines up and is not counted
        for lim in (limits if r % 2 == 0 else limits[::-1]):
            engine, rows = engines[lim]
            packed.set_gemv_max_rows(lim)
            before = {k: (v[1], v[2]) for k, v in engine.stats().step_seconds.items()}
            for _ in range(args.requests):
                counter += 1
                ids = torch.randint(100, 40000, (args.prompt,), generator=gen).tolist()
                engine.add_request(f"r{counter}", ids, params)
            t = time.perf_counter()
            while engine.has_unfinished_requests():
                engine.step()
            wall = time.perf_counter() - t
            if r == 0:
                continue
            res[lim].append((args.requests * (args.prompt + args.output) / wall, args.requests * args.output / wall))
            for k, (_, total, count) in engine.stats().step_seconds.items():
                t0, c0 = before.get(k, (0.0, 0))
                kinds[lim].setdefault(k, []).append((total - t0, count - c0))  # type: ignore[arg-type]
            print(f"  round {r} {name[lim]}: {res[lim][-1][0]:.0f} total tok/s in {wall:.1f} s "
                  f"(load {os.getloadavg()[0]:.2f})")
    packed.set_gemv_max_rows(None)
    print("\n| row limit | total tok/s (median) | each round | output tok/s | steps by kind: count, mean ms |")
    print("|---|---|---|---|---|")
    med = {}
    for lim in limits:
        med[lim] = statistics.median(t for t, _ in res[lim])
        steps = ", ".join(f"{k} {sum(c for _, c in v) / len(v):.0f} x {1e3 * sum(s for s, _ in v) / max(1, sum(c for _, c in v)):.1f}"
                          for k, v in sorted(kinds[lim].items()))
        print(f"| {name[lim]} | {med[lim]:.0f} | {', '.join(f'{t:.0f}' for t, _ in res[lim])} | "
              f"{statistics.median(o for _, o in res[lim]):.1f} | {steps} |")
    a, b = limits
    print(f"\n{name[b]} / {name[a]} total tok/s: {med[b] / med[a]:.3f}x")
    print(f"load average at end {os.getloadavg()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
