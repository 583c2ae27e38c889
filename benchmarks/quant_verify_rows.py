"""What one more token row costs in a decode step of the default model (speculative verification,
small decode batches), for each quantized kernel set.

Loads the default model from its bundled GGUF (``--quantization auto``: Q4_1 layers, Q8_0 output
head), prefills one ``--context``-token sequence into a paged KV pool, then times forwards that
append ``M`` tokens to that sequence and return logits for every one of them, as a verify step
does, for M in ``--rows`` (1, 2, 4, 5). The sequence is cut back to the context after each step,
so every step sees the same context. Row counts and kernel sets are interleaved over ``--rounds``
rounds, each step timed on its own; the fastest step of each is reported, with the median (on a
shared machine load only adds time).
Prints ms per step, the ratio to one row, and the cost of each extra row as a fraction of a
one-row step: (T(M) - T(1)) / (M - 1) / T(1).

``--paths int,dequant`` times each row count both ways on the whole model: "int" runs every step
through the integer kernels (the fused decode path, the row limit lifted with
``packed.set_gemv_max_rows``), "dequant" through the prefill GEMM (limit 0: layer by layer, each
matmul by ``packed.prefill_gemm()``, the tiled int16 GEMM or dequantize + fp32 GEMM as the CPU
decides, or as ``TOKENMILL_PREFILL_GEMM`` sets it; the header line says which); it then prints
the ratio and the largest row count up to which the integer path is faster, per kernel set: the
end-to-end check of ``packed.gemv_max_rows()``. ("auto", the default, keeps the served limit.)

    .venv/bin/python benchmarks/quant_verify_rows.py [--threads 1] [--rounds 5] [--kernels avx512vnni,avxvnni]
        [--rows 1,8,16,24,32,48 --paths int,dequant]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from peers import default_gguf, with_baseline_quant  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=20, help="timed steps per (rows, kernel set) per round")
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--rows", default="1,2,4,5")
    ap.add_argument("--kernels", default=None, help="comma-separated kernel sets (default: the best two)")
    ap.add_argument("--quantization", default="auto")
    ap.add_argument("--baseline-so", default=None,
                    help="another build of the _quant extension (say, of an older commit) to time side by side in "
                         "this process, as the kernel sets 'baseline:<set>' (each set of --kernels it supports)")
    ap.add_argument("--paths", default="auto", help="comma-separated: auto (the served row limit), int, dequant")
    args = ap.parse_args(argv)

    from tokenmill._native import quant as native
    from tokenmill.contracts.batch import ForwardBatch
    from tokenmill.layers.attention import ForwardContext, select_attention_backend
    from tokenmill.layers.quant import packed
    from tokenmill.loader import load_model

    torch.set_num_threads(args.threads)
    model = load_model(str(default_gguf()), quantization=args.quantization).model
    attn = select_attention_backend(model.kv_cache_spec(), "cpu", model.dtype, "auto")
    page = 16
    rows = [int(r) for r in args.rows.split(",")]
    pages = (args.context + max(rows)) // page + 1
    kv = attn.allocate(pages, page)
    table = torch.arange(pages, dtype=torch.long).unsqueeze(0)

    def forward(start: int, ids: list[int]) -> torch.Tensor:
        n = len(ids)
        pos = torch.arange(start, start + n, dtype=torch.long)
        batch = ForwardBatch(input_ids=torch.tensor(ids, dtype=torch.long), positions=pos, slot_mapping=pos.clone(),
                             query_start_loc=torch.tensor([0, n], dtype=torch.long),
                             seq_lens=torch.tensor([start + n], dtype=torch.long), block_tables=table,
                             logits_indices=torch.arange(n, dtype=torch.long), page_size=page,
                             max_seq_len=start + n, state_slots=None)
        with torch.no_grad():
            return model(ForwardContext.prepare(attn, batch, kv))

    gen = torch.Generator().manual_seed(0)
    forward(0, torch.randint(100, 40000, (args.context,), generator=gen).tolist())   # the context
    kernels = args.kernels.split(",") if args.kernels else native.supported_kernels()[-2:][::-1]
    exts = with_baseline_quant(args.baseline_so, kernels, native._ext)
    fused = model.fused_decode_stack() is not None if hasattr(model, "fused_decode_stack") else False
    paths = args.paths.split(",")
    limits = {"auto": None, "int": 1 << 30, "dequant": 0}
    if not set(paths) <= set(limits):
        ap.error(f"--paths takes {', '.join(limits)}, got {args.paths}")
    print(f"load average at start {os.getloadavg()[0]:.2f}; {args.threads} thread(s); kernel sets {kernels}; "
          f"fused decode path: {fused}; context {args.context}; paths {paths}; "
          f"prefill GEMM (the dequant path): {packed.prefill_gemm()}")
    served = {}
    for k in kernels:   # packed.gemv_max_rows() under each set (the per-set value, or the wide-GEMM one)
        before_k = native.kernel()
        native.set_kernel(k.split(":")[-1])
        served[k] = packed.gemv_max_rows()
        native.set_kernel(before_k)
    steps: dict[tuple[str, int], list[float]] = {}
    before = native.kernel()
    try:
        for _ in range(args.rounds):
            for m in rows:
                ids = torch.randint(100, 40000, (m,), generator=gen).tolist()
                for kern in kernels:
                    native._ext = exts[kern]
                    native.set_kernel(kern.split(":")[-1])
                    for path in paths:
                        packed.set_gemv_max_rows(limits[path])
                        forward(args.context, ids)   # warm-up
                        for _ in range(args.steps):
                            t = time.perf_counter()
                            forward(args.context, ids)
                            steps.setdefault((_label(kern, path, paths), m), []).append(time.perf_counter() - t)
    finally:
        native._ext = exts[kernels[0]]
        native.set_kernel(before)
        packed.set_gemv_max_rows(None)
    print("\nms per step: the fastest step (median in brackets); extra row = (T(M) - T(1)) / (M - 1) / T(1)"
          " on the fastest steps")
    print("| kernel set | rows | ms / step | vs 1 row | extra row / one-row step |\n|---|---|---|---|---|")
    for label in dict.fromkeys(k for k, _ in steps):
        t1 = min(steps[(label, rows[0])])
        for m in rows:
            t = min(steps[(label, m)])
            extra = "" if m == 1 else f"{(t - t1) / (m - 1) / t1:.2f}"
            print(f"| {label} | {m} | {t * 1e3:.2f} ({statistics.median(steps[(label, m)]) * 1e3:.2f}) | "
                  f"{t / t1:.2f}x | {extra} |")
    if "int" in paths and "dequant" in paths:
        print("\nint vs dequant (fastest steps; ratio > 1: the integer path is faster)")
        print("| kernel set | rows | int ms | dequant ms | ratio |\n|---|---|---|---|---|")
        for kern in kernels:
            last = None
            for m in rows:
                ti, td = min(steps[(f"{kern}/int", m)]), min(steps[(f"{kern}/dequant", m)])
                print(f"| {kern} | {m} | {ti * 1e3:.2f} | {td * 1e3:.2f} | {td / ti:.2f} |")
                if ti < td and last == (rows[rows.index(m) - 1] if m != rows[0] else None):
                    last = m
            print(f"{kern}: integer path faster up to {last} rows (served limit {served[kern]})")
    print(f"load average at end {os.getloadavg()[0]:.2f}")
    return 0


def _label(kern: str, path: str, paths: list[str]) -> str:
    return kern if paths == ["auto"] else f"{kern}/{path}"


if __name__ == "__main__":
    raise SystemExit(main())
