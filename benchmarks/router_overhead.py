"""Latency the router adds: one tiny-model replica, the same streaming requests sent directly
and through `tokenmill route`, interleaved (direct, routed, direct, ...) so that CPU noise hits
both alike. Prints median / p90 TTFT and end-to-end time of each path and their differences.

Usage: .venv/bin/python benchmarks/router_overhead.py [--requests 200] [--max-tokens 16]
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import httpx

from tokenmill.loader.tiny import build_tiny_checkpoint
from tokenmill.utils.proc import ServiceProcess


def timed(client: httpx.Client, base: str, k: int, max_tokens: int) -> tuple[float, float]:
    body = {"model": "tiny", "messages": [{"role": "user", "content": f"request {k} " * 20}],
            "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
    t0 = time.perf_counter()
    first = None
    with client.stream("POST", base + "/v1/chat/completions", json=body,
                       headers={"X-Session-ID": f"s{k % 8}"}) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if first is None and line.startswith("data:") and '"content"' in line:
                first = time.perf_counter() - t0
    return first or float("nan"), time.perf_counter() - t0


def q(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(p * len(xs)))]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--max-tokens", type=int, default=16)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = str(build_tiny_checkpoint(f"{tmp}/model"))
        with ServiceProcess(["serve", "--model", model, "--served-model-name", "tiny", "--log-level", "warning"]) as rep, \
                ServiceProcess(["route", "--replica", rep.base_url, "--log-level", "warning"]) as router, \
                httpx.Client(timeout=60) as client:
            for k in range(10):   # warm both paths
                timed(client, rep.base_url, k, args.max_tokens)
                timed(client, router.base_url, k, args.max_tokens)
            res: dict[str, list[tuple[float, float]]] = {"direct": [], "routed": []}
            for k in range(args.requests):
                res["direct"].append(timed(client, rep.base_url, k, args.max_tokens))
                res["routed"].append(timed(client, router.base_url, k, args.max_tokens))
    print(f"{args.requests} streaming requests per path, max_tokens={args.max_tokens}")
    print(f"{'path':<8}{'TTFT p50 ms':>13}{'TTFT p90 ms':>13}{'e2e p50 ms':>12}{'e2e p90 ms':>12}")
    for path, xs in res.items():
        ttft, e2e = [x[0] * 1e3 for x in xs], [x[1] * 1e3 for x in xs]
        print(f"{path:<8}{q(ttft, .5):>13.2f}{q(ttft, .9):>13.2f}{q(e2e, .5):>12.2f}{q(e2e, .9):>12.2f}")
    d_ttft = [r[0] - d[0] for d, r in zip(res["direct"], res["routed"])]
    d_e2e = [r[1] - d[1] for d, r in zip(res["direct"], res["routed"])]
    print(f"added by the router (median of paired differences): TTFT {statistics.median(d_ttft) * 1e3:.2f} ms, "
          f"e2e {statistics.median(d_e2e) * 1e3:.2f} ms")


if __name__ == "__main__":
    main()
