"""Single-stream decode speed against context length: tokenmill and vLLM's CPU build, one run.

For each context length L, each system gets a fresh random prompt of L token ids (no prefix
reuse), then streams ``--output-tokens`` tokens with ``ignore_eos``. Decode tok/s is measured
between the first and the last streamed token, so it excludes the prefill; TTFT is reported
beside it. Both servers load the same fp32 HF directory of SmolLM2-135M-Instruct whose
``max_position_embeddings`` is raised to fit the longest context (the weights are untouched;
past its trained length the model's text is meaningless, but the work per token is the same,
and only speed is measured here).

    .venv/bin/python benchmarks/long_context.py                       # 512, 4096, 16384
    .venv/bin/python benchmarks/long_context.py --contexts 512,4096,16384,32768 --systems tokenmill,vllm
    .venv/bin/python benchmarks/long_context.py --systems tokenmill --kv-cache-dtypes fp32,fp8_e4m3 --threads 1

``--kv-cache-dtypes`` runs tokenmill once per KV dtype (``--kv-cache-dtype`` of ``tokenmill
serve``); the first is reported as ``tokenmill`` (compared with vLLM, which keeps its default
KV), the others as ``tokenmill-<dtype>``.

All servers are started first and each length is measured on each system in turn
(``--sequential``: one server after another, the method of the runs before the seventh landing).

``--rounds N`` sends every prompt N times, lengths in turn each round: after the first round the
prompts are prefix-cache hits (the servers' pools hold them all), so a round costs only its
decodes. The decode rate reported per length is the median of its rounds, TTFT the first round's
(the cold prefill), and each round also gives its own 16k / 512 ratio from decodes measured a few
seconds apart (this machine's speed moves by 1.5x over minutes, which single measurements of
each length, minutes apart, carry into the ratio).

Prints a table, the ratios tokenmill / vLLM at each length, and each system's rate at every
length relative to its own rate at the shortest one.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from peers import PeerNotInstalled, PeerStartError, default_hf_dir, peers_dir, start_vllm  # noqa: E402

from tokenmill.utils.proc import ServiceProcess  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def long_hf_dir(max_len: int) -> Path:
    """A copy of the peers' HF directory (weights linked, not copied) with a longer context."""
    src = default_hf_dir()
    if not (src / "config.json").exists():
        raise PeerNotInstalled(f"{src} missing: run `benchmarks/agentic_vs_peers.sh install hfdir`")
    dst = peers_dir() / f"smollm2-135m-instruct-hf-{max_len}"
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        target = dst / f.name
        if f.name == "config.json":
            cfg = json.loads(f.read_text())
            cfg["max_position_embeddings"] = max_len
            target.write_text(json.dumps(cfg, indent=2))
        elif not target.exists():
            os.symlink(f.resolve(), target) if f.is_file() else shutil.copytree(f, target)
    return dst.resolve()


def measure(base_url: str, model: str, prompt: list[int], output_tokens: int) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": output_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True}
    t0 = time.perf_counter()
    stamps: list[float] = []
    with httpx.stream("POST", base_url + "/v1/completions", json=body, timeout=3600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if any(c.get("text") for c in chunk.get("choices", [])):
                stamps.append(time.perf_counter())
    if len(stamps) < 2:
        raise RuntimeError(f"{base_url}: only {len(stamps)} streamed chunks")
    return {"ttft_s": stamps[0] - t0, "decode_tok_s": (len(stamps) - 1) / (stamps[-1] - stamps[0]),
            "chunks": len(stamps)}


def start_system(name: str, model_dir: Path, max_len: int, args, kv_dtype: str = "fp32", pool_tokens: int = 0):
    """Start one server; returns (base_url, model name, stop). ``pool_tokens``: tokenmill's KV pool
    (at least max_len + 256)."""
    if name == "tokenmill":
        argv = ["serve", "--model", str(model_dir), "--served-model-name", "m", "--max-model-len", str(max_len),
                "--kv-cache-tokens", str(max(max_len + 256, pool_tokens)), "--threads", str(args.threads),
                "--kv-cache-dtype", kv_dtype]
        srv = ServiceProcess(argv, start_timeout=600, log_path=ROOT / "out" / f"long_context_tokenmill_{kv_dtype}.log")
        srv.start()
        return srv.base_url, "m", srv.stop
    srv = start_vllm(model_dir=model_dir, max_model_len=max_len, threads=args.threads, kv_cache_gb=4, served_name="m")
    return srv.base_url, "m", srv.stop


def run_all(systems: list[tuple[str, str, str]], model_dir: Path, contexts: list[int], args) -> dict[str, dict[int, dict]]:
    """``systems``: (result name, system, KV dtype). Interleaved (the default): every server is
    started first, then each context length is measured on each system in turn, so a drift of
    this machine's speed over the minutes of a run (it moves by 1.5x and more) falls on all of
    them alike; only the measured server is busy at any time. ``--sequential``: one server at a
    time, all lengths, then the next (the method of the earlier runs)."""
    max_len = max(contexts) + args.output_tokens + 64
    # with rounds, the pool keeps every prompt cached, with room for each round's outputs
    pool = 0 if args.rounds <= 1 else sum(contexts) + (len(contexts) * args.rounds + 2) * (args.output_tokens + 64) + 1024
    rng = random.Random(args.seed)
    prompts = {L: [rng.randrange(100, 49000) for _ in range(L)] for L in contexts}
    warm = [rng.randrange(100, 49000) for _ in range(64)]
    out: dict[str, dict[int, dict]] = {}
    groups = [systems] if not args.sequential else [[s] for s in systems]
    for group in groups:
        live: dict[str, tuple] = {}
        try:
            for name, system, dt in group:
                try:
                    live[name] = start_system(system, model_dir, max_len, args, dt, pool)
                except (PeerNotInstalled, PeerStartError) as e:
                    print(f"[{name}] skipped: {e}", flush=True)
                    continue
                measure(live[name][0], live[name][1], warm, 8)   # warm-up
                out[name] = {}
            for rnd in range(args.rounds):
                for L in contexts:
                    for name, (base, model, _) in live.items():
                        r = measure(base, model, prompts[L], args.output_tokens)
                        out[name].setdefault(L, []).append(r)
                        print(f"[{name}] {f'round {rnd + 1}, ' if args.rounds > 1 else ''}context {L}: decode "
                              f"{r['decode_tok_s']:.2f} tok/s, TTFT {r['ttft_s']:.1f} s, "
                              f"load {open('/proc/loadavg').read().split()[0]}", flush=True)
        finally:
            for _, _, stop in live.values():
                stop()
    # per length: the median decode rate of the rounds, the first round's TTFT, and every round
    return {name: {L: {"decode_tok_s": statistics.median(r["decode_tok_s"] for r in runs), "ttft_s": runs[0]["ttft_s"],
                       "rounds": runs} for L, runs in per.items()} for name, per in out.items()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--contexts", default="512,4096,16384")
    ap.add_argument("--systems", default="tokenmill,vllm")
    ap.add_argument("--output-tokens", type=int, default=48)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--kv-cache-dtypes", default="fp32",
                    help="comma-separated KV dtypes tokenmill runs with, one server each (fp32, bf16, fp16, fp8_e4m3, int8)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rounds", type=int, default=1,
                    help="send every prompt this many times, lengths in turn (rounds after the first are prefix-cache hits)")
    ap.add_argument("--sequential", action="store_true",
                    help="one server at a time, every length, then the next (default: all servers up, lengths interleaved)")
    ap.add_argument("--out", default=str(ROOT / "out" / "long_context.json"))
    args = ap.parse_args()
    contexts = [int(x) for x in args.contexts.split(",")]
    (ROOT / "out").mkdir(exist_ok=True)
    model_dir = long_hf_dir(max(contexts) + args.output_tokens + 64)
    print(f"load average at start: {open('/proc/loadavg').read().split()[:3]}", flush=True)
    dtypes = args.kv_cache_dtypes.split(",")
    systems = [(system if i == 0 else f"{system}-{dt}", system, dt)
               for system in args.systems.split(",")
               for i, dt in enumerate(dtypes if system == "tokenmill" else ["fp32"])]
    results = run_all(systems, model_dir, contexts, args)
    print(f"load average at end: {open('/proc/loadavg').read().split()[:3]}")
    Path(args.out).write_text(json.dumps({k: {str(L): v for L, v in r.items()} for k, r in results.items()}, indent=2))
    names = list(results)
    print("\n| context | " + " | ".join(f"{n} decode tok/s | {n} TTFT s" for n in names) +
          (" | tokenmill / vllm decode | tokenmill / vllm TTFT |" if {"tokenmill", "vllm"} <= set(names) else " |"))
    for L in contexts:
        row = [f"{results[n][L]['decode_tok_s']:.2f} | {results[n][L]['ttft_s']:.1f}" for n in names]
        ratio = ""
        if {"tokenmill", "vllm"} <= set(names):
            tm, vl = results["tokenmill"][L], results["vllm"][L]
            ratio = f" {tm['decode_tok_s'] / vl['decode_tok_s']:.2f}x | {tm['ttft_s'] / vl['ttft_s']:.2f}x |"
        print(f"| {L} | " + " | ".join(row) + " |" + ratio)
    for n in names:
        base = results[n][contexts[0]]["decode_tok_s"]
        rel = ", ".join(f"{L}: {results[n][L]['decode_tok_s'] / base:.2f}x" for L in contexts)
        print(f"{n}: decode rate relative to its own {contexts[0]}-token rate: {rel}")
        if args.rounds > 1:   # each round's ratio, from decodes measured seconds apart
            for L in contexts[1:]:
                per = [a["decode_tok_s"] / b["decode_tok_s"] for a, b in zip(results[n][L]["rounds"], results[n][contexts[0]]["rounds"])]
                print(f"{n}: {L} / {contexts[0]} by round: {', '.join(f'{x:.2f}x' for x in per)} "
                      f"(median {statistics.median(per):.2f}x)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
