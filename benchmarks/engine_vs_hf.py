"""tokenmill engine vs HF transformers ``generate`` on SmolLM2-135M-Instruct (same fp32 weights).

Measures, in one run:
  * single-stream decode tokens/s (prefill excluded),
  * prefill tokens/s on a 1,000-token prompt,
  * total throughput for 32 requests of 256 input / 64 output tokens
    (HF one request at a time; tokenmill all of them concurrently),
  * memory bandwidth (large tensor copy) and the decode bound = bandwidth / fp32 weight bytes,
  * where the time of one decode step goes (torch.profiler + engine-side timers).

    .venv/bin/python benchmarks/engine_vs_hf.py [--decode-tokens 128] [--hf-requests 32] [--threads N]
"""
from __future__ import annotations

import argparse
import json
import random
import time
from typing import Any

import torch

from tokenmill import LLM, SamplingParams
from tokenmill.loader import build_hf_reference, load_model


def measure_bandwidth(num_bytes: int = 1 << 29, repeats: int = 5) -> float:
    """Bytes/s of a large tensor copy (read + write both counted)."""
    src = torch.ones(num_bytes // 4, dtype=torch.float32)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t)
    return 2 * num_bytes / best


def weight_bytes(model: torch.nn.Module) -> int:
    seen: set[int] = set()
    total = 0
    for p in list(model.parameters()) + list(model.buffers()):
        if p.data_ptr() in seen or not p.is_floating_point():
            continue
        seen.add(p.data_ptr())
        total += p.numel() * p.element_size()
    return total


def prompt_ids(n: int, seed: int, vocab: int = 49152) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, vocab - 100) for _ in range(n)]


@torch.no_grad()
def hf_generate_time(ref: Any, ids: list[int], new_tokens: int) -> float:
    x = torch.tensor([ids])
    t = time.perf_counter()
    out = ref.generate(x, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
    dt = time.perf_counter() - t
    assert out.shape[1] == len(ids) + new_tokens
    return dt


def tm_decode_rate(llm: LLM, ids: list[int], new_tokens: int) -> tuple[float, dict[str, float]]:
    """Decode tokens/s of one stream (steps after the first), and a per-step time breakdown."""
    eng = llm.engine
    timers = {"forward": 0.0, "sample": 0.0}
    model = eng.runner.model
    sampler = eng.runner.sampler
    orig_fwd, orig_sample = model.forward, sampler.__call__

    def timed_forward(*a: Any, **k: Any) -> Any:
        t = time.perf_counter()
        r = orig_fwd(*a, **k)
        timers["forward"] += time.perf_counter() - t
        return r

    class TimedSampler:
        def __call__(self, *a: Any, **k: Any) -> Any:
            t = time.perf_counter()
            r = orig_sample(*a, **k)
            timers["sample"] += time.perf_counter() - t
            return r

    model.forward = timed_forward  # type: ignore[method-assign]
    eng.runner.sampler = TimedSampler()  # type: ignore[assignment]
    try:
        eng.add_request("decode", ids, SamplingParams(max_tokens=new_tokens + 1, temperature=0.0, ignore_eos=True))
        eng.step()  # prefill + first token
        timers.update(forward=0.0, sample=0.0)
        steps = 0
        t = time.perf_counter()
        while eng.has_unfinished_requests():
            eng.step()
            steps += 1
        dt = time.perf_counter() - t
    finally:
        model.forward = orig_fwd  # type: ignore[method-assign]
        eng.runner.sampler = sampler
    per_step = {k: v / steps * 1e3 for k, v in timers.items()}
    per_step["step_total"] = dt / steps * 1e3
    per_step["engine_overhead"] = per_step["step_total"] - per_step["forward"] - per_step["sample"]
    return steps / dt, per_step


def tm_prefill_rate(llm: LLM, ids: list[int], repeats: int = 3) -> float:
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        llm.generate([ids], SamplingParams(max_tokens=1, temperature=0.0))
        best = min(best, time.perf_counter() - t)
    return len(ids) / best


def profile_decode_step(llm: LLM, ids: list[int]) -> str:
    from torch.profiler import ProfilerActivity, profile

    eng = llm.engine
    eng.add_request("prof", ids, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    eng.step()
    eng.step()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        eng.step()
    while eng.has_unfinished_requests():
        eng.step()
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--decode-tokens", type=int, default=128)
    ap.add_argument("--prefill-tokens", type=int, default=1000)
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--hf-requests", type=int, default=32,
                    help="HF requests actually run one at a time (fewer: the rest is extrapolated)")
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    ap.add_argument("--json", default=None, help="also write the numbers here")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")

    lm = load_model(args.model)
    ref = build_hf_reference(lm).eval()
    wbytes = weight_bytes(lm.model)
    bw = measure_bandwidth()
    bound = bw / wbytes
    print(f"memory bandwidth {bw / 1e9:.1f} GB/s; fp32 weights {wbytes / 1e6:.0f} MB; "
          f"decode bound {bound:.1f} tok/s")

    llm = LLM(loaded=lm, kv_cache_tokens=32768, max_batch_tokens=2048, max_running_requests=64,
              enable_prefix_cache=False)
    r: dict[str, Any] = {"bandwidth_gbs": bw / 1e9, "weight_mb": wbytes / 1e6, "bound_tok_s": bound}

    # warm-up both
    short = prompt_ids(16, 0)
    llm.generate([short], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    hf_generate_time(ref, short, 4)

    # 1. single-stream decode
    n = args.decode_tokens
    tm_dec, breakdown = tm_decode_rate(llm, short, n)
    hf_dec = n / (hf_generate_time(ref, short, n + 1) - hf_generate_time(ref, short, 1))
    r.update(tm_decode=tm_dec, hf_decode=hf_dec, decode_breakdown_ms=breakdown)
    print(f"decode  tokenmill {tm_dec:6.1f} tok/s | HF {hf_dec:6.1f} tok/s | ratio {tm_dec / hf_dec:.2f}x | "
          f"{100 * tm_dec / bound:.0f}% of bound")
    print("        tokenmill step (ms): " + ", ".join(f"{k} {v:.2f}" for k, v in breakdown.items()))

    # 2. prefill
    long = prompt_ids(args.prefill_tokens, 1)
    tm_pre = tm_prefill_rate(llm, long)
    hf_pre = len(long) / min(hf_generate_time(ref, long, 1) for _ in range(2))
    r.update(tm_prefill=tm_pre, hf_prefill=hf_pre)
    print(f"prefill tokenmill {tm_pre:6.0f} tok/s | HF {hf_pre:6.0f} tok/s | ratio {tm_pre / hf_pre:.2f}x "
          f"({len(long)}-token prompt)")

    # 3. throughput: N requests of input_len / output_len
    prompts = [prompt_ids(args.input_len, 100 + i) for i in range(args.requests)]
    p = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    t = time.perf_counter()
    outs = llm.generate(prompts, p)
    tm_time = time.perf_counter() - t
    assert all(len(o.token_ids) == args.output_len for o in outs)
    k = min(args.hf_requests, args.requests)
    hf_times = [hf_generate_time(ref, prompts[i], args.output_len) for i in range(k)]
    hf_time = sum(hf_times) / k * args.requests
    out_tokens = args.requests * args.output_len
    r.update(tm_batch_s=tm_time, hf_batch_s=hf_time, hf_batch_measured=k,
             tm_batch_out_tok_s=out_tokens / tm_time, hf_batch_out_tok_s=out_tokens / hf_time)
    extra = "" if k == args.requests else f" (HF: {k} run, extrapolated to {args.requests})"
    print(f"batch   {args.requests} x {args.input_len} in / {args.output_len} out: tokenmill {tm_time:.1f} s "
          f"({out_tokens / tm_time:.1f} out tok/s) | HF sequential {hf_time:.1f} s "
          f"({out_tokens / hf_time:.1f} out tok/s) | ratio {hf_time / tm_time:.2f}x{extra}")

    # 4. where one decode step goes
    print("\nprofile of one single-stream decode step (self CPU time):")
    print(profile_decode_step(llm, short))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(r, f, indent=2)
    print(json.dumps({k: (round(v, 3) if isinstance(v, float) else v) for k, v in r.items()
                      if not isinstance(v, dict)}))


if __name__ == "__main__":
    main()
