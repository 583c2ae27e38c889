"""The prefill matmuls of packed weights, two ways, in one process: the tiled int16 GEMM
(``qgemm.c``, ``packed.prefill_gemm() == "int16"``) against dequantize + fp32 GEMM (``"fp32"``).

Part 1, ``matrices``: the default model's Q4_1 shapes (SmolLM2-135M: qkv 960x576, o 576x576,
gate_up 3072x576, down 576x1536; random weights) at each of ``--rows`` x rows: the tiled GEMM with
each of its kernels this CPU runs, dequantize + fp32 GEMM (oneDNN's), and the int16 decode kernels
(what runs up to ``gemv_max_rows()`` rows), all interleaved over ``--rounds`` rounds; the fastest
round of each is printed (load only adds time), summed over the four shapes, with ratios.

Part 2, ``engine``: the offline engine on the default Q4_1 model, the two settings taking turns
round by round (``packed.set_prefill_gemm``): a ``--prompt``-token prompt prefilled alone (no
prefix cache), and an agent turn: ``--new`` new tokens after that prompt cached. Prints the
median time of each and the median of the paired ratios (fp32 time / int16 time).

    OMP_NUM_THREADS=N .venv/bin/python benchmarks/prefill_gemm_ab.py [--threads N] [--rounds 5]
        [--parts matrices,engine] [--rows 32,64,128,256,512] [--prompt 1000] [--new 128]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}


def _timed(fn, reps: int) -> float:
    fn()
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t) / reps


def matrices(args: argparse.Namespace) -> None:
    from tokenmill._native import quant as native
    from tokenmill.layers.quant import packed
    from tokenmill.layers.quant.packed import Int4Linear

    threads = torch.get_num_threads()
    supported = native.supported_kernels()
    gemms = [k for k in native.GEMM_KERNELS if k != "scalar" and k in supported]
    gen = torch.Generator().manual_seed(0)
    mats = {name: Int4Linear.from_float(torch.randn(n, k, generator=gen) * 0.05, 32) for name, (n, k) in SHAPES.items()}
    rows = [int(r) for r in args.rows.split(",")]
    paths = [f"tiled-{g}" for g in gemms] + ["dequant+fp32", "int16-decode"]
    best: dict[tuple[str, int, str], float] = {}
    for rnd in range(args.rounds):
        for m in rows:
            x = {name: torch.randn(m, lin.in_features, generator=gen) for name, lin in mats.items()}
            for path in paths:
                for name, lin in mats.items():
                    y = torch.empty(m, lin.out_features)
                    if path.startswith("tiled-"):
                        fn = lambda: lin._gemm_tiled(x[name], y, 0, threads, kernel=path[6:])  # noqa: E731
                    elif path == "dequant+fp32":
                        fn = lambda: lin._dequant_matmul(x[name], threads)  # noqa: E731
                    else:
                        fn = lambda: lin._gemm(x[name], y, 0, threads)  # noqa: E731
                    reps = max(2, int(2e8 // (m * lin.in_features * lin.out_features)))
                    t = _timed(fn, reps)
                    key = (path, m, name)
                    best[key] = min(best.get(key, t), t)
        print(f"round {rnd + 1}/{args.rounds} done", file=sys.stderr, flush=True)
    print(f"\n## matrices: ms per call summed over qkv, o, gate_up, down (fastest of {args.rounds} rounds, "
          f"{threads} thread(s); decode kernels: {native.kernel()}, gemv_max_rows {packed.gemv_max_rows()})\n")
    print("| rows | " + " | ".join(paths) + " | dequant+fp32 / tiled-" + gemms[-1] + " |")
    print("|---" * (len(paths) + 2) + "|")
    for m in rows:
        tot = {p: sum(best[(p, m, n)] for n in SHAPES) * 1e3 for p in paths}
        macs = m * sum(n * k for n, k in SHAPES.values())
        cells = " | ".join(f"{tot[p]:.2f} ({macs / tot[p] / 1e6:.0f} GMAC/s)" for p in paths)
        print(f"| {m} | {cells} | {tot['dequant+fp32'] / tot['tiled-' + gemms[-1]]:.2f}x |")


def engine(args: argparse.Namespace) -> None:
    from tokenmill import LLM, SamplingParams
    from tokenmill.layers.quant import packed
    from tokenmill.loader import load_model

    gen = torch.Generator().manual_seed(1)
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    loaded = load_model("smollm2-135m-instruct")
    cold = LLM(loaded=loaded, kv_cache_tokens=4 * (args.prompt + args.new), enable_prefix_cache=False)
    warm = LLM(loaded=loaded, kv_cache_tokens=8 * (args.prompt + args.new))
    times: dict[tuple[str, str], list[float]] = {}
    for rnd in range(args.rounds):
        for mode in ("int16", "fp32"):
            packed.set_prefill_gemm(mode)
            prompt = torch.randint(200, 40000, (args.prompt,), generator=gen).tolist()
            t = time.perf_counter()
            cold.generate([prompt], params)
            times.setdefault(("prompt", mode), []).append(time.perf_counter() - t)
            warm.generate([prompt], params)   # cache the context, then time the turn after it
            turn = prompt + torch.randint(200, 40000, (args.new,), generator=gen).tolist()
            t = time.perf_counter()
            warm.generate([turn], params)
            times.setdefault(("turn", mode), []).append(time.perf_counter() - t)
        packed.set_prefill_gemm(None)
        print(f"round {rnd + 1}/{args.rounds} done", file=sys.stderr, flush=True)
    print(f"\n## engine: default Q4_1 model, {torch.get_num_threads()} thread(s), {args.rounds} rounds (median)\n")
    print("| what | int16 (tiled) | fp32 (dequant + GEMM) | fp32 / int16, paired median |")
    print("|---|---|---|---|")
    for what, label in (("prompt", f"{args.prompt}-token prompt"), ("turn", f"{args.new} new after {args.prompt} cached")):
        a, b = times[(what, "int16")], times[(what, "fp32")]
        n = args.prompt if what == "prompt" else args.new
        ratio = statistics.median(y / x for x, y in zip(a, b))
        print(f"| {label} | {statistics.median(a) * 1e3:.1f} ms ({n / statistics.median(a):.0f} tok/s) | "
              f"{statistics.median(b) * 1e3:.1f} ms ({n / statistics.median(b):.0f} tok/s) | {ratio:.2f}x |")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--parts", default="matrices,engine")
    ap.add_argument("--rows", default="32,64,128,256,512")
    ap.add_argument("--prompt", type=int, default=1000)
    ap.add_argument("--new", type=int, default=128)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    parts = args.parts.split(",")
    if "matrices" in parts:
        matrices(args)
    if "engine" in parts:
        engine(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
