"""The fused decode path against the layer-by-layer path, in one process, on the default model.

One engine, ``--batch`` requests at a time (default 1; decode steps of that many rows): a
``--context``-token prompt each, then ``--tokens`` greedy decode steps, with the model's fused decode stack on or off (``model.set_fused_decode``), the two taking
turns for ``--rounds`` rounds after one unmeasured round each. Reports the median decode step
(engine ``step()`` wall time, the first two steps of each request left out) per setting, the
fastest round's median, the ratio, and whether both produced the same tokens. Prefill steps are
not timed (both settings run them through the same GEMM).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/fused_decode_ab.py --quantization none --threads 1
    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/fused_decode_ab.py --quantization none --threads 2 --contexts 512,4096
    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/fused_decode_ab.py --quantization none --threads 2 --batch 8
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/fused_decode_ab.py --kv-cache-dtype fp8_e4m3 --contexts 512,4096
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import torch


def _decode_ms(engine, prompt: list[int], tokens: int, fused: bool, batch: int) -> tuple[float, list[int]]:
    """Median decode step (ms) of ``batch`` requests decoding together, and the first one's tokens."""
    from tokenmill import SamplingParams

    engine.runner.model.set_fused_decode(fused)
    ids = [f"ab-{time.perf_counter_ns()}-{b}" for b in range(batch)]
    for b, rid in enumerate(ids):   # distinct last tokens: every request decodes its own row
        engine.add_request(rid, prompt[:-1] + [prompt[-1] + b],
                           SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True))
    rows: list[int] = []   # rows of each forward, -1 where a request prefilled
    execute = engine.runner.execute

    def counting(so, _execute=execute):
        rows.append(so.num_tokens if all(s.num_tokens == 1 for s in so.scheduled) else -1)
        return _execute(so)

    engine.runner.execute = counting
    steps, out = [], None
    try:
        while engine.has_unfinished_requests():
            n = len(rows)
            t = time.perf_counter()
            outs = engine.step()
            dt = time.perf_counter() - t
            for o in outs:
                if o.finished and o.request_id == ids[0]:
                    out = list(o.token_ids)
            if len(rows) == n + 1 and rows[-1] == batch:
                steps.append(dt)   # a decode step of every request, nothing else
    finally:
        engine.runner.execute = execute
    engine.flush_cache()
    if len(steps) < 3:
        raise SystemExit(f"only {len(steps)} decode steps of {batch} rows were seen (raise --tokens)")
    return statistics.median(steps[1:]) * 1e3, out or []


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--quantization", default="none", help="none (fp32 weights) or auto (the GGUF's Q4_1)")
    ap.add_argument("--threads", type=int, default=int(os.environ.get("OMP_NUM_THREADS", "1")))
    ap.add_argument("--contexts", default="512", help="comma-separated prompt lengths")
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--batch", type=int, default=1, help="requests decoding together (rows per step)")
    ap.add_argument("--kv-cache-dtype", default="auto", help="the engine's --kv-cache-dtype (fp32, bf16, fp8_e4m3)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from tokenmill import LLM

    contexts = [int(c) for c in args.contexts.split(",")]
    print(f"load average at start: {open('/proc/loadavg').read().strip()}")
    llm = LLM(model=args.model, quantization=args.quantization, kv_cache_dtype=args.kv_cache_dtype,
              kv_cache_tokens=args.batch * (max(contexts) + args.tokens + 64))
    engine = llm.engine
    if engine.runner.model.fused_decode_stack() is None:
        print("this model has no fused decode stack: nothing to compare")
        return 1
    print(f"weights: {args.quantization}, KV {engine.kv_spec.dtype}, attention {engine.runner.attn.name}, "
          f"{torch.get_num_threads()} thread(s), {args.batch} request(s) of "
          f"{args.tokens} tokens decoding together")
    print("| context | fused ms / step (rounds) | layer path ms / step (rounds) | layer / fused | same tokens |")
    print("|---|---|---|---|---|")
    for ctx in contexts:
        prompt = [100 + (i * 7919) % 20000 for i in range(ctx)]
        for fused in (True, False):
            _decode_ms(engine, prompt, args.tokens, fused, args.batch)   # unmeasured
        times: dict[bool, list[float]] = {True: [], False: []}
        outs: dict[bool, list[int]] = {}
        for r in range(args.rounds):
            for fused in ((True, False) if r % 2 == 0 else (False, True)):
                ms, outs[fused] = _decode_ms(engine, prompt, args.tokens, fused, args.batch)
                times[fused].append(ms)
        f, l = min(times[True]), min(times[False])
        print(f"| {ctx} | {f:.2f} ({', '.join(f'{t:.2f}' for t in times[True])}) | "
              f"{l:.2f} ({', '.join(f'{t:.2f}' for t in times[False])}) | {l / f:.2f}x | {outs[True] == outs[False]} |")
    print(f"load average at end: {open('/proc/loadavg').read().strip()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
