"""What the HTTP layer costs: the same workload through AsyncEngine in-process and through
`tokenmill serve` with the openai client (streaming), side by side in one run.

    .venv/bin/python benchmarks/server_overhead.py [--model tiny|smollm2-135m-instruct|PATH]
        [--concurrency 16] [--prompt-tokens 128] [--output-tokens 64] [--rounds 2]

Prints output tokens/s, mean TTFT and mean inter-token gap for both, and the ratio HTTP / in-process.
Each request uses its own random prompt (no prefix sharing) and ignore_eos, so both sides do
exactly the same engine work.
"""
from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import NamedTuple


class RunResult(NamedTuple):
    wall_s: float
    output_tokens: int
    ttft_s: list[float]
    itl_s: list[float]

    def line(self, name: str) -> str:
        return (f"{name:>11}: {self.output_tokens / self.wall_s:8.1f} out tok/s  wall {self.wall_s:6.2f}s  "
                f"TTFT mean {1000 * statistics.mean(self.ttft_s):7.1f} ms  "
                f"ITL mean {1000 * statistics.mean(self.itl_s or [0.0]):6.2f} ms")


def prompts(n: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, 40000) for _ in range(length)] for _ in range(n)]


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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--output-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()

    from tokenmill.engine.async_engine import AsyncEngine
    from tokenmill.engine.config import EngineConfig
    from tokenmill.engine.engine import Engine
    from tokenmill.utils.proc import ServiceProcess

    tmp = tempfile.TemporaryDirectory()
    model = args.model
    if model == "tiny":
        from tokenmill.loader.tiny import build_tiny_checkpoint

        model = str(build_tiny_checkpoint(Path(tmp.name) / "tiny"))
    kv_tokens = max(16384, 2 * args.concurrency * (args.prompt_tokens + args.output_tokens))
    flags = ["--kv-cache-tokens", str(kv_tokens), "--no-prefix-cache"]
    print(f"model={args.model} concurrency={args.concurrency} prompt={args.prompt_tokens} "
          f"output={args.output_tokens} rounds={args.rounds} (prefix cache off)")

    ae = AsyncEngine(Engine(EngineConfig(model=model, kv_cache_tokens=kv_tokens, enable_prefix_cache=False)))
    inproc = []
    for r in range(args.rounds + 1):   # round 0 warms up
        res = asyncio.run(run_inprocess(ae, prompts(args.concurrency, args.prompt_tokens, r), args.output_tokens))
        if r:
            inproc.append(res)
    ae.shutdown()

    http = []
    with ServiceProcess(["serve", "--model", model, "--served-model-name", "m", *flags],
                        log_path=Path(tmp.name) / "server.log", start_timeout=600) as proc:
        for r in range(args.rounds + 1):
            res = asyncio.run(run_http(proc.base_url, "m", prompts(args.concurrency, args.prompt_tokens, r),
                                       args.output_tokens))
            if r:
                http.append(res)

    def merge(rs: list[RunResult]) -> RunResult:
        return RunResult(sum(r.wall_s for r in rs), sum(r.output_tokens for r in rs),
                         [x for r in rs for x in r.ttft_s], [x for r in rs for x in r.itl_s])

    a, b = merge(inproc), merge(http)
    print(a.line("in-process"))
    print(b.line("HTTP"))
    print(f"HTTP / in-process throughput: {(b.output_tokens / b.wall_s) / (a.output_tokens / a.wall_s):.3f}")


if __name__ == "__main__":
    main()
