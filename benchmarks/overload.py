"""Load held: offer 1x, 2x and 4x the measured capacity, open loop, and see what admission control keeps.

    .venv/bin/python benchmarks/overload.py [--model smollm2-135m-instruct|tiny|PATH]
        [--concurrency 8] [--prompt-tokens 64] [--output-tokens 32] [--measure-s 20] [--level-s 30]
        [--setups single,router] [--queue-wait-s W]

Setups: ``single`` is one ``tokenmill serve``; ``router`` is two replicas behind ``tokenmill route``.
Each replica runs with ``--max-running-requests C --max-waiting-requests C`` (C = ``--concurrency``)
and a queue-wait limit ``--max-queue-wait-s W``: the engine refuses (429 ``predicted_wait``) a
request that, at the rate running requests have been finishing, would not start within W seconds,
so admitted requests wait about W at most whatever the load. W is ``--queue-wait-s``, or by
default the mean latency of one request at capacity (one completion's time: an admitted request
waits for at most about one request ahead of it to finish).

1. Capacity: C closed-loop clients (C per replica) for ``--measure-s``; capacity = completed req/s,
   and the mean request latency gives W. The replicas are then restarted with that W.
2. For each factor in 1x, 2x, 4x: Poisson arrivals at factor x capacity for ``--level-s``, every
   request a streamed completion of ``--output-tokens`` tokens (ignore_eos), each on a fresh
   random prompt (no prefix-cache help).

Per level it prints: offered req/s, goodput (completed req/s and output tok/s), the 429 and 503
rates, other 5xx, and p50/p99 TTFT of the admitted (completed) requests; then the aims: no 5xx
at any load (503 queue timeouts included); admitted p99 TTFT at 4x within 2x of 1x; goodput at
4x >= 90% of 1x. Exit status 0 when all are met.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import time
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import httpx

from tokenmill.utils.proc import ServiceProcess


@dataclass
class Result:
    status: int
    ttft: float | None
    tokens: int
    latency: float


def prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(1000, 30000) for _ in range(n)]


async def one(client: httpx.AsyncClient, rng: random.Random, args: argparse.Namespace) -> Result:
    body = {"model": "m", "prompt": prompt(rng, args.prompt_tokens), "max_tokens": args.output_tokens,
            "ignore_eos": True, "stream": True}
    t0 = time.monotonic()
    ttft = None
    tokens = 0
    try:
        async with client.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code != 200:
                await r.aread()
                return Result(r.status_code, None, 0, time.monotonic() - t0)
            async for line in r.aiter_lines():
                if not line.startswith("data:") or line.endswith("[DONE]"):
                    continue
                chunk = json.loads(line[5:])
                if "error" in chunk:
                    return Result(590, ttft, tokens, time.monotonic() - t0)   # error event mid-stream
                if chunk["choices"] and chunk["choices"][0]["text"]:
                    if ttft is None:
                        ttft = time.monotonic() - t0
                    tokens += 1
    except httpx.HTTPError:
        return Result(599, ttft, tokens, time.monotonic() - t0)
    return Result(200, ttft, tokens, time.monotonic() - t0)


async def closed_loop(base: str, clients: int, seconds: float, args: argparse.Namespace) -> tuple[float, float]:
    """Completed requests per second, and their mean latency in seconds."""
    latencies: list[float] = []
    stop = time.monotonic() + seconds

    async def loop(seed: int) -> None:
        rng = random.Random(seed)
        async with httpx.AsyncClient(base_url=base, timeout=300) as c:
            while time.monotonic() < stop:
                r = await one(c, rng, args)
                if r.status == 200:
                    latencies.append(r.latency)

    t0 = time.monotonic()
    await asyncio.gather(*(loop(i) for i in range(clients)))
    mean = sum(latencies) / len(latencies) if latencies else float("nan")
    return len(latencies) / (time.monotonic() - t0), mean


async def open_loop(base: str, rate: float, seconds: float, args: argparse.Namespace, seed: int) -> list[Result]:
    rng = random.Random(seed)
    tasks: list[asyncio.Task[Result]] = []
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=512)
    async with httpx.AsyncClient(base_url=base, timeout=300, limits=limits) as c:
        t = time.monotonic()
        stop = t + seconds
        while True:
            t += rng.expovariate(rate)
            if t >= stop:
                break
            await asyncio.sleep(max(0.0, t - time.monotonic()))
            tasks.append(asyncio.create_task(one(c, random.Random(rng.random()), args)))
        return list(await asyncio.gather(*tasks))


def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))] if s else float("nan")


def summarize(results: list[Result], seconds: float) -> dict[str, float]:
    ok = [r for r in results if r.status == 200]
    n = max(len(results), 1)
    ttfts = [r.ttft for r in ok if r.ttft is not None]
    return {"offered_rps": len(results) / seconds, "goodput_rps": len(ok) / seconds,
            "goodput_tok_s": sum(r.tokens for r in ok) / seconds,
            "rate_429": sum(r.status == 429 for r in results) / n, "rate_503": sum(r.status == 503 for r in results) / n,
            "other_5xx": float(sum(r.status >= 500 and r.status != 503 for r in results)),
            "ttft_p50_s": pct(ttfts, 0.5), "ttft_p99_s": pct(ttfts, 0.99), "requests": float(len(results))}


def replica_argv(model: str, c: int, queue_wait_s: float) -> list[str]:
    return ["serve", "--model", model, "--served-model-name", "m", "--max-running-requests", str(c),
            "--max-waiting-requests", str(c), "--max-queue-wait-s", f"{queue_wait_s:.3f}",
            "--kv-cache-tokens", "32768", "--log-level", "warning"]


def start(stack: ExitStack, name: str, model: str, args: argparse.Namespace, out: Path, queue_wait_s: float,
          tag: str) -> str:
    """Start the setup's replicas (and router); return the base URL clients use."""
    replicas = 1 if name == "single" else 2
    procs = [ServiceProcess(replica_argv(model, args.concurrency, queue_wait_s), env={"OMP_NUM_THREADS": "1"},
                            log_path=out / f"{name}-{tag}-replica{i}.log", start_timeout=600) for i in range(replicas)]
    for p in procs:
        stack.enter_context(p)
    if name != "router":
        return procs[0].base_url
    argv = ["route", "--log-level", "warning", "--health-interval", "0.5"]
    for p in procs:
        argv += ["--replica", p.base_url]
    return stack.enter_context(ServiceProcess(argv, log_path=out / f"router-{tag}.log")).base_url


def run_setup(name: str, model: str, args: argparse.Namespace, out: Path) -> dict:
    replicas = 1 if name == "single" else 2
    with ExitStack() as stack:
        base = start(stack, name, model, args, out, 600.0, "capacity")
        asyncio.run(closed_loop(base, 2 * replicas, 5, args))          # warm-up
        capacity, latency = asyncio.run(closed_loop(base, args.concurrency * replicas, args.measure_s, args))
    queue_wait = args.queue_wait_s if args.queue_wait_s is not None else latency
    print(f"[{name}] capacity {capacity:.2f} req/s with {args.concurrency * replicas} closed-loop clients, "
          f"mean latency {latency:.2f} s; queue-wait limit {queue_wait:.2f} s", flush=True)
    if capacity <= 0:
        raise SystemExit(f"[{name}] no request completed while measuring capacity; see the logs in {out}")
    with ExitStack() as stack:
        base = start(stack, name, model, args, out, queue_wait, "levels")
        asyncio.run(closed_loop(base, 2 * replicas, 5, args))          # warm-up (and finish history)
        levels = {}
        for factor in (1, 2, 4):
            res = asyncio.run(open_loop(base, capacity * factor, args.level_s, args, seed=factor))
            s = summarize(res, args.level_s)
            levels[f"{factor}x"] = s
            print(f"[{name}] {factor}x: offered {s['offered_rps']:.2f} req/s  goodput {s['goodput_rps']:.2f} req/s "
                  f"({s['goodput_tok_s']:.0f} tok/s)  429 {100 * s['rate_429']:.0f}%  503 {100 * s['rate_503']:.0f}%  "
                  f"other 5xx {s['other_5xx']:.0f}  TTFT p50 {1000 * s['ttft_p50_s']:.0f} ms  "
                  f"p99 {1000 * s['ttft_p99_s']:.0f} ms", flush=True)
    one_x, four_x = levels["1x"], levels["4x"]
    aims = {
        "no 5xx at any load": all(v["other_5xx"] == 0 and v["rate_503"] == 0 for v in levels.values()),
        "p99 TTFT at 4x <= 2x of 1x": four_x["ttft_p99_s"] <= 2 * one_x["ttft_p99_s"],
        "goodput at 4x >= 90% of 1x": four_x["goodput_rps"] >= 0.9 * one_x["goodput_rps"],
    }
    ratio_ttft = four_x["ttft_p99_s"] / one_x["ttft_p99_s"]
    ratio_good = four_x["goodput_rps"] / max(one_x["goodput_rps"], 1e-9)
    print(f"[{name}] 4x/1x: p99 TTFT x{ratio_ttft:.2f}  goodput x{ratio_good:.2f}")
    for k, ok in aims.items():
        print(f"[{name}] {'MET ' if ok else 'MISS'} {k}")
    return {"capacity_rps": capacity, "capacity_latency_s": latency, "queue_wait_s": queue_wait,
            "levels": levels, "aims": aims, "ttft_p99_ratio": ratio_ttft, "goodput_ratio": ratio_good}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--output-tokens", type=int, default=32)
    ap.add_argument("--measure-s", type=float, default=20.0)
    ap.add_argument("--level-s", type=float, default=30.0)
    ap.add_argument("--setups", default="single,router")
    ap.add_argument("--queue-wait-s", type=float, default=None,
                    help="the replicas' --max-queue-wait-s (default: the mean request latency at capacity)")
    ap.add_argument("--out", default="overload-out")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model
        if model == "tiny":
            from tokenmill.loader.tiny import build_tiny_checkpoint

            model = str(build_tiny_checkpoint(Path(tmp) / "tiny"))
        results = {name: run_setup(name, model, args, out) for name in args.setups.split(",")}
    (out / "overload.json").write_text(json.dumps(results, indent=1))
    return 0 if all(all(r["aims"].values()) for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
