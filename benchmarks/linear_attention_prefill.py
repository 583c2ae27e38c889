"""Prefill of one linear-attention layer: tokenmill's chunked gated delta rule (triangular solve per
64-token block) against running the recurrence token by token (what a decode-only kernel would do)
and against HF transformers' torch reference (``chunk_kimi_delta_attention``, forward substitution
in a Python loop over block positions). KDA shapes (per-channel decay), l2-normed q/k, fp32.
Milliseconds per prompt and the ratios.

    .venv/bin/python benchmarks/linear_attention_prefill.py --threads 1 --heads 8 --head-dim 128 --tokens 2048 [--decay 0.5]
"""
from __future__ import annotations

import argparse
import time

import torch

from tokenmill.layers.linear_attention import chunk_gated_delta_rule, recurrent_gated_delta_rule


def timed(fn, reps: int) -> float:
    fn()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--decay", type=float, default=5.0,
                    help="log-decay per step is -decay * sigmoid(N(0, 1)) per channel (KDA's safe gate: 5)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    t, h, d = args.tokens, args.heads, args.head_dim
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(t, h, d, generator=gen) for _ in range(3))
    g = -args.decay * torch.sigmoid(torch.randn(t, h, d, generator=gen))
    beta = torch.sigmoid(torch.randn(t, h, generator=gen))

    def chunked() -> torch.Tensor:
        return chunk_gated_delta_rule(q, k, v, g, beta, use_l2norm=True)[0]

    def recurrent() -> torch.Tensor:
        s, outs = None, []
        for i in range(t):
            o, s = recurrent_gated_delta_rule(q[i:i + 1], k[i:i + 1], v[i:i + 1], g[i:i + 1], beta[i:i + 1], s,
                                              use_l2norm=True)
            outs.append(o)
        return torch.cat(outs)

    results = {"tokenmill chunked": timed(chunked, args.reps), "token-by-token recurrent": timed(recurrent, 1)}
    try:
        from transformers.models.bailing_hybrid.modeling_bailing_hybrid import chunk_kimi_delta_attention

        def hf() -> torch.Tensor:
            return chunk_kimi_delta_attention(q[None], k[None], v[None], g[None], beta[None],
                                              use_qk_l2norm_in_kernel=True)[0][0]

        results["HF chunk_kimi_delta_attention (torch)"] = timed(hf, 1)
        err = (chunked() - hf()).abs().max().item()
    except ImportError:
        err = float("nan")
    err_rec = (chunked() - recurrent()).abs().max().item()
    print(f"KDA prefill, {t} tokens, {h} heads x {d}, decay scale {args.decay}, fp32, {args.threads} thread(s)")
    base = results["tokenmill chunked"]
    for name, ms in results.items():
        print(f"  {name:40s} {ms:10.1f} ms   {ms / base:6.1f}x chunked")
    print(f"  max |chunked - recurrent| = {err_rec:.2e}, max |chunked - HF| = {err:.2e}")


if __name__ == "__main__":
    main()
