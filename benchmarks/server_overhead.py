"""What the serving layers cost per token: the same workload run offline (``Engine.step()`` in a
plain loop), through AsyncEngine in-process (the engine thread and the event loop) and through
`tokenmill serve` with the openai client (streaming HTTP), side by side in one run.

    .venv/bin/python benchmarks/server_overhead.py [--model tiny|smollm2-135m-instruct|PATH]
        [--concurrency 16] [--prompt-tokens 128] [--output-tokens 64] [--rounds 2]
        [--quantization none] [--threads N] [--modes offline,offline-thread,inprocess,http]
        [--busy-process]

Prints output tokens/s, mean TTFT and the mean inter-token gap (at concurrency 1 this is the
TPOT) of each mode, and the ratios of each mode to offline. Each request uses its own random
prompt (no prefix sharing) and ignore_eos, so every mode does exactly the same engine work.
``--threads`` sets OMP_NUM_THREADS for the whole benchmark, and so for the server it starts;
GOMP_SPINCOUNT gets `tokenmill serve`'s default unless it is set. ``offline-thread`` is the
offline loop on a second thread (how OpenMP fares off the main thread), and ``--busy-process``
runs a busy-loop process beside every mode (one core taken by someone else, as on a shared box).

``--new-tokens N`` turns the prefix cache on and makes every round after the warm-up a follow-up
turn: request i's prompt is its prompt of the round before plus N new tokens, so its TTFT is that
of a cached-prefix request (the agentic case). The tokenizer's time to encode such a prompt as
text is printed too (the HTTP mode sends token ids, so it does not pay it).
"""
from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import NamedTuple


class RunResult(NamedTuple):
    wall_s: float
    output_tokens: int
    ttft_s: list[float]
    itl_s: list[float]

    @property
    def tok_s(self) -> float:
        return self.output_tokens / self.wall_s

    @property
    def itl(self) -> float:
        return statistics.mean(self.itl_s or [0.0])

    @property
    def ttft(self) -> float:
        return statistics.mean(self.ttft_s)

    def line(self, name: str) -> str:
        return (f"{name:>11}: {self.tok_s:8.1f} out tok/s  wall {self.wall_s:6.2f}s  "
                f"TTFT mean {1000 * self.ttft:7.1f} ms  ITL mean {1000 * self.itl:6.2f} ms  "
                f"ITL p50 {1000 * statistics.median(self.itl_s or [0.0]):6.2f} ms")


def prompts(n: int, length: int, seed: int, new_tokens: int = 0) -> list[list[int]]:
    """Round ``seed``'s prompts; with ``new_tokens``, round r extends round r-1's by that many."""
    if new_tokens:
        rng = random.Random(1234)
        return [[rng.randrange(100, 40000) for _ in range(length + seed * new_tokens)] for _ in range(n)]
    rng = random.Random(seed)
    return [[rng.randrange(100, 40000) for _ in range(length)] for _ in range(n)]


def run_offline(engine, batch: list[list[int]], out_tokens: int) -> RunResult:
    """The engine alone: add every request, then ``step()`` until all finished."""
    from tokenmill.contracts.sampling import SamplingParams

    ttft, itl = [], []
    t0 = time.perf_counter()
    last: dict[str, float] = {}
    for i, ids in enumerate(batch):
        engine.add_request(f"off-{time.time_ns()}-{i}", ids, SamplingParams(max_tokens=out_tokens, ignore_eos=True))
    n = 0
    while engine.has_unfinished_requests():
        outs = engine.step()
        now = time.perf_counter()
        for out in outs:
            if out.new_token_ids:
                prev = last.get(out.request_id)
                (ttft if prev is None else itl).append(now - (t0 if prev is None else prev))
                last[out.request_id] = now
            if out.finished:
                n += len(out.token_ids)
    return RunResult(time.perf_counter() - t0, n, ttft, itl)


async def run_inprocess(ae, batch: list[list[int]], out_tokens: int) -> RunResult:
    from tokenmill.contracts.sampling import SamplingParams

    ttft, itl = [], []

    async def one(i: int, ids: list[int]) -> int:
        t0 = time.perf_counter()
        last = None
        n = 0
        async for out in ae.generate(f"bench-{time.time_ns()}-{i}", ids,
                                     SamplingParams(max_tokens=out_tokens, ignore_eos=True)):
            now = time.perf_counter()
            if out.new_token_ids:
                if last is None:
                    ttft.append(now - t0)
                else:
                    itl.append(now - last)
                last = now
            n = len(out.token_ids)
        return n

    t0 = time.perf_counter()
    counts = await asyncio.gather(*(one(i, ids) for i, ids in enumerate(batch)))
    return RunResult(time.perf_counter() - t0, sum(counts), ttft, itl)


async def run_http(base_url: str, model: str, batch: list[list[int]], out_tokens: int) -> RunResult:
    import openai

    client = openai.AsyncOpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0, timeout=600)
    ttft, itl = [], []

    async def one(ids: list[int]) -> int:
        t0 = time.perf_counter()
        last = None
        n = 0
        stream = await client.completions.create(model=model, prompt=ids, max_tokens=out_tokens, stream=True,
                                                 extra_body={"ignore_eos": True, "return_token_ids": True})
        async for chunk in stream:
            now = time.perf_counter()
            if not chunk.choices:
                continue
            new = len(getattr(chunk.choices[0], "token_ids", None) or [])
            if new:
                if last is None:
                    ttft.append(now - t0)
                else:
                    itl.append(now - last)
                last = now
                n += new
        return n

    t0 = time.perf_counter()
    counts = await asyncio.gather(*(one(ids) for ids in batch))
    await client.close()
    return RunResult(time.perf_counter() - t0, sum(counts), ttft, itl)


def merge(rs: list[RunResult]) -> RunResult:
    return RunResult(sum(r.wall_s for r in rs), sum(r.output_tokens for r in rs),
                     [x for r in rs for x in r.ttft_s], [x for r in rs for x in r.itl_s])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--output-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--quantization", default=None, help="the engine's --quantization (default: its own)")
    ap.add_argument("--threads", type=int, default=None, help="OMP_NUM_THREADS for every mode")
    ap.add_argument("--modes", default="offline,inprocess,http")
    ap.add_argument("--busy-process", action="store_true", help="a busy-loop process runs beside every mode")
    ap.add_argument("--new-tokens", type=int, default=0,
                    help="prefix cache on; each round extends the last one's prompts by this many tokens")
    args = ap.parse_args()
    if args.threads is not None:
        os.environ["OMP_NUM_THREADS"] = str(args.threads)
    from tokenmill.cli import OMP_SPIN_COUNT

    os.environ.setdefault("GOMP_SPINCOUNT", OMP_SPIN_COUNT)   # what `tokenmill serve` runs with
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    tmp = tempfile.TemporaryDirectory()
    model = args.model
    if model == "tiny":
        from tokenmill.loader.tiny import build_tiny_checkpoint

        model = str(build_tiny_checkpoint(Path(tmp.name) / "tiny"))
    kv_tokens = max(16384, 2 * args.concurrency * (args.prompt_tokens + args.output_tokens))
    kv_tokens += 2 * args.concurrency * args.rounds * args.new_tokens
    cache = args.new_tokens > 0
    flags = ["--kv-cache-tokens", str(kv_tokens)] + ([] if cache else ["--no-prefix-cache"])
    extra = {}
    if args.quantization is not None:
        flags += ["--quantization", args.quantization]
        extra["quantization"] = args.quantization
    print(f"model={args.model} concurrency={args.concurrency} prompt={args.prompt_tokens} "
          f"output={args.output_tokens} rounds={args.rounds} quantization={args.quantization or 'default'} "
          f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')} "
          f"({f'prefix cache on, {args.new_tokens} new tokens per round' if cache else 'prefix cache off'})  "
          f"GOMP_SPINCOUNT={os.environ['GOMP_SPINCOUNT']}{'  busy process beside' if args.busy_process else ''}  "
          f"loadavg {open('/proc/loadavg').read().split()[0]}")

    def batch(r: int) -> list[list[int]]:
        return prompts(args.concurrency, args.prompt_tokens, r, args.new_tokens)

    results: dict[str, RunResult] = {}
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if args.busy_process else None
    try:
        tok = run_modes(args, modes, model, kv_tokens, cache, extra, flags, tmp, batch, results)
    finally:
        if busy is not None:
            busy.kill()
            busy.wait()
    report(args, cache, tok, batch, results)


def run_modes(args, modes, model, kv_tokens, cache, extra, flags, tmp, batch, results) -> object:
    """Fill ``results`` with each mode's merged rounds; return the engine's tokenizer (or None)."""
    from tokenmill.engine.async_engine import AsyncEngine
    from tokenmill.engine.config import EngineConfig
    from tokenmill.engine.engine import Engine
    from tokenmill.utils.proc import ServiceProcess

    tok = None
    if any(m in modes for m in ("offline", "offline-thread", "inprocess")):
        engine = Engine(EngineConfig(model=model, kv_cache_tokens=kv_tokens, enable_prefix_cache=cache, **extra))
        tok = engine.tokenizer
        if "offline" in modes:
            results["offline"] = merge([res for r in range(args.rounds + 1)   # round 0 warms up
                                        if (res := run_offline(engine, batch(r), args.output_tokens)) and r])
        if "offline-thread" in modes:
            if cache:
                engine.flush_cache()
            done: list[RunResult] = []
            worker = threading.Thread(target=lambda: done.append(merge(
                [res for r in range(args.rounds + 1) if (res := run_offline(engine, batch(r), args.output_tokens))
                 and r])))
            worker.start()
            worker.join()
            results["off-thread"] = done[0]
        if "inprocess" in modes:
            if cache:
                engine.flush_cache()   # the offline rounds must not have warmed it
            ae = AsyncEngine(engine)
            results["in-process"] = merge([res for r in range(args.rounds + 1)
                                           if (res := asyncio.run(run_inprocess(ae, batch(r), args.output_tokens)))
                                           and r])
            ae.shutdown()
        del engine

    if "http" in modes:
        with ServiceProcess(["serve", "--model", model, "--served-model-name", "m", *flags],
                            log_path=Path(tmp.name) / "server.log", start_timeout=600) as proc:
            results["HTTP"] = merge([res for r in range(args.rounds + 1)
                                     if (res := asyncio.run(run_http(proc.base_url, "m", batch(r),
                                                                     args.output_tokens))) and r])
    return tok


def report(args, cache, tok, batch, results) -> None:
    if cache and tok is not None:
        text = tok.decode(batch(args.rounds)[0])
        t0 = time.perf_counter()
        for _ in range(20):
            tok.encode(text, add_special_tokens=False)
        print(f"tokenizing one last-round prompt as text ({len(text)} chars): "
              f"{1000 * (time.perf_counter() - t0) / 20:.2f} ms")
    for name, res in results.items():
        print(res.line(name))
    base_name = next(iter(results))
    base = results[base_name]
    for name, res in results.items():
        if name != base_name:
            print(f"{name} / {base_name}: throughput {res.tok_s / base.tok_s:.3f}  "
                  f"ITL {res.itl / base.itl if base.itl else float('nan'):.3f}  "
                  f"TTFT {res.ttft / base.ttft:.3f}")
    print(f"loadavg at the end {open('/proc/loadavg').read().split()[0]}")


if __name__ == "__main__":
    main()
