"""The two paged-attention backends side by side on one layer's pool: SmolLM2's attention shape
(9 query heads, 3 KV heads, head_dim 64, pages of 16), one sequence, for decodes over growing
contexts and for prefill chunks with and without cached context. Milliseconds per call
(write of the step's K/V included), and the ratio torch / native.

    .venv/bin/python benchmarks/attention_backends.py --threads 1
"""
from __future__ import annotations

import argparse
import time

import torch

from tokenmill.contracts.batch import ForwardBatch
from tokenmill.contracts.kv import KVCacheSpec
from tokenmill.layers.attention import select_attention_backend

HQ, HKV, D, PS = 9, 3, 64, 16


def time_call(ctx: int, n: int, backend: str, reps: int, kv_dtype: str = "float32") -> float:
    length = ctx + n
    num_pages = -(-length // PS)
    pool = torch.randn(2, num_pages + 1, PS, HKV, D).to(getattr(torch, kv_dtype))
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--reps", type=int, default=7)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(f"threads {args.threads}, load average {open('/proc/loadavg').read().split()[:3]}; best of {args.reps}")
    print("| context | query tokens | torch ms | native ms | torch / native | native, bf16 KV ms |\n"
          "|---|---|---|---|---|---|")
    for ctx, n in [(512, 1), (4096, 1), (16384, 1), (32768, 1), (0, 512), (4096, 256), (4096, 512)]:
        a, b = time_call(ctx, n, "torch", args.reps), time_call(ctx, n, "native", args.reps)
        c = time_call(ctx, n, "native", args.reps, "bfloat16")
        print(f"| {ctx} | {n} | {a:.2f} | {b:.2f} | {a / b:.2f}x | {c:.2f} |", flush=True)


if __name__ == "__main__":
    main()
