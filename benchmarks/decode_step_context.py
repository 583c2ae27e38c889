"""One single-stream decode step against context length, without the long prefill.

``benchmarks/long_context.py`` measures the served rate, but every 16k point first costs a 16k
prefill (one to three minutes per system on a 2-core machine). This script times the model
forward of one decode row after ``L`` cached tokens on a scratch KV pool of the engine's own
attention backend (``ModelRunner.time_rows``: the same forward the engine runs for a decode
step, fused decode included, minus the scheduler and sampling), for each context length in
turn and over several interleaved rounds, and prints each length's step time relative to the
shortest one: the ratio the 16k >= 0.7x-of-512 aim of issue 18 is about. The pool holds zeros;
the cost of a step does not depend on the values.

    .venv/bin/python benchmarks/decode_step_context.py --contexts 512,16384 --kv-cache-dtype fp8_e4m3 --threads 1
    .venv/bin/python benchmarks/decode_step_context.py --quantization auto      # the Q4_1 GGUF's weights
    .venv/bin/python benchmarks/decode_step_context.py --quantization auto --kv-cache-dtype auto,fp32,bf16

``--kv-cache-dtype`` takes a comma-separated list: each dtype gets its own scratch pool and runner
in this process, and every round times every length on each in turn (``auto`` resolves as the
engine resolves it, fp16 for packed weights).

Kernel switches that the native attention kernel reads at each call (``TOKENMILL_NO_AVX512``,
``TOKENMILL_NO_DECODE_BODY``, ``TOKENMILL_TILES_FOR_FEW_ROWS``) can be compared in one process with
``--env-ab NAME``: every round then times each length without and with ``NAME=1``. A setting may
give values and join several switches (``--env-ab TOKENMILL_KV_PREFETCH=1+TOKENMILL_KV_HEADS_APART=1``),
and ``--env-ab`` may be repeated: each setting is timed against the default in every round.

``--rows 1,2,4`` times steps of that many new tokens of the one sequence instead (a speculative
verify step's shape, logits for every row), each at each context:

    .venv/bin/python benchmarks/decode_step_context.py --quantization auto --kv-cache-dtype auto --threads 2 \
        --rows 1,2,3,5 --contexts 128,1024 --env-ab TOKENMILL_TILES_FOR_FEW_ROWS
"""
from __future__ import annotations

import argparse
import os
import statistics

import torch

from tokenmill.engine.config import resolve_kv_dtype
from tokenmill.engine.model_runner import ModelRunner
from tokenmill.layers.quant.methods import packed_weights
from tokenmill.loader import load_model


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--quantization", default="none", help="weight format (none = fp32, auto = as stored)")
    ap.add_argument("--contexts", default="512,4096,16384")
    ap.add_argument("--kv-cache-dtype", default="fp8_e4m3",
                    help="as `tokenmill serve --kv-cache-dtype`, or several, comma-separated")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=5, help="timed forwards per length and round (best is kept)")
    ap.add_argument("--env-ab", action="append", default=None,
                    help="a kernel switch to time off and on in every round: NAME (set to 1), NAME=VALUE, "
                         "or several joined by + (A=1+B=0); repeat it to time several settings against the default")
    ap.add_argument("--rows", default="1", help="new tokens per step (comma-separated: each is timed)")
    args = ap.parse_args()

    torch.set_num_threads(args.threads)
    rows = [int(r) for r in args.rows.split(",")]
    ctxs = [int(c) for c in args.contexts.split(",")]
    # the points timed: (rows, context), labelled by the context alone for one-row steps
    points = [(m, c) for m in rows for c in ctxs]
    pname = {p: (str(p[1]) if rows == [1] else f"{p[0]} rows @ {p[1]}") for p in points}
    lm = load_model(args.model, quantization=args.quantization)
    model = lm.model
    base_spec = model.kv_cache_spec()
    runners = {}
    for name in args.kv_cache_dtype.split(","):
        spec = base_spec.with_dtype(resolve_kv_dtype(name, base_spec.dtype, packed_weights(model)))
        runners[f"{name} ({spec.dtype})"] = runner = ModelRunner(model, 8, 16, int(model.args.vocab_size), kv_spec=spec)
        print(f"load average {os.getloadavg()[0]:.2f}; {args.model} weights {args.quantization}, KV {name}: "
              f"{spec.dtype}, {args.threads} thread(s), attention backend {runner.attn.name}")
    switches = [None, *(args.env_ab or [])]
    modes = [(kv, sw) for kv in runners for sw in switches]
    label = {m: " ".join(x for x in ((m[0] if len(runners) > 1 else ""), ((m[1] or "default") if args.env_ab else ""))
                         if x) for m in modes}
    times: dict[tuple[tuple[str, str | None], tuple[int, int]], list[float]] = {
        (m, p): [] for m in modes for p in points}
    for rnd in range(args.rounds):
        line = []
        for mode in modes:
            kv, switch = mode
            setting = dict((a.partition("=")[0], a.partition("=")[2] or "1") for a in switch.split("+")) if switch else {}
            os.environ.update(setting)
            try:
                for p in points:
                    ms = runners[kv].time_rows(p[0], context=p[1], repeats=args.repeats) * 1e3
                    times[(mode, p)].append(ms)
                    line.append(f"{label[mode] + ' ' if label[mode] else ''}{pname[p]}: {ms:.2f} ms")
            finally:
                for name in setting:
                    os.environ.pop(name, None)
        print(f"round {rnd + 1}: " + ", ".join(line), flush=True)
    print(f"\n| KV / switch | {'context' if rows == [1] else 'rows @ context'} | step ms (median of rounds) | "
          f"tok/s | rate / rate at {pname[points[0]]} | rate / first row's at this point |")
    print("|---|---|---|---|---|---|")
    for mode in modes:
        base = statistics.median(times[(mode, points[0])])
        for p in points:
            med = statistics.median(times[(mode, p)])
            first = statistics.median(times[(modes[0], p)])
            print(f"| {label[mode] or 'default'} | {pname[p]} | {med:.2f} | {1e3 * p[0] / med:.1f} | "
                  f"{base * p[0] / med:.2f}x | {first / med:.2f}x |")
    print(f"load average at the end {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
