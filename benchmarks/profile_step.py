"""Where the time of one engine step goes: a torch.profiler table of one single-stream decode
step and of one prefill chunk after cached context, on the default model.

The KV pool is filled with random values up to the context length (the cost of a step does not
depend on the values), so no long prefill is needed first. The same script runs against the
model API of earlier tokenmill versions too (``model(batch, kv_caches)``), which is how the
"before" profile in docs/results/engine.md was taken: check out the old commit and run this
file with that tree first on ``PYTHONPATH``.

    .venv/bin/python benchmarks/profile_step.py --context 4096 --chunk 256 --threads 2

``--linear-backends torch,onednn`` profiles the fp32 weights through ``F.linear`` (before) and
through oneDNN on prepacked weights (after) in one run; ``--compile`` adds the fused elementwise
kernels (``tokenmill.layers.fused``) as a third configuration. The default is the fp32 model
(``--quantization none``), the precision compared against vLLM.
"""
from __future__ import annotations

import argparse
import time

import torch
from torch.profiler import ProfilerActivity, profile

from tokenmill.loader import load_model


def make_runner(model, num_pages: int, page_size: int):
    """(forward(batch) -> logits, kv pool tensors, ForwardBatch class) for either model API."""
    try:  # the runner-owned backend API
        from tokenmill.contracts.batch import ForwardBatch
        from tokenmill.layers.attention import ForwardContext, select_attention_backend

        attn = select_attention_backend(model.kv_cache_spec(), "cpu", model.dtype)
        kv = attn.allocate(num_pages, page_size)
        return (lambda b: model(ForwardContext.prepare(attn, b, kv))), kv, ForwardBatch, attn.name
    except ImportError:  # the model-owned backend API of the first version
        from tokenmill.layers.attention import ForwardBatch, allocate_kv_cache

        kv = allocate_kv_cache(model.kv_cache_spec(), num_pages, page_size)
        return (lambda b: model(b, kv)), kv, ForwardBatch, "torch (model-owned)"


def batch_for(FB, start: int, n: int, table: torch.Tensor, ps: int, vocab: int):
    pos = torch.arange(start, start + n)
    toks = torch.randint(0, vocab, (n,))
    kw = dict(input_ids=toks, positions=pos, slot_mapping=table[pos // ps] * ps + pos % ps,
              query_start_loc=torch.tensor([0, n]), seq_lens=torch.tensor([start + n]),
              block_tables=table[None, :], logits_indices=torch.tensor([n - 1]), page_size=ps)
    try:
        return FB(**kw, max_seq_len=start + n)
    except TypeError:
        return FB(**kw)


def profile_one(fwd, make_batch, label: str, rows: int) -> None:
    for _ in range(3):  # warm-up
        fwd(make_batch())
    b = make_batch()
    t = time.perf_counter()
    fwd(b)
    wall = (time.perf_counter() - t) * 1000
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fwd(make_batch())
    print(f"\n== {label}: {wall:.1f} ms wall (unprofiled) ==")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows, max_name_column_width=48))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--chunk", type=int, default=256)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", type=int, default=12)
    ap.add_argument("--quantization", default="none", help="weight format (none = fp32, auto = as stored)")
    ap.add_argument("--linear-backends", default="torch,onednn",
                    help="comma-separated: torch (F.linear), onednn (prepacked); current API only")
    ap.add_argument("--compile", action="store_true", help="also profile onednn + fused elementwise kernels")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(f"load average: {open('/proc/loadavg').read().split()[:3]}")
    model = load_model(args.model, quantization=args.quantization).model
    try:
        from tokenmill.layers import fused
        from tokenmill.layers.linear import use_linear_backend
    except ImportError:  # an earlier version: one configuration, as it ran
        configs = [("as loaded", None, False)]
    else:
        configs = [(b, b, False) for b in args.linear_backends.split(",")]
        if args.compile:
            configs.append(("onednn + compiled elementwise", "onednn", True))
    for label, backend, compiled in configs:
        if backend is not None:
            use_linear_backend(model, backend)
            secs = fused.enable(compiled, hidden_size=model.args.hidden_size, head_dim=model.args.head_dim)
            print(f"\n#### linear backend: {label}" + (f" (compile took {secs:.1f} s)" if compiled else ""))
        run_config(model, args)


def run_config(model, args) -> None:
    ps = args.page_size
    total = args.context + args.chunk + ps
    num_pages = total // ps + 2
    with torch.inference_mode():
        fwd, kv, FB, backend = make_runner(model, num_pages, ps)
        for t in kv:
            t.normal_()
        print(f"attention backend: {backend}")
        table = torch.arange(1, num_pages)
        vocab = model.args.vocab_size
        profile_one(fwd, lambda: batch_for(FB, args.context, 1, table, ps, vocab),
                    f"decode step, 1 sequence, context {args.context}", args.rows)
        profile_one(fwd, lambda: batch_for(FB, args.context, args.chunk, table, ps, vocab),
                    f"prefill chunk of {args.chunk} after {args.context} cached tokens", args.rows)


if __name__ == "__main__":
    main()
