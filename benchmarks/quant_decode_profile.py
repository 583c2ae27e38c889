"""Where one batch-1 decode step of the default model goes, by part, for a given weight format.

Runs the offline engine (``LLM``) over a ``--context``-token prompt (128) and ``--tokens`` greedy tokens, with
timers around each part, for the two decode paths of a packed model, interleaved in one process
(``--rounds`` rounds of each, so load changes hit both alike):

- ``layers``: layer by layer in Python, one linear-method call per matrix and torch ops between;
  timers around each linear-method call (by matrix) and the attention call;
- ``fused``: the native decode path (``tokenmill.layers.quant.fused_decode``), one call for all
  layers; its phase timers (``tokenmill._native.quant.decode_profile``) split that call.

Both: the output head is timed on its own (``fused``: its phase inside the call when the head is packed,
``FusedDecodeStack.set_head``); "rest of the forward" is the model forward minus the
parts (embedding lookup, rotary rows, final norm, Python glue); "engine" is the step wall time
minus the forward (scheduler, batch building, sampling, detokenizing). Prints milliseconds per
decode step and shares, the median round of each path.

    .venv/bin/python benchmarks/quant_decode_profile.py [--quantization auto] [--threads 1] [--rounds 3]
"""
from __future__ import annotations

import argparse
import collections
import os
import statistics
import time
from typing import Any

import torch


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quantization", default="auto")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--paths", default="layers,fused")
    ap.add_argument("--context", type=int, default=128, help="prompt tokens before the timed decode")
    args = ap.parse_args(argv)

    from tokenmill import LLM, SamplingParams
    from tokenmill._native import quant as native
    from tokenmill.layers.linear import LinearMethod
    from tokenmill.layers.quant.fused_decode import FusedDecodeStack

    torch.set_num_threads(args.threads)
    llm = LLM(quantization=args.quantization, num_threads=args.threads,
              kv_cache_tokens=max(4096, 2 * (args.context + args.tokens) + 512))
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
    # every native call of the fused path (run, and run_to_logits when the head joins it)
    FusedDecodeStack._run = timed("fused layers (one native call)", FusedDecodeStack._run)  # type: ignore[method-assign]
    model_forward = model.forward
    starts: list[float] = []   # start / end time of every single-row (decode) forward
    ends: list[float] = []

    def forward(ctx: Any, *a: Any, **k: Any) -> Any:
        decode = ctx.batch.input_ids.numel() == 1
        t = time.perf_counter()
        if decode:
            starts.append(t)
        counting[0] = decode and len(starts) > 1   # from the second decode step on
        try:
            return model_forward(ctx, *a, **k)
        finally:
            if counting[0]:
                spent["model forward (total)"] += time.perf_counter() - t
            if decode:
                ends.append(time.perf_counter())
            counting[0] = False

    model.forward = forward
    attn = llm.engine.runner.attn
    attn.forward = timed("attention", attn.forward)

    params = SamplingParams(max_tokens=args.tokens, temperature=0.0, ignore_eos=True)
    llm.generate([list(range(1000, 1128))], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    paths = args.paths.split(",")
    if "fused" in paths and (not hasattr(model, "set_fused_decode") or model.fused_decode_stack() is None):
        print("the fused decode path does not apply to this model/format; profiling layer by layer only")
        paths = [p for p in paths if p != "fused"]
    print(f"load average at start {os.getloadavg()[0]:.2f}; format {args.quantization}, {args.threads} thread(s), "
          f"kernel set {native.kernel()}")
    results: dict[str, list[tuple[float, dict[str, float]]]] = collections.defaultdict(list)
    prompt_base = 2000
    for r in range(args.rounds):
        for path in paths:
            if hasattr(model, "set_fused_decode"):
                model.set_fused_decode(path == "fused")
            spent.clear()
            starts.clear()
            ends.clear()
            if path == "fused":
                native.decode_profile(True)
            prompt_base += 7  # a fresh prompt each time (no prefix-cache hit)
            llm.generate([[(prompt_base + 31 * i) % 40000 + 100 for i in range(args.context)]], params)
            # decode steps 2..n counted: from the start of the 2nd decode forward to the end of the last
            wall = ends[-1] - starts[1]
            if path == "fused":
                for k, v in native.decode_profile(False).items():
                    spent[f"  in fused: {k}"] = v
            results[path].append((wall, dict(spent)))
    steps = args.tokens - 2   # decode forwards counted: all but the first (the first token is the prefill's)
    for path in paths:
        wall, sp = sorted(results[path], key=lambda x: x[0])[len(results[path]) // 2]
        rounds = [f"{steps / w:.1f}" for w, _ in results[path]]
        print(f"\n## path {path}: {steps / wall:.1f} tok/s, {wall / steps * 1e3:.2f} ms per decode step "
              f"(median round; rounds {', '.join(rounds)} tok/s)")
        fwd = sp.pop("model forward (total)", 0.0)
        parts = {k: v for k, v in sp.items() if not k.startswith("  in fused")}
        inner = {k: v for k, v in sp.items() if k.startswith("  in fused")}
        print("| part | ms / step | share |\n|---|---|---|")
        for k, v in sorted(parts.items(), key=lambda kv: -kv[1]):
            print(f"| {k} | {v / steps * 1e3:.2f} | {v / wall:.0%} |")
            if k.startswith("fused"):
                for k2, v2 in sorted(inner.items(), key=lambda kv: -kv[1]):
                    print(f"| {k2.strip()} | {v2 / steps * 1e3:.2f} | {v2 / wall:.0%} |")
                glue = v - sum(inner.values())
                print(f"| in fused: scratch, checks, call | {glue / steps * 1e3:.2f} | {glue / wall:.0%} |")
        rest = fwd - sum(parts.values())
        print(f"| rest of the forward (embedding, rotary rows, final norm, small torch ops, Python) | "
              f"{rest / steps * 1e3:.2f} | {rest / wall:.0%} |")
        eng = wall - fwd
        print(f"| engine outside the forward (scheduler, batch, sampling, detokenize) | {eng / steps * 1e3:.2f} | "
              f"{eng / wall:.0%} |")
    if len(paths) == 2:
        w = {p: statistics.median(x[0] for x in results[p]) for p in paths}
        print(f"\nfused / layers decode speed: {w['layers'] / w['fused']:.2f}x")
    print(f"load average at end {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
