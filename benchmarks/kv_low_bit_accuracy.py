"""What 4-bit (and 5-bit) KV pages would cost in accuracy: a simulation, not a pool kind.

A 16k decode step reads about 200 MB of int8 KV, and issue 18's 16k aim is held by that read;
half the bytes per element would halve it. This script asks what the halving costs before any
kernel is written. SmolLM2-135M-Instruct (fp32 weights) teacher-forces ``--tokens`` tokens of
this repository's README and architecture notes over an fp32 pool, 16 tokens per step after a
first token (``kv_fp8.run``). After each step every full page of the sequence is rounded in place
to a low-bit grid and written back as float32, as a quantized pool would hold it, while the
newest partial page stays exact (the recent-token residual of KIVI-style caches); later steps
read the rounded pages. Rounding is symmetric with a scale of amax / qmax per group:

- ``tok``: one scale per token, head and ``group`` consecutive dims (int8 pages use group 64);
- ``chan`` (K only): one scale per page, head and channel, over the page's 16 tokens (K's
  outlier channels then get scales of their own).

Each setting is compared with the unrounded run: mean / max |logit difference| and the share of
positions whose argmax agrees (teacher-forced greedy agreement).

    .venv/bin/python benchmarks/kv_low_bit_accuracy.py [--tokens 512] [--threads 2]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kv_fp8 import PAGE, run  # noqa: E402

from tokenmill.loader import load_model  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
# (label, K bits, K scale granularity, V bits, V group): qmax = 2^(bits-1) - 1
SETTINGS = [
    ("int8 K, int8 V (per token)", 8, "tok", 8, 64),
    ("int4 K, int4 V (per token)", 4, "tok", 4, 64),
    ("int4 K, int4 V (per token, groups of 16)", 4, "tok", 4, 16),
    ("int4 K per channel, int4 V", 4, "chan", 4, 64),
    ("int4 K per channel, int4 V (groups of 32)", 4, "chan", 4, 32),
    ("int4 K per channel, int8 V", 4, "chan", 8, 64),
    ("int8 K, int4 V", 8, "tok", 4, 64),
    ("int5 K per channel, int5 V (groups of 32)", 5, "chan", 5, 32),
]


def rounded(x: torch.Tensor, bits: int, dim: int, group: int | None = None) -> torch.Tensor:
    """``x`` on a symmetric grid of 2^(bits-1) - 1 steps each way, one scale per slice along
    ``dim`` (``group``: per ``group`` consecutive elements of the last dim instead)."""
    qmax = 2 ** (bits - 1) - 1
    shape = x.shape
    if group is not None:
        x = x.reshape(*shape[:-1], shape[-1] // group, group)
        dim = -1
    scale = (x.abs().amax(dim, keepdim=True) / qmax).clamp_min(1e-12)
    return ((x / scale).round().clamp(-qmax, qmax) * scale).reshape(shape)


def rounding(setting: tuple):
    """An ``after_step`` for kv_fp8.run: the sequence's full pages rounded in place by ``setting``
    (kv_fp8.run's page table is in order, so they are the first ``end // PAGE`` pages)."""
    _, kbits, kmode, vbits, vgroup = setting

    def apply(end: int, pool: list[torch.Tensor]) -> None:
        full = slice(0, end // PAGE)
        for layer in pool:   # [2, pages, page, kv heads, head dim]
            k, v = layer[0, full], layer[1, full]
            layer[0, full] = rounded(k, kbits, 1) if kmode == "chan" else rounded(k, kbits, -1, 64)
            layer[1, full] = rounded(v, vbits, -1, vgroup)
    return apply


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    loaded = load_model("smollm2-135m-instruct", quantization="none")
    text = (ROOT / "README.md").read_text() + (ROOT / "docs" / "architecture.md").read_text()
    tokens = loaded.tokenizer(text).input_ids[:args.tokens]
    exact, _ = run(loaded, tokens, "float32", chunk=PAGE)
    print(f"SmolLM2-135M-Instruct, fp32 weights, {len(tokens)} tokens teacher-forced, pages of {PAGE}, "
          f"the newest page exact\n")
    print("| KV rounding | bytes per token and head (K + V, with fp16 scales) | mean abs logit diff | "
          "max abs logit diff | top-1 agreement |")
    print("|---|---|---|---|---|")
    for s in SETTINGS:
        label, kbits, kmode, vbits, vgroup = s
        got, _ = run(loaded, tokens, "float32", chunk=PAGE, after_step=rounding(s))
        d = (got - exact).abs()
        agree = (got.argmax(-1) == exact.argmax(-1)).float().mean().item()
        kbytes = 64 * kbits / 8 + (2 * 64 / PAGE if kmode == "chan" else 2)
        vbytes = 64 * vbits / 8 + 2 * 64 // vgroup
        print(f"| {label} | {kbytes + vbytes:.0f} | {d.mean().item():.3f} | {d.max().item():.2f} | {100 * agree:.1f}% |",
              flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
