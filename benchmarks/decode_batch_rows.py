"""What a decode step of several sequences costs against one sequence's: the floor under the
Mooncake decode-stall aim (benchmarks/decode_stall.py), where a stream decoding beside 3 others
can be no faster than a decode-only step of their rows, before any prefill joins it.

The offline engine (chains off, so every step is one forward) decodes ``--tokens`` greedy tokens
for B sequences of ``--context`` random prompt tokens each, for every B in ``--batches``, and
reports the mean wall time of the decode-only steps (the engine's own step timer) and its ratio
to B = 1. ``--env-ab NAME=VALUE`` also times every B with that environment switch set (the native
kernels read theirs at each call), in the same rounds, and prints the ratio per B. With ``--profile`` it also splits the native fused step by phase
(``tokenmill._native.quant.decode_profile``: thread 0's wall time in each). Rounds interleave the
batch sizes, and the median round is reported.

    .venv/bin/python benchmarks/decode_batch_rows.py [--quantization auto|none] [--batches 1,2,3,4,8]
        [--context 400] [--rounds 3] [--profile] [--env-ab TOKENMILL_QUAD_ROWS_MAX=1]
"""
from __future__ import annotations

import argparse
import os
import random
import statistics

from tokenmill._native import quant as native
from tokenmill.contracts.sampling import SamplingParams
from tokenmill.engine.llm import LLM


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--quantization", default="auto", help="auto (the GGUF's Q4_1 blocks) or none (fp32)")
    ap.add_argument("--batches", default="1,2,3,4,8")
    ap.add_argument("--context", type=int, default=400, help="prompt tokens per sequence (the Mooncake "
                    "trace at --block-tokens 16 averages about 400)")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--env-ab", default=None, metavar="NAME=VALUE",
                    help="also time each batch size with this environment variable set, in the same rounds")
    args = ap.parse_args()
    settings: list[tuple[str, dict[str, str]]] = [("default", {})]
    if args.env_ab:
        name, _, value = args.env_ab.partition("=")
        settings.append((args.env_ab, {name: value}))
    batches = [int(b) for b in args.batches.split(",")]
    llm = LLM(args.model, quantization=args.quantization, num_threads=args.threads, num_continuous_decode_steps=1)
    eng = llm.engine
    rng = random.Random(0)
    vocab = int(eng.runner.model.args.vocab_size)
    times: dict[tuple[str, int], list[float]] = {(lab, b): [] for lab, _ in settings for b in batches}
    phases: dict[tuple[str, int], list[dict[str, float]]] = {k: [] for k in times}
    print(f"load average {os.getloadavg()[0]:.2f}; {args.model}, weights {args.quantization}, "
          f"{args.threads} thread(s), context {args.context}", flush=True)
    for rnd in range(args.rounds):
        for b in batches:
            prompts = [[rng.randrange(100, vocab) for _ in range(args.context)] for _ in range(b)]
            order = settings if rnd % 2 == 0 else settings[::-1]
            for lab, env in order:
                saved = {k: os.environ.get(k) for k in env}
                os.environ.update(env)
                try:
                    # the prompts' prefill and first token first, so that only decode steps are timed
                    llm.generate(prompts, SamplingParams(max_tokens=1, temperature=0.0))
                    snap0 = eng.step_times.snapshot()
                    s0 = snap0["decode"]
                    if args.profile:
                        native.decode_profile(True)
                    llm.generate(prompts, SamplingParams(max_tokens=args.tokens + 1, temperature=0.0, ignore_eos=True))
                    snap1 = eng.step_times.snapshot()
                    s1 = snap1["decode"]
                finally:
                    for k, v in saved.items():
                        if v is None:
                            os.environ.pop(k, None)
                        else:
                            os.environ[k] = v
                n = s1[2] - s0[2]
                if args.profile:   # per step of any kind: the prompts' last tokens come back as a 1-row prefill
                    steps = sum(snap1[k][2] - snap0[k][2] for k in snap1)
                    phases[lab, b].append({k: v / steps for k, v in native.decode_profile(False).items() if v})
                times[lab, b].append((s1[1] - s0[1]) / n)
        print(f"round {rnd + 1}: " + "; ".join(
            f"{lab}: " + ", ".join(f"B={b} {times[lab, b][-1] * 1e3:.2f} ms" for b in batches) for lab, _ in settings),
            flush=True)
    for lab, _ in settings:
        base = statistics.median(times[lab, batches[0]])
        print(f"\n{lab}:\n| sequences | decode step (median of rounds) | / {batches[0]} sequence(s) | tok/s |")
        print("|---|---|---|---|")
        for b in batches:
            med = statistics.median(times[lab, b])
            print(f"| {b} | {med * 1e3:.2f} ms | {med / base:.2f}x | {b / med:.0f} |")
    if len(settings) > 1:
        ab = settings[1][0]
        print(f"\ndefault / {ab}, per batch size (medians of the per-round ratios): " + ", ".join(
            f"B={b} {statistics.median(x / y for x, y in zip(times['default', b], times[ab, b])):.3f}x" for b in batches))
    if args.profile:
        print("\nphases of the fused step (ms per step, median round; thread 0's wall time):")
        for lab, _ in settings:
            for b in batches:
                runs = phases[lab, b]
                if runs:
                    keys = runs[0].keys()
                    print(f"{lab} B={b}: " + " ".join(
                        f"{k}={statistics.median(r.get(k, 0.0) for r in runs) * 1e3:.2f}" for k in keys))
    print(f"load average at the end {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
