"""Soak: a bounded mix of good, bad and abandoned requests against a real server, for N minutes.

    .venv/bin/python benchmarks/soak.py --minutes 30 [--model tiny|PATH] [--workers 6]
        [--sample-s 60] [--out soak-out]

The mix (each worker picks one at random, closed loop): chat and completions, streamed and not,
``n = 2``, long prompts, streams the client drops mid-way, requests the client cancels before the
answer, bad requests (malformed JSON, wrong types, unknown model), and requests whose
``deadline_s`` passes. The server runs with a bounded queue, a queue-wait limit and
``--debug-checks`` (page accounting checked whenever it idles).

Every ``--sample-s`` seconds (a minute by default) it records the server's RSS, open file
descriptors and threads (from /proc through psutil), KV pages in use and asyncio tasks (from the
server's own /v1/loads and /metrics), and p50/p99 latency of the requests finished meanwhile.
The series go to ``OUT/soak.json`` and ``OUT/soak.png``. Pass criteria, printed at the end:

* no 5xx answer;
* KV pages back to baseline once idle (none in use, free + cached == total);
* RSS growth over the last half of the run below 5%;
* nothing stuck: the engine idles within 30 s of the load stopping, no request outlived its
  client timeout, and asyncio tasks are back to their idle count.

Exit status 0 when all pass. ``--model tiny`` (the default) builds a tiny random-weight Llama,
so the soak tests the serving machinery, not a model's speed.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psutil

from tokenmill.utils.proc import ServiceProcess

ACTIONS = ("chat", "chat_stream", "completion", "completion_stream", "n2", "long_prompt", "disconnect",
           "cancel", "bad_json", "bad_field", "unknown_model", "deadline")
CLIENT_TIMEOUT_S = 60.0


@dataclass
class Window:
    latencies: list[float] = field(default_factory=list)


@dataclass
class Tally:
    statuses: Counter[str] = field(default_factory=Counter)
    actions: Counter[str] = field(default_factory=Counter)
    problems: list[str] = field(default_factory=list)
    window: Window = field(default_factory=Window)
    outstanding: dict[int, float] = field(default_factory=dict)   # request no -> start time
    longest_s: float = 0.0


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(("alpha", "beta", "gamma", "delta", "code", "test", "serve", "page")) for _ in range(n))


async def one(client: httpx.AsyncClient, rng: random.Random, tally: Tally, action: str) -> None:
    chat_body = {"model": "soak", "messages": [{"role": "user", "content": words(rng, rng.randint(3, 40))}],
                 "max_tokens": rng.randint(1, 48), "temperature": rng.choice((0.0, 0.8))}
    comp_body = {"model": "soak", "prompt": words(rng, rng.randint(3, 40)), "max_tokens": rng.randint(1, 48)}
    if action == "chat":
        r = await client.post("/v1/chat/completions", json=chat_body)
        expect(tally, action, r, 200)
    elif action == "completion":
        r = await client.post("/v1/completions", json=comp_body)
        expect(tally, action, r, 200)
    elif action == "n2":
        r = await client.post("/v1/completions", json={**comp_body, "n": 2, "temperature": 1.0})
        if expect(tally, action, r, 200) and len(r.json()["choices"]) != 2:
            tally.problems.append(f"n2: {len(r.json()['choices'])} choices")
    elif action == "long_prompt":
        r = await client.post("/v1/completions", json={**comp_body, "prompt": words(rng, 600), "max_tokens": 8})
        expect(tally, action, r, 200)
    elif action in ("chat_stream", "completion_stream", "disconnect"):
        path, body = (("/v1/chat/completions", chat_body) if action != "completion_stream"
                      else ("/v1/completions", comp_body))
        body = {**body, "stream": True}
        if action == "disconnect":
            body.update(max_tokens=400, ignore_eos=True)
        async with client.stream("POST", path, json=body) as r:
            if not expect(tally, action, r, 200, read=False):
                return
            seen = 0
            async for line in r.aiter_lines():
                if line.startswith("data:"):
                    seen += 1
                    if action == "disconnect" and seen >= rng.randint(1, 5):
                        return          # leave mid-stream: the server must abort and free the pages
            if seen == 0:
                tally.problems.append(f"{action}: empty stream")
    elif action == "cancel":
        try:
            await asyncio.wait_for(client.post("/v1/completions", json={**comp_body, "max_tokens": 400,
                                                                        "ignore_eos": True}),
                                   timeout=rng.uniform(0.02, 0.3))
            tally.statuses["200"] += 1
        except asyncio.TimeoutError:
            tally.statuses["cancelled"] += 1
    elif action == "bad_json":
        r = await client.post("/v1/chat/completions", content=b'{"model": "soak", "messages": [',
                              headers={"content-type": "application/json"})
        expect(tally, action, r, 400)
    elif action == "bad_field":
        r = await client.post("/v1/completions", json={**comp_body, "max_tokens": "many"})
        expect(tally, action, r, 400)
    elif action == "unknown_model":
        r = await client.post("/v1/chat/completions", json={**chat_body, "model": "nope"})
        expect(tally, action, r, 404)
    elif action == "deadline":
        r = await client.post("/v1/completions", json={**comp_body, "max_tokens": 900, "ignore_eos": True,
                                                       "prompt": "x", "deadline_s": rng.uniform(0.01, 0.2)})
        if expect(tally, action, r, 200) and r.json()["choices"][0]["finish_reason"] != "deadline":
            tally.problems.append(f"deadline: finish_reason {r.json()['choices'][0]['finish_reason']}")


def expect(tally: Tally, action: str, r: httpx.Response, status: int, read: bool = True) -> bool:
    tally.statuses[str(r.status_code)] += 1
    if r.status_code in (429, 503) and status == 200:
        return False            # admission control answered: allowed, counted
    if r.status_code != status:
        body = r.text[:200] if read else ""
        tally.problems.append(f"{action}: expected {status}, got {r.status_code} {body}")
        return False
    if status >= 400 and set(r.json().get("error", {})) != {"message", "type", "param", "code"}:
        tally.problems.append(f"{action}: error body not in the OpenAI shape: {r.text[:200]}")
    return True


async def worker(base: str, seed: int, stop_at: float, tally: Tally, counter: list[int]) -> None:
    rng = random.Random(seed)
    async with httpx.AsyncClient(base_url=base, timeout=CLIENT_TIMEOUT_S) as client:
        while time.monotonic() < stop_at:
            action = rng.choice(ACTIONS)
            counter[0] += 1
            no = counter[0]
            start = time.monotonic()
            tally.outstanding[no] = start
            tally.actions[action] += 1
            try:
                await one(client, rng, tally, action)
            except httpx.HTTPError as e:
                tally.statuses["transport_error"] += 1
                tally.problems.append(f"{action}: {type(e).__name__}: {e}")
            finally:
                del tally.outstanding[no]
                took = time.monotonic() - start
                tally.longest_s = max(tally.longest_s, took)
                if action not in ("cancel", "disconnect"):
                    tally.window.latencies.append(took)


def server_sample(proc: psutil.Process, http: httpx.Client) -> dict[str, float]:
    mem = proc.memory_info().rss
    loads = http.get("/v1/loads").json()
    tasks = 0.0
    for line in http.get("/metrics").text.splitlines():
        if line.startswith("tokenmill:event_loop_tasks{"):
            tasks = float(line.rsplit(" ", 1)[1])
    return {"rss_mb": mem / 2**20, "fds": float(proc.num_fds()), "threads": float(proc.num_threads()),
            "tasks": tasks, "pages_in_use": float(loads["kv_pages_in_use"]),
            "running": float(loads["num_running"]), "waiting": float(loads["num_waiting"])}


def pct(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


async def drive(base: str, pid: int, minutes: float, workers: int, sample_s: float, seed: int) -> dict[str, Any]:
    proc = psutil.Process(pid)
    http = httpx.Client(base_url=base, timeout=30)
    idle = server_sample(proc, http)
    baseline = http.get("/v1/loads").json()
    tally = Tally()
    counter = [0]
    start = time.monotonic()
    stop_at = start + minutes * 60
    tasks = [asyncio.create_task(worker(base, seed * 1000 + i, stop_at, tally, counter)) for i in range(workers)]
    samples: list[dict[str, float]] = []
    while time.monotonic() < stop_at:
        await asyncio.sleep(min(sample_s, max(stop_at - time.monotonic(), 0.01)))
        lat, tally.window = tally.window.latencies, Window()
        s = await asyncio.to_thread(server_sample, proc, http)
        s.update(t_min=(time.monotonic() - start) / 60, p50_s=pct(lat, 0.5), p99_s=pct(lat, 0.99),
                 requests=float(len(lat)))
        samples.append(s)
        print(f"[{s['t_min']:5.1f} min] rss {s['rss_mb']:7.1f} MB  fds {s['fds']:4.0f}  threads {s['threads']:3.0f}  "
              f"tasks {s['tasks']:4.0f}  pages {s['pages_in_use']:4.0f}  p50 {s['p50_s'] * 1000:6.0f} ms  "
              f"p99 {s['p99_s'] * 1000:6.0f} ms  ({len(lat)} requests)", flush=True)
    done, pending = await asyncio.wait(tasks, timeout=CLIENT_TIMEOUT_S + 10)
    stuck_clients = len(pending)
    for t in pending:
        t.cancel()
    # idle: the engine drains, pages come back, tasks return to their idle count
    idle_by = time.monotonic() + 30
    final = http.get("/v1/loads").json()
    while time.monotonic() < idle_by and (final["num_running"] or final["num_waiting"]):
        await asyncio.sleep(0.2)
        final = http.get("/v1/loads").json()
    await asyncio.sleep(1.0)
    after = server_sample(proc, http)
    final = http.get("/v1/loads").json()
    http.close()
    half = samples[len(samples) // 2] if samples else after
    growth = (samples[-1]["rss_mb"] / half["rss_mb"] - 1.0) if samples else 0.0
    five_xx = sum(n for code, n in tally.statuses.items() if code.isdigit() and int(code) >= 500)
    queue_503 = tally.statuses.get("503", 0)
    checks = {
        "no 5xx": five_xx == 0 and not tally.statuses.get("transport_error"),
        "pages back to baseline when idle": final["kv_pages_in_use"] == 0
        and final["kv_pages_free"] + final["kv_pages_cached"] == final["kv_pages_total"] == baseline["kv_pages_total"],
        "RSS growth over the last half < 5%": growth < 0.05,
        "nothing stuck": stuck_clients == 0 and final["num_running"] == 0 and final["num_waiting"] == 0
        and tally.longest_s < CLIENT_TIMEOUT_S and after["tasks"] <= idle["tasks"] + 2,
        "every answer as expected": not tally.problems,
    }
    return {"minutes": minutes, "workers": workers, "samples": samples, "idle_before": idle, "idle_after": after,
            "statuses": dict(tally.statuses), "actions": dict(tally.actions), "problems": tally.problems[:50],
            "rss_growth_last_half": growth, "longest_request_s": tally.longest_s, "queue_timeouts_503": queue_503,
            "checks": checks, "passed": all(checks.values())}


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s = result["samples"]
    t = [x["t_min"] for x in s]
    panels = [("RSS (MB)", ["rss_mb"]), ("open fds", ["fds"]), ("threads", ["threads"]), ("asyncio tasks", ["tasks"]),
              ("KV pages in use", ["pages_in_use"]), ("latency (s)", ["p50_s", "p99_s"])]
    fig, axes = plt.subplots(3, 2, figsize=(11, 8), sharex=True)
    for ax, (title, keys) in zip(axes.flat, panels):
        for k in keys:
            ax.plot(t, [x[k] for x in s], marker=".", label=k)
        ax.set_title(title)
        ax.grid(alpha=0.3)
        if len(keys) > 1:
            ax.legend()
    for ax in axes[-1]:
        ax.set_xlabel("minutes")
    verdict = "PASS" if result["passed"] else "FAIL"
    fig.suptitle(f"tokenmill soak: {result['minutes']} min, {result['workers']} workers: {verdict}")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=30.0)
    ap.add_argument("--model", default="tiny", help="'tiny' (a random tiny Llama built here) or a model name/path")
    ap.add_argument("--workers", type=int, default=6)
    ap.add_argument("--sample-s", type=float, default=60.0, help="seconds between samples (default 60)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="soak-out")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model
        if model == "tiny":
            from tokenmill.loader.tiny import build_tiny_checkpoint

            model = str(build_tiny_checkpoint(Path(tmp) / "tiny"))
        argv_s = ["serve", "--model", model, "--served-model-name", "soak", "--kv-cache-tokens", "8192",
                  "--max-model-len", "1024", "--max-waiting-requests", "32", "--max-queue-wait-s", "20",
                  "--request-deadline-s", "40", "--debug-checks", "--log-level", "warning"]
        with ServiceProcess(argv_s, log_path=out / "server.log") as server:
            assert server.proc is not None
            result = asyncio.run(drive(server.base_url, server.proc.pid, args.minutes, args.workers, args.sample_s,
                                       args.seed))
            alive = server.proc.poll() is None
        result["checks"]["server alive at the end"] = alive
        result["passed"] = result["passed"] and alive
    (out / "soak.json").write_text(json.dumps(result, indent=1))
    plot(result, out / "soak.png")
    print(f"\nrequests: {sum(result['actions'].values())} ({', '.join(f'{k} {v}' for k, v in sorted(result['actions'].items()))})")
    print(f"answers: {dict(sorted(result['statuses'].items()))}")
    print(f"RSS growth over the last half: {100 * result['rss_growth_last_half']:+.2f}%  "
          f"longest request {result['longest_request_s']:.1f}s")
    for p in result["problems"][:10]:
        print(f"  problem: {p}")
    for name, ok in result["checks"].items():
        print(f"{'PASS' if ok else 'FAIL'}  {name}")
    print(f"soak {'PASSED' if result['passed'] else 'FAILED'}; series in {out / 'soak.json'}, plot {out / 'soak.png'}")
    if result["samples"]:
        lat = [x["p99_s"] for x in result["samples"] if x["requests"]]
        if lat:
            print(f"p99 latency per sample: median {statistics.median(lat) * 1000:.0f} ms, max {max(lat) * 1000:.0f} ms")
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
