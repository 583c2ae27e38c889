"""fp32 weight matmuls, side by side: ``F.linear`` (torch's CPU default, MKL sgemm) against oneDNN
on weights reordered once at start-up (``OneDNNLinear``, the fp32 default on CPU), at batch sizes
from a single decode to a prefill chunk.

The weights are the default model's shapes (SmolLM2-135M: 30 layers of qkv, o, gate_up, down,
plus the 49,152-row head), one distinct matrix per layer, so one pass reads every weight from
memory as a real decode step does (538 MB, far beyond the L3 cache). The two methods alternate
within each repetition; the best of ``--reps`` is kept, so a busy machine slows both alike.

    .venv/bin/python benchmarks/linear_fp32.py --threads 1
    .venv/bin/python benchmarks/linear_fp32.py --threads 2 --batches 1,4,8,64
"""
from __future__ import annotations

import argparse
import os
import time

import torch

from tokenmill.layers.linear import DenseLinear, OneDNNLinear

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]   # qkv, o, gate_up, down


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--batches", default="1,2,4,8,16,32,64,256,512")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--no-head", action="store_true", help="leave the 49,152 x 576 output head out")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    shapes = SHAPES * args.layers + ([] if args.no_head else [(49152, 576)])
    weights = [torch.randn(o, i) / i ** 0.5 for o, i in shapes]
    t = time.perf_counter()
    dense = [DenseLinear(w) for w in weights]
    packed = [OneDNNLinear(w) for w in weights]
    pack_s = time.perf_counter() - t
    mb = sum(w.numel() for w in weights) * 4 / 1e6
    print(f"# {len(shapes)} matrices, {mb:.0f} MB fp32, threads={args.threads}, packing took {pack_s:.2f} s, "
          f"load average {os.getloadavg()[0]:.2f}")
    print("| rows | F.linear ms | oneDNN ms | F.linear / oneDNN | max abs diff |")
    print("|---|---|---|---|---|")
    with torch.inference_mode():
        for b in (int(x) for x in args.batches.split(",")):
            xs = [torch.randn(b, i) for _, i in shapes]
            diff = max((d(x) - p(x)).abs().max().item() for d, p, x in zip(dense[:4], packed[:4], xs[:4]))
            best = {"dense": 1e9, "packed": 1e9}
            for _ in range(args.reps):
                for name, methods in (("dense", dense), ("packed", packed)):
                    t = time.perf_counter()
                    for m, x in zip(methods, xs):
                        m(x)
                    best[name] = min(best[name], time.perf_counter() - t)
            d, p = best["dense"] * 1e3, best["packed"] * 1e3
            print(f"| {b} | {d:.1f} | {p:.1f} | {d / p:.2f}x | {diff:.1e} |", flush=True)
    print(f"# load average at the end {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
