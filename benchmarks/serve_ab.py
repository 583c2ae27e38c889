"""Two `tokenmill serve` builds side by side: this checkout and another one's ``src`` tree.

Both servers are up at once (same model, same flags), and single-stream streamed completions
alternate between them (the order reversed every other rep), so a change of load on this shared
machine falls on both alike. Prints each build's decode tok/s per rep, the medians and their ratio.
Decode tok/s = (streamed chunks - 1) / (last chunk - first chunk), as quant_vs_llamacpp.py measures it.

The other build: ``git worktree add /tmp/base <commit>`` and copy this checkout's built native
modules (``src/tokenmill/_native/*.so``) into it when its C sources are the same, or build them there
(``python setup.py build_ext --inplace``); its ``src`` goes first on that server's PYTHONPATH.

    .venv/bin/python benchmarks/serve_ab.py --baseline-src /tmp/base/src [--threads 1] [--reps 6]
        [--max-tokens 200] [--context 0] [--serve-args "--quantization auto"]
"""
from __future__ import annotations

import argparse
import os
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

from tokenmill.utils.proc import free_port  # noqa: E402

MODEL = "smollm2-135m-instruct"


def start(src: str | None, threads: int, extra: list[str]) -> tuple[subprocess.Popen, str]:
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    if src:
        env["PYTHONPATH"] = src + os.pathsep + env.get("PYTHONPATH", "")
    argv = [sys.executable, "-m", "tokenmill.cli", "serve", "--port", str(port), "--threads", str(threads),
            "--log-level", "warning", *extra]
    return subprocess.Popen(argv, env=env), f"http://127.0.0.1:{port}"


def wait_ready(proc: subprocess.Popen, base: str, timeout: float = 600.0) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise RuntimeError(f"server {base} exited with {proc.returncode}")
        try:
            if httpx.get(base + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise TimeoutError(f"server {base} not healthy after {timeout:.0f} s")


def decode_rate(base: str, max_tokens: int, tag: str, context: int = 0) -> float:
    filler = " cat" * context   # about one token each
    body = {"model": MODEL, "prompt": f"{filler}Write a long story about a cat named {tag}.", "max_tokens": max_tokens,
            "temperature": 0.0, "ignore_eos": True, "stream": True}
    first = last = None
    chunks = 0
    with httpx.stream("POST", base + "/v1/completions", json=body, timeout=900) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data:") and '"text"' in line:
                now = time.perf_counter()
                chunks += 1
                first = first if first is not None else now
                last = now
    if first is None or last is None or last <= first:
        raise RuntimeError("no streamed tokens")
    return (chunks - 1) / (last - first)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--baseline-src", required=True, help="the other checkout's src directory")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--reps", type=int, default=6)
    ap.add_argument("--max-tokens", type=int, default=200)
    ap.add_argument("--context", type=int, default=0, help="about this many tokens of prompt before the decode")
    ap.add_argument("--serve-args", default="", help="extra flags for both servers")
    args = ap.parse_args(argv)
    if not Path(args.baseline_src, "tokenmill").is_dir():
        ap.error(f"{args.baseline_src} holds no tokenmill package")
    extra = shlex.split(args.serve_args)
    servers = {"baseline": start(args.baseline_src, args.threads, extra), "this checkout": start(None, args.threads, extra)}
    try:
        for proc, base in servers.values():
            wait_ready(proc, base)
        for _, base in servers.values():   # warm-up
            decode_rate(base, 16, "warm-up")
        rates: dict[str, list[float]] = {name: [] for name in servers}
        print(f"load average {os.getloadavg()[0]:.2f}; {args.threads} thread(s), {args.max_tokens} tokens per stream "
              f"after about {args.context} tokens of prompt")
        for rep in range(args.reps):
            names = list(servers) if rep % 2 == 0 else list(reversed(servers))
            for name in names:
                rates[name].append(decode_rate(servers[name][1], args.max_tokens, f"{rep}-{name}", args.context))
        for name, v in rates.items():
            print(f"{name}: {', '.join(f'{x:.1f}' for x in v)} tok/s; median {statistics.median(v):.1f}")
        ratio = statistics.median(rates["this checkout"]) / statistics.median(rates["baseline"])
        paired = [a / b for a, b in zip(rates["this checkout"], rates["baseline"])]
        print(f"this checkout / baseline: {ratio:.2f}x (paired {min(paired):.2f}x to {max(paired):.2f}x); "
              f"load average at the end {os.getloadavg()[0]:.2f}")
    finally:
        for proc, _ in servers.values():
            proc.terminate()
        for proc, _ in servers.values():
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
