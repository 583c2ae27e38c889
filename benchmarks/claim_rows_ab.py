"""Matmul rows claimed as the threads go against rows split evenly up front, in the fused decode
step (decoder.c: ``matmul_claiming`` against ``TOKENMILL_STATIC_ROWS=1``), in one process.

Loads the default model (Q4_1 GGUF, ``--quantization auto``) in the offline engine with
``--threads`` threads and decodes ``--tokens`` greedy tokens for batches of ``--batch`` requests
(short distinct prompts), the two modes alternating round by round (the order reversed every other
round), so a change of load hits both alike. Decode tok/s = output tokens after each request's
first / wall time of the steps after the prefill step. With ``--neighbour N``, N busy-loop
processes run beside the whole measurement: the case the claiming is for, where another process
(the server's HTTP client, a noisy neighbour) takes a core from the thread team for a while.
Prints per-round rates, the medians and claimed / static.

    .venv/bin/python benchmarks/claim_rows_ab.py [--threads 2] [--rounds 6] [--tokens 128] [--batch 1,4]
        [--neighbour 0]
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from peers import default_gguf  # noqa: E402


def decode_rate(llm, batch: int, tokens: int, tag: str) -> float:
    from tokenmill.engine.sampling_params import SamplingParams

    eng = llm.engine
    params = SamplingParams(max_tokens=tokens + 1, temperature=0.0, ignore_eos=True)
    for i in range(batch):
        eng.add_request(f"{tag}-{i}", [1000 + 7 * i + j for j in range(24)], params)
    eng.step()   # the prefill (and each request's first token)
    t0 = time.perf_counter()
    while eng.has_unfinished_requests():
        eng.step()
    return batch * tokens / (time.perf_counter() - t0)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--batch", default="1,4")
    ap.add_argument("--neighbour", type=int, default=0, help="busy-loop processes beside the run")
    args = ap.parse_args(argv)
    from tokenmill.engine.llm import LLM

    batches = [int(b) for b in args.batch.split(",")]
    llm = LLM(str(default_gguf()), num_threads=args.threads, enable_prefix_cache=False)
    decode_rate(llm, 1, 8, "warm")
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.neighbour)]
    rates: dict[tuple[str, int], list[float]] = {}
    try:
        print(f"load average at start {os.getloadavg()[0]:.2f}; {args.threads} thread(s), {args.neighbour} "
              f"busy-loop neighbour(s), {args.tokens} tokens per request", flush=True)
        for r in range(args.rounds):
            modes = ("claimed", "static") if r % 2 == 0 else ("static", "claimed")
            for mode in modes:
                os.environ["TOKENMILL_STATIC_ROWS"] = "1" if mode == "static" else ""
                for b in batches:
                    rate = decode_rate(llm, b, args.tokens, f"r{r}-{mode}-{b}")
                    rates.setdefault((mode, b), []).append(rate)
            print(f"round {r + 1}: " + ", ".join(f"{m} b={b} {rates[(m, b)][-1]:.1f}" for m in ("claimed", "static")
                                                    for b in batches), flush=True)
    finally:
        for h in hogs:
            h.kill()
        os.environ.pop("TOKENMILL_STATIC_ROWS", None)
    print("\n| batch | claimed tok/s | static tok/s | claimed / static | paired (median of rounds) |")
    print("|---|---|---|---|---|")
    for b in batches:
        c, s = rates[("claimed", b)], rates[("static", b)]
        paired = statistics.median(x / y for x, y in zip(c, s))
        print(f"| {b} | {statistics.median(c):.1f} | {statistics.median(s):.1f} | "
              f"{statistics.median(c) / statistics.median(s):.3f}x | {paired:.3f}x |")
    print(f"load average at end {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
