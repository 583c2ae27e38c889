"""What a sampled (temperature > 0) token costs in the sampler: tokenmill's ``Sampler`` on
``[B, 49152]`` logits (SmolLM2's vocabulary) against the same exponential race with torch's
``exponential_`` noise (the sampler before ``layers.sampling.exp1``), in one process; and what a
greedy token costs: the ``Sampler`` at temperature 0 (``row_argmax``, numpy's argmax) against
torch's ``argmax`` on the same logits (the greedy path before it).

    .venv/bin/python benchmarks/sampler_draw.py [--batches 1,4,16] [--repeats 30]
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from tokenmill.contracts.sampling import SamplingParams
from tokenmill.layers.sampling import Sampler, SamplingInputs

VOCAB = 49152


def torch_race(logits: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """The previous draw: softmax in float64, one torch Exp(1) per entry, argmax of p / E."""
    probs = torch.softmax(logits, dim=-1).double()
    return (probs / torch.empty_like(probs).exponential_(generator=gen)).argmax(dim=-1)


def best_ms(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="1,4,16")
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(f"load average {os.getloadavg()[0]:.2f}; {args.threads} thread(s); vocabulary {VOCAB}; median of {args.repeats}")
    print("| rows | Sampler (exp1 noise) ms | torch exponential_ race ms | ratio |")
    print("|---|---|---|---|")
    gen = torch.Generator().manual_seed(0)
    for b in (int(x) for x in args.batches.split(",")):
        logits = torch.randn(b, VOCAB, generator=gen) * 2
        params = [SamplingParams(temperature=1.0)] * b
        inputs = SamplingInputs(params, [[]] * b, [[]] * b, [None] * b)
        sampler = Sampler(seed=0)
        ours = best_ms(lambda: sampler(logits, inputs), args.repeats)
        ref = best_ms(lambda: torch_race(logits, gen), args.repeats)
        print(f"| {b} | {ours:.3f} | {ref:.3f} | {ref / ours:.2f}x |")
    print("\n| rows | greedy Sampler (row_argmax) ms | torch argmax ms | ratio |")
    print("|---|---|---|---|")
    for b in (int(x) for x in args.batches.split(",")):
        logits = torch.randn(b, VOCAB, generator=gen) * 2
        params = [SamplingParams(temperature=0.0)] * b
        inputs = SamplingInputs(params, [[]] * b, [[]] * b, [None] * b)
        sampler = Sampler(seed=0)
        assert sampler(logits, inputs).token_ids == logits.argmax(dim=-1).tolist()
        ours = best_ms(lambda: sampler(logits, inputs), args.repeats)
        ref = best_ms(lambda: logits.argmax(dim=-1).tolist(), args.repeats)
        print(f"| {b} | {ours:.3f} | {ref:.3f} | {ref / ours:.2f}x |")
    print(f"load average at the end {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
