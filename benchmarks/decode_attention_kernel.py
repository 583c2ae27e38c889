"""The native decode-attention kernel alone: time per key and KV head, with the KV in cache and
from DRAM, against a plain read of the same bytes.

One decode row of SmolLM2-135M's shape (9 query heads, 3 KV heads, head_dim 64) attends to L
cached tokens in pages of 16 tokens (fp8 by default; ``--kinds fp8,int8,int8t,fp16,bf16,fp32`` times each
pool dtype in turn), in random page order, through
``tokenmill._native.attention.paged_attention`` on one thread (``--threads N``: N; the ns per
key-head columns are then wall time, N threads together). "cold" calls 30 layers' pools in
turn (30 x 2 x L x 3 x 64 bytes, far beyond the caches, as in a real decode step); "hot" calls one
layer's pool 30 times (it stays in cache up to a few thousand tokens). "read" sums the same 30 pools with
torch, a floor for streaming those bytes. If cold is near hot, the kernel is bound by its
arithmetic, not by memory; the #18 aim (16k decode >= 0.7x the 512 rate) needs the cold time per
layer under (step_512 / 0.7 - step_512) / 30.

    .venv/bin/python benchmarks/decode_attention_kernel.py [--contexts 512,4096,16384] [--rounds 2]
        [--kinds fp8,int8,int8t,fp16,bf16,fp32] [--threads 2] [--env-ab TOKENMILL_KV_HEADS_APART]

``--env-ab NAME`` (or ``NAME=VALUE``) times every point a second time with that kernel switch set
(the kernel reads its switches at each call), in the same round.
"""
from __future__ import annotations

import argparse
import os
import time

import torch

from tokenmill._native import attention as native

PAGE, HQ, HKV, D, LAYERS = 16, 9, 3, 64, 30
# kv kinds of the kernel (TM_KV_* in _native/attention.h) and their element types
KINDS = {"fp32": (0, torch.float32), "bf16": (1, torch.bfloat16), "fp8": (2, torch.uint8), "fp16": (4, torch.float16),
         "int8": (5, torch.int8), "int8t": (6, torch.int8)}   # int8t: int8 pages in the tiled order (random codes)


class Pools:
    def __init__(self, ctx: int, kind: str = "fp8", threads: int = 1) -> None:
        self.threads = threads
        self.ctx, self.pages = ctx, ctx // PAGE
        self.kind, dtype = KINDS[kind]
        g = torch.Generator().manual_seed(ctx)
        self.layers = []
        shape = (self.pages + 8, PAGE, HKV, D)
        for _ in range(LAYERS):
            if dtype == torch.uint8:   # e4m3 bytes of moderate values
                k = torch.randint(0, 120, shape, dtype=torch.uint8, generator=g)
                v = torch.randint(0, 120, shape, dtype=torch.uint8, generator=g)
            elif dtype == torch.int8:
                k = torch.randint(-127, 128, shape, dtype=torch.int8, generator=g)
                v = torch.randint(-127, 128, shape, dtype=torch.int8, generator=g)
            else:
                k, v = torch.randn(shape, generator=g).to(dtype), torch.randn(shape, generator=g).to(dtype)
            table = torch.randperm(self.pages + 8, generator=g)[:self.pages].to(torch.int64).contiguous()
            self.layers.append((k, v, table))
        # a static scale per head (fp8), or one per stored vector (int8)
        self.scales = torch.full(((self.pages + 8) * PAGE * HKV if kind.startswith("int8") else HKV,), 0.01)
        self.q = torch.randn(1, HQ * D, generator=g)
        self.out = torch.empty(1, HQ * D)
        self.qsl = torch.tensor([0, 1], dtype=torch.int64)
        self.lens = torch.tensor([ctx], dtype=torch.int64)

    def call(self, layer: int) -> None:
        k, v, table = self.layers[layer]
        native.paged_attention(self.q.data_ptr(), HQ * D, self.out.data_ptr(), k.data_ptr(), v.data_ptr(),
                               table.data_ptr(), self.pages, self.qsl.data_ptr(), self.lens.data_ptr(), 1, PAGE,
                               HQ, HKV, D, D ** -0.5, self.threads, self.kind, self.scales.data_ptr(), self.scales.data_ptr())

    def cold(self) -> float:
        t0 = time.perf_counter()
        for i in range(LAYERS):
            self.call(i)
        return time.perf_counter() - t0

    def hot(self) -> float:
        self.call(0)
        t0 = time.perf_counter()
        for _ in range(LAYERS):
            self.call(0)
        return time.perf_counter() - t0

    def read(self) -> float:
        t0 = time.perf_counter()
        for k, v, _ in self.layers:
            int(k.view(torch.int64).sum()) + int(v.view(torch.int64).sum())   # every byte, as int64 words
        return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--contexts", default="512,4096,16384")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5, help="timed passes per measure (best is kept)")
    ap.add_argument("--kinds", default="fp8", help=f"comma-separated pool dtypes of {', '.join(KINDS)}")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--env-ab", default=None, help="a kernel switch, NAME or NAME=VALUE, timed as a second setting")
    args = ap.parse_args()
    if not native.available():
        raise SystemExit(native.unavailable_reason())
    torch.set_num_threads(args.threads)
    print(f"load average {os.getloadavg()[0]:.2f}; kernel {native.simd()}; {args.threads} thread(s); "
          f"{HQ}/{HKV} heads x {D}, pages of {PAGE}, {LAYERS} layers")
    name, _, value = (args.env_ab or "").partition("=")
    settings = [None] + ([args.env_ab] if args.env_ab else [])
    print("| kind | context | setting | round | cold ms/layer | hot ms/layer | read ms/layer | cold ns per key-head | "
          "hot ns per key-head | cold GB/s | read GB/s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for rnd in range(args.rounds):
        for ctx in (int(c) for c in args.contexts.split(",")):
            for kind in args.kinds.split(","):
                p = Pools(ctx, kind, args.threads)
                for setting in settings:
                    if setting:
                        os.environ[name] = value or "1"
                    try:
                        cold = min(p.cold() for _ in range(args.repeats)) / LAYERS
                        hot = min(p.hot() for _ in range(args.repeats)) / LAYERS
                    finally:
                        if setting:
                            os.environ.pop(name, None)
                    read = min(p.read() for _ in range(args.repeats)) / LAYERS
                    per = ctx * HKV
                    nbytes = 2 * ctx * HKV * D * p.layers[0][0].element_size()
                    print(f"| {kind} | {ctx} | {setting or 'default'} | {rnd + 1} | {cold * 1e3:.3f} | {hot * 1e3:.3f} | "
                          f"{read * 1e3:.3f} | {cold * 1e9 / per:.1f} | {hot * 1e9 / per:.1f} | {nbytes / cold / 1e9:.2f} | "
                          f"{nbytes / read / 1e9:.2f} |", flush=True)
    print(f"load average at the end {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
