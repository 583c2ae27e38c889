"""The quantized decode kernels alone, by x rows: what one more row costs.

For each of the default model's matrix shapes (SmolLM2-135M: qkv 960x576, o 576x576, gate_up
3072x576, down 576x1536 in Q4_1 blocks; the tied output head 49152x576 in Q8_0 blocks), it builds
``--layers`` distinct random weights (so every call streams its weights from DRAM, as in a decode
step of 30 layers) and times ``gemm_u4`` / ``gemm_s8`` on 1, 2, 4, 5, 8 and 16 x rows, for every
kernel set this CPU runs (or those named in ``--kernels``), through the kernel bindings directly
(about a microsecond of Python per call). With ``--dequant`` it also times the path above the
integer kernels' row limit on the same weights: dequantize into the reused fp32 buffer, then the
fp32 GEMM (``_Packed._dequant_matmul``), and prints, per kernel set, the largest row count up to
which the integer kernels stay faster, per matrix and for the whole step (the crossover that
``packed.gemv_max_rows()`` encodes). Run it with ``ONEDNN_MAX_CPU_ISA=AVX2 --kernels avx2`` to see
an AVX2-only machine's side (oneDNN limited to AVX2 as well). Kernel sets and row counts are
interleaved over ``--rounds`` rounds; the fastest round is reported (on a shared machine load only
adds time). Prints microseconds per call,
ns per 32-weight block and row, the effective weight read rate, and each row count's time relative
to one row ("extra row": (t(M) - t(1)) / (M - 1) / t(1)).

    .venv/bin/python benchmarks/quant_kernel_rows.py [--threads 1] [--rounds 5] [--kernels avx512vnni,avxvnni]
        [--rows 1,2,4,8,16,24,32,48] [--dequant] [--baseline-so <_quant .so of another commit>]
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from peers import with_baseline_quant  # noqa: E402

SHAPES_U4 = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}
SHAPE_HEAD = (49152, 576)
ROWS = (1, 2, 4, 5, 8, 16)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--kernels", default=None, help="comma-separated kernel sets (default: every supported one)")
    ap.add_argument("--rows", default=",".join(map(str, ROWS)))
    ap.add_argument("--baseline-so", default=None,
                    help="another build of the _quant extension (say, of an older commit) to time side by side in "
                         "this process, as the kernel sets 'baseline:<set>' (each set it supports of those timed)")
    ap.add_argument("--dequant", action="store_true",
                    help="also time dequantize + fp32 GEMM at every row count and print the crossover")
    args = ap.parse_args(argv)

    from tokenmill._native import quant as native
    from tokenmill.layers.quant.packed import Int4Linear, Int8Linear

    torch.set_num_threads(args.threads)
    kernels = args.kernels.split(",") if args.kernels else native.supported_kernels()[1:] or ["scalar"]
    exts = with_baseline_quant(args.baseline_so, kernels, native._ext)
    rows = [int(r) for r in args.rows.split(",")]
    gen = torch.Generator().manual_seed(0)
    mats: dict[str, list] = {}
    for name, (n, k) in SHAPES_U4.items():
        i4 = [Int4Linear.from_float(torch.randn(n, k, generator=gen) * 0.05, 32) for _ in range(args.layers)]
        mats[name] = [Int4Linear(m.qs, m.scales.half(), m.mins.half(), k, 32) for m in i4]  # Q4_1: fp16 scales
    head = Int8Linear.from_float(torch.randn(*SHAPE_HEAD, generator=gen) * 0.05, 32)
    mats["lm_head (s8)"] = [Int8Linear(head.qs, head.scales.half(), SHAPE_HEAD[1], 32)]
    xs = {m: torch.randn(m, 1536, generator=gen) for m in rows}
    times: dict[tuple[str, str, int], list[float]] = {}
    print(f"load average at start {os.getloadavg()[0]:.2f}; {args.threads} thread(s); kernel sets {kernels}")
    best, ext0 = native.kernel(), native._ext
    try:
        for _ in range(args.rounds):
            for kern in kernels:
                native._ext = exts[kern]
                native.set_kernel(kern.split(":")[-1])
                for m in rows:
                    for name, ms in mats.items():
                        k = ms[0].in_features
                        x = xs[m][:, :k].contiguous()
                        y = torch.empty(m, ms[0].out_features)
                        ms[0]._gemm(x, y, 0, args.threads)  # warm-up
                        t = time.perf_counter()
                        for w in ms:  # the kernel binding itself: no LinearMethod.forward around it
                            w._gemm(x, y, 0, args.threads)
                        times.setdefault((kern, name, m), []).append((time.perf_counter() - t) / len(ms))
                        if args.dequant:
                            ms[0]._dequant_matmul(x, args.threads)  # warm-up
                            t = time.perf_counter()
                            for w in ms:
                                w._dequant_matmul(x, args.threads)
                            times.setdefault((kern, name + " dq", m), []).append((time.perf_counter() - t) / len(ms))
    finally:
        native._ext = ext0
        native.set_kernel(best)
    for kern in kernels:
        print(f"\n## kernel set {kern}")
        print("| matrix | rows | us / call | ns / block / row | weight GB/s | extra row |")
        print("|---|---|---|---|---|---|")
        for name, ms in mats.items():
            w = ms[0]
            blocks = w.out_features * ((w.in_features + 31) // 32)
            wbytes = blocks * (20 if isinstance(w, Int4Linear) else 34)
            t1 = min(times[(kern, name, rows[0])])
            for m in rows:
                t = min(times[(kern, name, m)])
                extra = "" if m == 1 else f"{(t - t1) / (m - 1) / t1:.2f}"
                print(f"| {name} | {m} | {t * 1e6:.1f} | {t / blocks / m * 1e9:.2f} | {wbytes / t / 1e9:.1f} | {extra} |")
        tot = {m: sum(min(times[(kern, n, m)]) * (args.layers if n in SHAPES_U4 else 1) for n in mats)
               for m in rows}
        print(f"all matrices of one decode step ({args.layers} layers + head), ms: "
              + ", ".join(f"{m} rows {tot[m] * 1e3:.2f}" for m in rows))
        if args.dequant:
            _crossover(kern, mats, rows, times, tot, args.layers)
    print(f"load average at end {os.getloadavg()[0]:.2f}")
    return 0


def _last_faster(faster: dict[int, bool], rows: list[int]) -> str:
    """The largest row count up to which every measured count has the integer kernels faster."""
    last = None
    for m in rows:
        if not faster[m]:
            break
        last = m
    return "none" if last is None else str(last)


def _crossover(kern: str, mats: dict, rows: list[int], times: dict, tot: dict, layers: int) -> None:
    dq = {m: sum(min(times[(kern, n + " dq", m)]) * (layers if n != "lm_head (s8)" else 1) for n in mats)
          for m in rows}
    print(f"\n### integer kernels ({kern}) vs dequantize + fp32 GEMM, ms for all matrices of one step "
          "(ratio > 1: the integer kernels are faster)")
    print("| rows | integer | dequant + GEMM | ratio |\n|---|---|---|---|")
    for m in rows:
        print(f"| {m} | {tot[m] * 1e3:.2f} | {dq[m] * 1e3:.2f} | {dq[m] / tot[m]:.2f} |")
    for name in mats:
        faster = {m: min(times[(kern, name, m)]) < min(times[(kern, name + " dq", m)]) for m in rows}
        print(f"{kern} {name}: integer kernels faster up to {_last_faster(faster, rows)} rows")
    print(f"{kern} whole step: integer kernels faster up to "
          f"{_last_faster({m: tot[m] < dq[m] for m in rows}, rows)} rows")


if __name__ == "__main__":
    raise SystemExit(main())
