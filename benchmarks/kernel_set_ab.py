"""The quantized kernel sets against each other in the offline engine, in one process.

Loads the default model (Q4_1 GGUF) with ``--threads`` threads and, for each kernel set of
``--kernels`` (default: every set this CPU runs), decodes ``--tokens`` greedy tokens for batches of
``--batch`` requests and prefills one ``--prefill``-token prompt, the sets taking turns round by
round (the order reversed every other round), so a change of load hits all alike. The kernel set
is switched with ``tokenmill._native.quant.set_kernel``; everything that follows from it (the
integer kernels' row limit, the dequantizer of the prefill path) follows as it would in a server
started on that set. Prints per-round rates, the medians, and each set against the first.

    .venv/bin/python benchmarks/kernel_set_ab.py [--kernels avx512vnni,avx2] [--threads 2] [--rounds 6]
        [--tokens 96] [--batch 1,2,4,8] [--prefill 1000]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from claim_rows_ab import decode_rate  # noqa: E402
from peers import default_gguf  # noqa: E402


def prefill_rate(llm, n: int, tag: str) -> float:
    from tokenmill.engine.sampling_params import SamplingParams

    eng = llm.engine
    eng.add_request(tag, [300 + (hash(tag) + 13 * j) % 40000 for j in range(n)],
                    SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
    t0 = time.perf_counter()
    while eng.has_unfinished_requests():
        eng.step()
    return n / (time.perf_counter() - t0)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kernels", default=None, help="comma-separated kernel sets (default: every supported one)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--batch", default="1,2,4,8")
    ap.add_argument("--prefill", type=int, default=1000, help="prompt tokens of the prefill measurement (0: none)")
    args = ap.parse_args(argv)
    from tokenmill._native import quant as native
    from tokenmill.engine.llm import LLM

    sets = args.kernels.split(",") if args.kernels else [k for k in native.supported_kernels() if k != "scalar"]
    batches = [int(b) for b in args.batch.split(",")]
    llm = LLM(str(default_gguf()), num_threads=args.threads, enable_prefix_cache=False,
              max_batch_tokens=max(512, args.prefill))
    first = native.kernel()
    for k in sets:
        native.set_kernel(k)
        decode_rate(llm, 1, 8, f"warm-{k}")
    cols = [f"b={b}" for b in batches] + ([f"prefill {args.prefill}"] if args.prefill else [])
    rates: dict[tuple[str, str], list[float]] = {}
    print(f"load average at start {os.getloadavg()[0]:.2f}; {args.threads} thread(s); sets {sets} "
          f"(the CPU's default: {first}); {args.tokens} tokens per request", flush=True)
    try:
        for r in range(args.rounds):
            for k in (sets if r % 2 == 0 else sets[::-1]):
                native.set_kernel(k)
                for b in batches:
                    rates.setdefault((k, f"b={b}"), []).append(decode_rate(llm, b, args.tokens, f"r{r}-{k}-{b}"))
                if args.prefill:
                    rates.setdefault((k, cols[-1]), []).append(prefill_rate(llm, args.prefill, f"r{r}-{k}-p"))
            print(f"round {r + 1}: " + "; ".join(f"{k} " + ", ".join(f"{c} {rates[(k, c)][-1]:.1f}" for c in cols)
                                                 for k in sets), flush=True)
    finally:
        native.set_kernel(first)
    print("\ntok/s, medians over rounds; in brackets: against " + sets[0] + " (median of the per-round ratios)")
    print("| set | " + " | ".join(cols) + " |")
    print("|---|" + "---|" * len(cols))
    for k in sets:
        cells = []
        for c in cols:
            med = statistics.median(rates[(k, c)])
            paired = statistics.median(x / y for x, y in zip(rates[(k, c)], rates[(sets[0], c)]))
            cells.append(f"{med:.1f} ({paired:.3f}x)")
        print(f"| {k} | " + " | ".join(cells) + " |")
    print(f"load average at end {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
