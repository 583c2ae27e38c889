"""Batch-1 decode speed of tokenmill's model forward alone (no scheduler, no sampling).

Loads a model (default: SmolLM2-135M-Instruct from its GGUF, fp32), prefills a context, then
times single-token decode steps over the paged KV cache and compares with the memory-bandwidth
bound (measured copy bandwidth / bytes of weights read per token). ``--profile`` prints a
torch.profiler table of one decode step.

    .venv/bin/python benchmarks/model_forward.py [--model M] [--context 100] [--steps 64] [--profile]
"""
from __future__ import annotations

import argparse
import time

import torch

from tokenmill.contracts.batch import ForwardBatch
from tokenmill.layers.attention import ForwardContext, select_attention_backend
from tokenmill.loader import load_model


def measure_bandwidth(nbytes: int = 512 << 20, repeats: int = 5) -> float:
    """Best-of-N read+write bandwidth of a large fp32 copy, in bytes/s (read and write both count)."""
    src = torch.ones(nbytes // 4)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t)
    return 2 * nbytes / best


def weight_bytes_per_token(model: torch.nn.Module) -> int:
    """Bytes of parameters a decode step reads (a tied embedding counts once, as the lm_head)."""
    seen = {id(p): p for p in model.parameters()}
    total = sum(p.numel() * p.element_size() for p in seen.values())
    embed = getattr(model, "embed_tokens", None)
    if embed is not None and getattr(model, "lm_head", None) is not embed:
        total -= embed.numel() * embed.element_size()  # only one row of it is gathered
    return total


class HFDecoder:
    """HF transformers batch-1 decode (model forward with its KV cache) on the same weights."""

    def __init__(self, loaded, prompt: torch.Tensor) -> None:
        from tokenmill.loader import build_hf_reference

        self.ref = build_hf_reference(loaded)
        with torch.no_grad():
            out = self.ref(prompt[None], use_cache=True)
        self.past, self.tok = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)

    def step(self) -> float:
        t = time.perf_counter()
        with torch.no_grad():
            out = self.ref(self.tok, past_key_values=self.past, use_cache=True)
        self.past, self.tok = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
        return time.perf_counter() - t


def make_kv(model, num_pages: int, page_size: int, backend: str = "auto"):
    """(attention backend, KV pool) the way the model runner makes them."""
    attn = select_attention_backend(model.kv_cache_spec(), "cpu", model.dtype, backend)
    return attn, attn.allocate(num_pages, page_size)


def run(model, attn, batch: ForwardBatch, kv):
    return model(ForwardContext.prepare(attn, batch, kv))


def batched_decode(model, batch: int, context: int, steps: int, page_size: int) -> list[float]:
    """Seconds of each decode step of ``batch`` sequences of ``context`` tokens (after warm-up)."""
    ps = page_size
    per_seq = (context + steps + 8 + ps - 1) // ps
    attn, kv = make_kv(model, batch * per_seq + 1, ps)
    tables = torch.arange(1, batch * per_seq + 1).view(batch, per_seq)
    gen = torch.Generator().manual_seed(1)
    for i in range(batch):  # prefill each sequence
        toks = torch.randint(0, model.args.vocab_size, (context,), generator=gen)
        pos = torch.arange(context)
        run(model, attn, ForwardBatch(toks, pos, tables[i][pos // ps] * ps + pos % ps, torch.tensor([0, context]),
                                      torch.tensor([context]), tables[i:i + 1], torch.tensor([context - 1]), ps), kv)
    tok = torch.zeros(batch, dtype=torch.long)
    times = []
    for step in range(steps + 4):
        pos = torch.full((batch,), context + step)
        slots = tables[torch.arange(batch), pos // ps] * ps + pos % ps
        fb = ForwardBatch(tok, pos, slots, torch.arange(batch + 1), pos + 1, tables, torch.arange(batch), ps)
        t = time.perf_counter()
        tok = run(model, attn, fb, kv).argmax(-1)
        if step >= 4:
            times.append(time.perf_counter() - t)
    return sorted(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--context", type=int, default=100)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--batch", type=int, default=0, help="also time decode steps of this many sequences at once")
    ap.add_argument("--hf", action="store_true", help="also time HF transformers decode (KV cache) on the same weights")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    loaded = load_model(args.model)
    model = loaded.model
    ps = args.page_size
    total = args.context + args.steps + 8
    num_pages = (total + ps - 1) // ps + 1
    attn, kv = make_kv(model, num_pages, ps)
    pages = torch.arange(1, num_pages)  # page 0 unused, as an engine's padding page would be
    table = pages[None, :]
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, model.args.vocab_size, (args.context,), generator=gen)

    def batch_for(tokens: torch.Tensor, start: int) -> ForwardBatch:
        n = tokens.shape[0]
        pos = torch.arange(start, start + n)
        return ForwardBatch(tokens, pos, pages[pos // ps] * ps + pos % ps, torch.tensor([0, n]),
                            torch.tensor([start + n]), table, torch.tensor([n - 1]), ps)

    t = time.perf_counter()
    logits = run(model, attn, batch_for(prompt, 0), kv)
    prefill_s = time.perf_counter() - t
    cur = args.context
    tok = logits.argmax(-1)
    hf = HFDecoder(loaded, prompt) if args.hf else None
    times, hf_times = [], []
    for i in range(args.steps + 4):  # the first 4 steps warm up; HF steps interleave with ours
        b = batch_for(tok, cur)
        t = time.perf_counter()
        tok = run(model, attn, b, kv).argmax(-1)
        if i >= 4:
            times.append(time.perf_counter() - t)
        cur += 1
        if hf is not None:
            dt = hf.step()
            if i >= 4:
                hf_times.append(dt)
    times.sort()
    hf_times.sort()
    median = times[len(times) // 2]
    hf_median = hf_times[len(hf_times) // 2] if hf_times else None
    bw = measure_bandwidth()
    wbytes = weight_bytes_per_token(model)
    bound = bw / wbytes
    print(f"model={args.model} threads={torch.get_num_threads()} context={args.context} steps={args.steps}")
    print(f"prefill {args.context} tokens: {prefill_s * 1000:.1f} ms ({args.context / prefill_s:.0f} tok/s)")
    print(f"decode step: median {median * 1000:.2f} ms, best {times[0] * 1000:.2f} ms -> "
          f"{1 / median:.1f} tok/s (best {1 / times[0]:.1f})")
    print(f"weights read per token: {wbytes / 1e6:.1f} MB; copy bandwidth {bw / 1e9:.2f} GB/s; "
          f"bound {bound:.1f} tok/s; median is {100 / median / bound:.0f}% of bound")
    if args.batch > 1:
        bt = batched_decode(model, args.batch, args.context, min(args.steps, 16), ps)
        med = bt[len(bt) // 2]
        print(f"batched decode, {args.batch} sequences x {args.context} context: median step "
              f"{med * 1000:.1f} ms -> {args.batch / med:.1f} tok/s")
    if hf_median is not None:
        print(f"HF transformers decode step (interleaved): median {hf_median * 1000:.2f} ms, best "
              f"{hf_times[0] * 1000:.2f} ms -> {1 / hf_median:.1f} tok/s; "
              f"tokenmill/HF = {hf_median / median:.2f}x")
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        b = batch_for(tok, cur)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            model(b, kv)
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=18))


if __name__ == "__main__":
    main()
