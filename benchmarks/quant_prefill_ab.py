"""Prefill of a 1,000-token prompt through the default model in fp32, int8 and native Q4_1, in one
process, interleaved A/B/C for ``--rounds`` rounds so that load drift on a shared machine hits all
three alike. Prints the median prefill tok/s of each and the ratios to fp32.

    .venv/bin/python benchmarks/quant_prefill_ab.py [--threads 2] [--rounds 3] [--tokens 1000]
"""
from __future__ import annotations

import argparse
import inspect
import os
import statistics
import time

import torch


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=1000)
    args = ap.parse_args(argv)
    import difflib

    from tokenmill.contracts.batch import ForwardBatch
    from tokenmill.layers.attention import ForwardContext, select_attention_backend
    from tokenmill.loader import load_model

    torch.set_num_threads(args.threads)
    models = {q: load_model("smollm2-135m-instruct", quantization=q) for q in ("none", "int8", "auto")}
    ids = models["auto"].tokenizer(inspect.getsource(difflib)).input_ids[: args.tokens]
    n = len(ids)

    def prefill(model) -> float:
        spec = model.kv_cache_spec()
        attn = select_attention_backend(spec, "cpu", model.dtype, "auto")
        kv = attn.allocate(n // 16 + 2, 16)
        pos = torch.arange(n)
        batch = ForwardBatch(input_ids=torch.tensor(ids), positions=pos, slot_mapping=pos.clone(),
                             query_start_loc=torch.tensor([0, n]), seq_lens=torch.tensor([n]),
                             block_tables=torch.arange(n // 16 + 1).unsqueeze(0),
                             logits_indices=torch.tensor([n - 1]), page_size=16, max_seq_len=n)
        t = time.perf_counter()
        model(ForwardContext.prepare(attn, batch, kv))
        return n / (time.perf_counter() - t)

    for lm in models.values():
        prefill(lm.model)  # warm-up
    rates: dict[str, list[float]] = {q: [] for q in models}
    print(f"load average at start {os.getloadavg()[0]:.2f}", flush=True)
    for _ in range(args.rounds):
        for q, lm in models.items():
            rates[q].append(prefill(lm.model))
    med = {q: statistics.median(r) for q, r in rates.items()}
    label = {"none": "fp32", "int8": "int8", "auto": "Q4_1 (native)"}
    for q in models:
        print(f"{label[q]:>14}: {med[q]:7.1f} tok/s  ratio to fp32 {med[q] / med['none']:.3f}  "
              f"(rounds {[round(r, 1) for r in rates[q]]})")
    print(f"load average at end {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
