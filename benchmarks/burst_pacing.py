"""A burst of requests sent whole against the same burst streamed: what the prefill bound costs.

One engine (the default model, serve's defaults: ``--decode-slowdown 1.75``), one process. Each
round runs the same kind of burst in each mode: every request ``streamed`` (the server's
``"stream": true``: their decodes bound the prefill beside them), none streamed (``"stream":
false``: the step is left to throughput), and ``mixed``: the first request streamed and the
rest sent whole (does the stream keep its pace among them?). The order is reversed every other
round so a change of load hits every mode alike. A burst is ``--requests`` requests of ``--prompt`` random prompt
tokens (unique per request and round, so no prefix-cache hits) and ``--output`` greedy tokens
(``ignore_eos``), all queued at once, as ``benchmarks/quant_vs_llamacpp.py``'s 16-request burst.

Prints per mode the median wall time, total tok/s ((prompt + output) / wall), mean completion
time of a request, mean TPOT (time between its first and last token / (output - 1)) of all
requests and of the streamed ones, the steps, and the ratio of the sent-whole and streamed
modes' throughput.

    .venv/bin/python benchmarks/burst_pacing.py [--threads 2] [--rounds 4] [--requests 16]
"""
from __future__ import annotations

import argparse
import math
import random
import statistics
import time


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--output", type=int, default=64)
    ap.add_argument("--model", default=None, help="model (default: the bundled default model)")
    args = ap.parse_args(argv)
    if min(args.threads, args.rounds, args.requests, args.prompt) < 1 or args.output < 2:
        ap.error("--threads, --rounds, --requests, --prompt must be >= 1 and --output >= 2")

    from tokenmill.contracts.sampling import SamplingParams
    from tokenmill.engine.config import EngineConfig
    from tokenmill.engine.engine import Engine

    kw = {"num_threads": args.threads, "kv_cache_tokens": args.requests * (args.prompt + args.output) + 4096}
    if args.model:
        kw["model"] = args.model
    engine = Engine(EngineConfig(**kw))
    vocab = engine.vocab_size
    params = SamplingParams(max_tokens=args.output, temperature=0, ignore_eos=True)

    def burst(seed: int, mode: str) -> dict[str, float]:
        rnd = random.Random(seed)
        t0 = time.perf_counter()
        ids = [f"r{seed}-{i}" for i in range(args.requests)]
        streams = set(ids if mode == "streamed" else ids[:1] if mode == "mixed" else [])
        for rid in ids:
            prompt = [rnd.randrange(100, vocab) for _ in range(args.prompt)]
            engine.add_request(rid, prompt, params, streamed=rid in streams)
        first: dict[str, float] = {}
        done: dict[str, float] = {}
        steps = 0
        while len(done) < len(ids):
            outs = engine.step()
            steps += 1
            now = time.perf_counter() - t0
            for o in outs:
                if o.new_token_ids and o.request_id not in first:
                    first[o.request_id] = now
                if o.finished:
                    done[o.request_id] = now
        wall = time.perf_counter() - t0
        tpot = {r: (done[r] - first[r]) / (args.output - 1) for r in ids}
        return {"wall": wall, "tok_s": args.requests * (args.prompt + args.output) / wall,
                "completion": statistics.fmean(done.values()), "tpot": statistics.fmean(tpot.values()),
                "stream_tpot": statistics.fmean(tpot[r] for r in streams) if streams else math.nan,
                "steps": steps}

    burst(10_000, "streamed")   # warm-up: the step-cost fits, the kernels
    modes = ["streamed", "whole", "mixed"]
    results: dict[str, list[dict[str, float]]] = {m: [] for m in modes}
    for r in range(args.rounds):
        order = list(modes) if r % 2 == 0 else list(reversed(modes))
        for m in order:
            res = burst(len(modes) * r + modes.index(m), m)
            results[m].append(res)
            print(f"round {r} {m:8s}: {res['wall']:.2f} s, {res['tok_s']:.1f} total tok/s, mean completion "
                  f"{res['completion']:.2f} s, mean TPOT {1000 * res['tpot']:.1f} ms (streamed "
                  f"{1000 * res['stream_tpot']:.1f}), {res['steps']} steps", flush=True)
    med = {m: {k: statistics.median(x[k] for x in results[m]) for k in results[m][0]} for m in modes}
    print(f"\n{args.requests} x {args.prompt}/{args.output}, {args.threads} threads, medians of {args.rounds} rounds:")
    print("| requests | wall (s) | total tok/s | mean completion (s) | mean TPOT (ms) | streamed TPOT (ms) | steps |")
    print("|---|---|---|---|---|---|---|")
    for m in modes:
        x = med[m]
        stream_tpot = "" if math.isnan(x["stream_tpot"]) else f"{1000 * x['stream_tpot']:.1f}"
        print(f"| {m} | {x['wall']:.2f} | {x['tok_s']:.1f} | {x['completion']:.2f} | {1000 * x['tpot']:.1f} "
              f"| {stream_tpot} | {x['steps']:.0f} |")
    print(f"whole / streamed total tok/s: {med['whole']['tok_s'] / med['streamed']['tok_s']:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
