"""Where one batch-1 decode step of the default model goes, by part, for a given weight format.

Runs the offline engine (``LLM``) over a 128-token prompt and 64 greedy tokens, with timers
around each linear-method call (by matrix), the attention call, and the model forward; the rest
of the engine step (scheduler, batch building, sampling, detokenizing) is the step wall time minus
the forward. Prints milliseconds per decode step and shares.

    .venv/bin/python benchmarks/quant_decode_profile.py [--quantization auto] [--threads 1]
"""
from __future__ import annotations

import argparse
import collections
import time
from typing import Any

import torch


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quantization", default="auto")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--tokens", type=int, default=64)
    args = ap.parse_args(argv)

    from tokenmill import LLM, SamplingParams
    from tokenmill.layers.linear import LinearMethod

    torch.set_num_threads(args.threads)
    llm = LLM(quantization=args.quantization, num_threads=args.threads, kv_cache_tokens=4096)
    model = llm.engine.loaded.model
    names = {id(m): n.split(".")[-1] for n, m in model.named_modules() if isinstance(m, LinearMethod)}
    if model.lm_head is model.embed_tokens:
        names[id(model.lm_head)] = "lm_head (tied embedding)"
    spent: dict[str, float] = collections.defaultdict(float)
    counting = [False]

    def timed(label: str, fn: Any) -> Any:
        def wrapper(*a: Any, **k: Any) -> Any:
            if not counting[0]:
                return fn(*a, **k)
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                spent[label] += time.perf_counter() - t
        return wrapper

    for m in model.modules():
        if isinstance(m, LinearMethod):
            m.forward = timed(f"matmul {names[id(m)]}", m.forward)
    model_forward = model.forward
    armed = [False]
    first_end = [0.0]

    def forward(*a: Any, **k: Any) -> Any:
        t = time.perf_counter()
        out = model_forward(*a, **k)
        if counting[0]:
            spent["model forward (total)"] += time.perf_counter() - t
        elif armed[0]:  # the timed request's prefill step ends: count from here on
            armed[0], counting[0] = False, True
            first_end[0] = time.perf_counter()
        return out

    model.forward = forward
    attn = llm.engine.runner.attn if hasattr(llm.engine, "runner") else None
    if attn is not None:
        attn.forward = timed("attention", attn.forward)

    prompt = [list(range(1000, 1128))]
    llm.generate(prompt, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))  # warm-up
    # a fresh prompt (no prefix-cache hit); the clock starts when its prefill step returns
    params = SamplingParams(max_tokens=args.tokens, temperature=0.0, ignore_eos=True)
    armed[0] = True
    llm.generate([list(range(2000, 2128))], params)
    wall = time.perf_counter() - first_end[0]
    counting[0] = False
    steps = args.tokens - 1
    total_ms = wall / steps * 1e3
    print(f"format {args.quantization}, {args.threads} thread(s): {steps / wall:.1f} tok/s, {total_ms:.2f} ms per "
          f"decode step (kernel set {__import__('tokenmill._native.quant', fromlist=['x']).kernel()})")
    fwd = spent.pop("model forward (total)", 0.0)
    rows = sorted(spent.items(), key=lambda kv: -kv[1])
    matmul = sum(v for k, v in rows if k.startswith("matmul"))
    rest = fwd - matmul - spent.get("attention", 0.0)
    print(f"| part | ms / step | share |\n|---|---|---|")
    for k, v in rows:
        print(f"| {k} | {v / steps * 1e3:.2f} | {v / wall:.0%} |")
    print(f"| other model ops (norms, rotary, silu, embedding, residuals) | {rest / steps * 1e3:.2f} | {rest / wall:.0%} |")
    eng = wall - fwd
    print(f"| engine outside the forward (scheduler, batch, sampling, detokenize) | {eng / steps * 1e3:.2f} | "
          f"{eng / wall:.0%} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
