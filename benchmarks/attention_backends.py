"""The two paged-attention backends side by side on one layer's pool: SmolLM2's attention shape
(9 query heads, 3 KV heads, head_dim 64, pages of 16), one sequence, for decodes over growing
contexts and for prefill chunks with and without cached context (up to 16k cached tokens).
Milliseconds per call (write of the step's K/V included), and the ratio torch / native; the
native kernel also over bf16 and fp8 (e4m3, static scales) pages. For
prefill chunks it also times the kernel's per-row path (``TOKENMILL_NO_PREFILL_TILES=1``, the
path every chunk took before the tiled one) against the tiled path, in the same process.

    .venv/bin/python benchmarks/attention_backends.py --threads 1
    TOKENMILL_NO_AVX512=1 .venv/bin/python benchmarks/attention_backends.py --threads 1   # AVX2 path
"""
from __future__ import annotations

import argparse
import os
import time

import torch

from tokenmill.contracts.batch import ForwardBatch
from tokenmill.contracts.kv import KVCacheSpec
from tokenmill._native import attention as kernel
from tokenmill.layers.attention import FP8Pages, select_attention_backend
from tokenmill.layers.attention.fp8 import quantize_static

HQ, HKV, D, PS = 9, 3, 64, 16


def time_call(ctx: int, n: int, backend: str, reps: int, kv_dtype: str = "float32") -> float:
    length = ctx + n
    num_pages = -(-length // PS)
    x = torch.randn(2, num_pages + 1, PS, HKV, D)
    if kv_dtype == "float8_e4m3fn":   # static scales, as calibrated: one per layer and kv head
        scale = x.abs().amax(dim=(1, 2, 4), keepdim=True) * 4 / 448
        pool = FP8Pages(quantize_static(x, scale), scale.contiguous(), False)
    else:
        pool = x.to(getattr(torch, kv_dtype))
    table = torch.arange(1, num_pages + 1)[None]
    pos = torch.arange(ctx, length)
    batch = ForwardBatch(torch.zeros(n, dtype=torch.long), pos, table[0][pos // PS] * PS + pos % PS,
                         torch.tensor([0, n]), torch.tensor([length]), table, torch.tensor([n - 1]), PS, length)
    be = select_attention_backend(KVCacheSpec.dense(1, HKV, D, kv_dtype), "cpu", torch.float32, backend)
    q, k, v = torch.randn(n, HQ, D), torch.randn(n, HKV, D), torch.randn(n, HKV, D)
    be.forward(q, k, v, pool, be.build_metadata(batch), D ** -0.5)   # warm-up
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        be.forward(q, k, v, pool, be.build_metadata(batch), D ** -0.5)
        best = min(best, time.perf_counter() - t)
    return best * 1000


CASES = [(512, 1), (4096, 1), (16384, 1), (32768, 1), (0, 512), (4096, 256), (4096, 512), (16384, 256),
         (16384, 512)]


def per_row(ctx: int, n: int, reps: int) -> float:
    os.environ["TOKENMILL_NO_PREFILL_TILES"] = "1"
    try:
        return time_call(ctx, n, "native", reps)
    finally:
        del os.environ["TOKENMILL_NO_PREFILL_TILES"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--cases", default=",".join(f"{c}+{n}" for c, n in CASES),
                    help="comma-separated context+query_tokens pairs")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    cases = [tuple(int(x) for x in c.split("+")) for c in args.cases.split(",")]
    print(f"threads {args.threads}, kernel ISA {kernel.simd()}, load average "
          f"{open('/proc/loadavg').read().split()[:3]}; best of {args.reps}")
    print("| context | query tokens | torch ms | native ms | torch / native | native, bf16 KV ms "
          "| native, fp8 KV ms | fp32 / fp8 | per-row path ms | per-row / tiled |\n|---|---|---|---|---|---|---|---|---|---|")
    for ctx, n in cases:
        a, b = time_call(ctx, n, "torch", args.reps), time_call(ctx, n, "native", args.reps)
        c = time_call(ctx, n, "native", args.reps, "bfloat16")
        f8 = time_call(ctx, n, "native", args.reps, "float8_e4m3fn")
        row = f"| {ctx} | {n} | {a:.2f} | {b:.2f} | {a / b:.2f}x | {c:.2f} | {f8:.2f} | {b / f8:.2f}x |"
        if n > 1:
            r = per_row(ctx, n, args.reps)
            row += f" {r:.2f} | {r / b:.2f}x |"
        else:
            row += " (decode) | |"
        print(row, flush=True)


if __name__ == "__main__":
    main()
