"""Hierarchical KV cache (L1 device pool, L2 host memory, L3 file / Redis), side by side in one run.

Parts (``--parts``, default all):

``tiers``     8 agent sessions whose turns come round-robin, ``--concurrency`` at a time, with
              an L1 pool that holds about two sessions. Modes: unbounded L1 (the reference CHR),
              L1 only, L1+L2 (host tier sized for every session), L1+L2+L3 (file, write-through).
              Prints CHR and TTFT p50 per mode and the ratios the issue aims at.
``restart``   The L3 mode's engine is closed (its queued writes flushed) and a fresh engine on the
              same folder serves every session's next turn: how much of each prompt is cached.
``failover``  Two ``tokenmill serve`` replicas behind ``tokenmill route``; sessions run turns
              through the router, then one replica is killed (SIGKILL) and the sessions that
              lived there move. Their TTFT p50 after the move vs before the kill, with a shared
              Redis (``redis-server`` on loopback) and without any L3.
``load``      Load time per cached token from each tier (L2 copy, L3 file, L3 Redis: read +
              check + copy into the pool) against prefill time per token on this machine.

Driver for ``tiers``/``restart``: the engine's own step loop in this process. TTFT = wall time
from ``add_request`` to the end of the step that returns the first token. Every mode's greedy
outputs are compared with the unbounded-L1 mode's.

    .venv/bin/python -u benchmarks/tiered_cache.py
    .venv/bin/python -u benchmarks/tiered_cache.py --parts load
    .venv/bin/python -u benchmarks/tiered_cache.py --tiny-arch Qwen3NextForCausalLM --parts tiers,restart
"""
from __future__ import annotations

import argparse
import json
import random
import signal
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from tokenmill.contracts.sampling import SamplingParams
from tokenmill.engine.config import EngineConfig
from tokenmill.engine.engine import Engine
from tokenmill.loader import load_model
from tokenmill.loader.resolve import DEFAULT_MODEL

PARTS = ("tiers", "restart", "failover", "load")


@dataclass
class Workload:
    first: list[list[int]]               # [session] turn-1 prompt
    new: list[list[list[int]]]           # [session][turn] fresh tokens after turn 1


def make_workload(args: argparse.Namespace, vocab: int) -> Workload:
    rng = random.Random(args.seed)

    def toks(n: int) -> list[int]:
        return [rng.randrange(10, vocab) for _ in range(n)]

    return Workload([toks(args.first_tokens) for _ in range(args.sessions)],
                    [[toks(args.new_tokens) for _ in range(args.turns)] for _ in range(args.sessions)])


@dataclass
class ModeResult:
    mode: str
    total_s: float = 0.0
    ttft: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    cached_tokens: int = 0
    by_tier: dict[str, int] = field(default_factory=lambda: {"l1": 0, "l2": 0, "l3": 0})
    outputs: dict[tuple[int, int], list[int]] = field(default_factory=dict)
    history: list[list[int]] = field(default_factory=list)

    @property
    def chr(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


def run_sessions(engine: Engine, w: Workload, turns: range, concurrency: int, max_tokens: int,
                 history: list[list[int]] | None, res: ModeResult, label: str) -> None:
    """Turns round-robin over sessions, ``concurrency`` sessions in flight at a time."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    hist = history if history is not None else [[] for _ in w.first]
    t0 = time.perf_counter()
    for t in turns:
        order = list(range(len(w.first)))
        for g in range(0, len(order), concurrency):
            added: dict[str, float] = {}
            for s in order[g:g + concurrency]:
                prompt = list(w.first[s]) if t == 0 else hist[s] + w.new[s][t]
                hist[s] = prompt
                rid = f"{label}-s{s}-t{t}"
                engine.add_request(rid, prompt, params, session_id=f"s{s}")
                added[rid] = time.perf_counter()
            seen: set[str] = set()
            while engine.has_unfinished_requests():
                outs = engine.step()
                now = time.perf_counter()
                for o in outs:
                    if o.request_id not in seen:
                        seen.add(o.request_id)
                        res.ttft.append(now - added[o.request_id])
                    if o.finished:
                        s = int(o.request_id.split("-s")[1].split("-t")[0])
                        res.outputs[(s, t)] = list(o.token_ids)
                        hist[s] = hist[s] + list(o.token_ids)
                        res.prompt_tokens += len(o.prompt_token_ids)
                        res.cached_tokens += o.cached_tokens
                        for k, v in (o.cached_tokens_by_tier or {"l1": o.cached_tokens}).items():
                            res.by_tier[k] += v
        print(f"  [{res.mode}] turn {t + 1} done at {time.perf_counter() - t0:.1f}s", file=sys.stderr,
              flush=True)
    res.total_s += time.perf_counter() - t0
    res.history = hist


def engine_for(loaded, args: argparse.Namespace, **kw) -> Engine:
    cfg = EngineConfig(model=args.model, page_size=args.page_size, max_batch_tokens=args.max_batch_tokens,
                       session_retention_s=0.0, **kw)
    engine = Engine(cfg, loaded=loaded)
    warm = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    engine.add_request("warmup", [11] * 32, warm)
    while engine.has_unfinished_requests():
        engine.step()
    return engine


def session_tokens(args: argparse.Namespace) -> int:
    """Tokens one session holds after its last turn."""
    return args.first_tokens + (args.turns - 1) * args.new_tokens + args.turns * args.max_tokens


def part_tiers(loaded, w: Workload, args: argparse.Namespace, store: Path) -> list[ModeResult]:
    one = session_tokens(args)
    small = 2 * one + args.page_size * 4
    # host pages at the pool's dtype: bytes per token from the model's KV spec
    spec = loaded.model.kv_cache_spec()
    per_token = spec.bytes_per_token()
    host_gib = 1.3 * args.sessions * one * per_token / 2**30
    host = dict(host_cache_memory_gib=host_gib)
    if spec.is_hybrid:   # room for two state snapshots per session beside the pages
        snap_gib = 2 * args.sessions * spec.bytes_per_request() / 2**30
        host = dict(host_cache_memory_gib=host_gib + snap_gib,
                    host_cache_snapshot_share=snap_gib / (host_gib + snap_gib))
        host_gib += snap_gib
    modes = [
        ("unbounded-L1", dict(kv_cache_tokens=(args.sessions + 2) * one)),
        ("L1", dict(kv_cache_tokens=small)),
        ("L1+L2", dict(kv_cache_tokens=small, **host)),
        ("L1+L2+L3file", dict(kv_cache_tokens=small, cache_storage=f"file:{store}", **host)),
    ]
    print(f"L1 pool {small} tokens (~2 sessions of {one}); L2 {host_gib * 1024:.1f} MiB; "
          f"{args.sessions} sessions x {args.turns} turns, {args.concurrency} at a time")
    results = []
    for name, kw in modes:
        engine = engine_for(loaded, args, **kw)
        r = ModeResult(name)
        run_sessions(engine, w, range(args.turns), args.concurrency, args.max_tokens, None, r, name)
        if engine.tiers is not None:
            engine.tiers.drain()
        results.append(r)
        engine.close()
        print(f"[{name}] CHR {r.chr:.4f}  TTFT p50 {1000 * statistics.median(r.ttft):.0f} ms  "
              f"total {r.total_s:.1f}s  by tier {r.by_tier}", flush=True)
    ref = results[0]
    for r in results[1:]:
        same = sum(r.outputs[k] == ref.outputs[k] for k in ref.outputs)
        print(f"outputs identical to {ref.mode}: {r.mode} {same}/{len(ref.outputs)}")
    l1 = results[1]
    for r in results[2:]:
        print(f"{r.mode}: CHR {100 * (r.chr - ref.chr):+.1f} points vs unbounded L1 (aim >= -3), "
              f"TTFT p50 x{statistics.median(l1.ttft) / statistics.median(r.ttft):.2f} lower than L1 only "
              f"(aim >= 3x)")
    return results


def part_restart(loaded, w: Workload, args: argparse.Namespace, store: Path,
                 prior: ModeResult | None) -> None:
    small = 2 * session_tokens(args) + args.page_size * 4
    if prior is None or not Path(store).exists():
        engine = engine_for(loaded, args, kv_cache_tokens=small, cache_storage=f"file:{store}")
        prior = ModeResult("before-restart")
        run_sessions(engine, w, range(args.turns), args.concurrency, args.max_tokens, None, prior, "pre")
        engine.close()
    engine = engine_for(loaded, args, kv_cache_tokens=small, cache_storage=f"file:{store}")
    r = ModeResult("after-restart")
    extra = Workload(w.first, [row + [row[-1]] for row in w.new])   # one more turn
    run_sessions(engine, extra, range(args.turns, args.turns + 1), args.concurrency, args.max_tokens,
                 [list(h) for h in prior.history], r, "post")
    engine.close()
    history_tokens = sum(len(h) - 1 for h in prior.history)
    print(f"[restart] next turn after a restart: cached {r.cached_tokens} of {r.prompt_tokens} prompt tokens "
          f"(CHR {r.chr:.4f}); from L3 {r.by_tier['l3']}; the sessions' history was {history_tokens} tokens "
          f"-> {r.cached_tokens / history_tokens:.1%} of it cached; TTFT p50 {1000 * statistics.median(r.ttft):.0f} ms")


# ---------------------------------------------------------------------------------------- failover
def _stream_ttft(client, url: str, body: dict, session: str) -> tuple[float, dict, str]:
    import json as _json

    t0 = time.perf_counter()
    ttft = None
    usage: dict = {}
    replica = ""
    toks: list[int] = []
    with client.stream("POST", url + "/v1/completions", json=body, headers={"X-Session-ID": session},
                       timeout=600) as resp:
        resp.raise_for_status()
        replica = resp.headers.get("x-tokenmill-replica", "")
        for line in resp.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            obj = _json.loads(line[6:])
            if obj.get("usage"):
                usage = obj["usage"]
            for c in obj.get("choices", []):
                if ttft is None and (c.get("text") or c.get("token_ids")):
                    ttft = time.perf_counter() - t0
                toks.extend(c.get("token_ids") or [])
    usage["_tokens"] = toks
    return (ttft if ttft is not None else time.perf_counter() - t0), usage, replica


def run_failover(model_dir: str, w: Workload, args: argparse.Namespace, storage: str | None) -> dict:
    import httpx

    from tokenmill.utils.proc import ServiceProcess

    common = ["serve", "--model", model_dir, "--served-model-name", "m", "--page-size", str(args.page_size),
              "--kv-cache-tokens", str((args.sessions + 2) * session_tokens(args)),
              "--session-retention-s", "600", "--log-level", "warning"]
    if storage:
        common += ["--cache-storage", storage]
    env = {"OMP_NUM_THREADS": "1"}
    reps = [ServiceProcess(common, env=env), ServiceProcess(common, env=env)]
    router = None
    try:
        for r in reps:
            r.start()
        argv = ["route", "--health-interval", "0.3", "--failure-threshold", "1", "--load-interval", "0.2",
                "--log-level", "warning"]
        for r in reps:
            argv += ["--replica", r.base_url]
        router = ServiceProcess(argv, start_timeout=60).start()
        hist = [list(p) for p in w.first]
        home: dict[int, str] = {}
        before: list[float] = []
        after: list[float] = []
        after_cached: list[float] = []
        kill_after = 2   # turns 0, 1 on the home replicas; the kill; turn 2 after the move
        with httpx.Client() as client:
            for t in range(kill_after + 1):
                if t == kill_after:
                    victim = max(set(home.values()), key=lambda rid: sum(v == rid for v in home.values()))
                    idx = [r.base_url.split("://", 1)[1] for r in reps].index(victim)
                    time.sleep(0.5)  # write-through pages of the last turn leave the worker
                    reps[idx].stop(signal.SIGKILL)
                    moved = {s for s, rid in home.items() if rid == victim}
                    time.sleep(1.0)  # the router's health check sees it go
                for s in range(len(hist)):
                    if t > 0:
                        hist[s] = hist[s] + w.new[s][(t - 1) % len(w.new[s])]
                    body = {"model": "m", "prompt": hist[s], "max_tokens": args.max_tokens, "temperature": 0,
                            "ignore_eos": True, "stream": True, "return_token_ids": True,
                            "stream_options": {"include_usage": True}}
                    ttft, usage, replica = _stream_ttft(client, router.base_url, body, f"fo{s}")
                    hist[s] = hist[s] + usage.get("_tokens", [])
                    if t < kill_after:
                        home[s] = replica
                        if t > 0:
                            before.append(ttft)
                    elif s in moved:
                        after.append(ttft)
                        after_cached.append(usage["prompt_tokens_details"]["cached_tokens"] / usage["prompt_tokens"])
        return {"before": before, "after": after, "after_cached": after_cached, "moved": len(moved)}
    finally:
        if router is not None:
            router.stop()
        for r in reps:
            if r.proc is not None:
                r.stop()


def part_failover(loaded, w: Workload, args: argparse.Namespace) -> None:
    from tokenmill.utils.redis_server import RedisServer

    model_dir = str(loaded.source)
    results = {}
    with RedisServer() as redis:
        results["redis L3"] = run_failover(model_dir, w, args, redis.url)
    results["no L3"] = run_failover(model_dir, w, args, None)
    for name, r in results.items():
        b, a = statistics.median(r["before"]), statistics.median(r["after"])
        print(f"[failover {name}] {r['moved']} sessions moved; TTFT p50 before the kill {1000 * b:.0f} ms, "
              f"after the move {1000 * a:.0f} ms -> x{a / b:.2f}; moved prompts cached "
              f"{statistics.mean(r['after_cached']):.1%}")
    print("aims: with L3 within 2x of before the kill; without L3 >= 5x")


# ---------------------------------------------------------------------------------------- load
def part_load(loaded, args: argparse.Namespace) -> None:
    import torch

    from tokenmill.cache.storage import FileStorage, RedisStorage, decode_page, encode_page
    from tokenmill.utils.redis_server import RedisServer

    n_tok = args.load_tokens
    engine = engine_for(loaded, args, kv_cache_tokens=4 * n_tok, host_cache_memory_gib=
                        2 * n_tok * loaded.model.kv_cache_spec().bytes_per_token() / 2**30)
    tiers = engine.tiers
    P = args.page_size
    n_pages = n_tok // P
    rng = random.Random(1)
    prompt = [rng.randrange(10, 40000) for _ in range(n_tok + 1)]
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    # prefill time per token (cache miss), best of 2
    best = float("inf")
    for k in range(2):
        engine.flush_cache()
        engine.add_request(f"pf{k}", [t + k for t in prompt], params)
        t0 = time.perf_counter()
        while engine.has_unfinished_requests():
            engine.step()
        best = min(best, time.perf_counter() - t0)
    prefill = best / n_tok
    pages = list(range(n_pages))
    slots = list(range(n_pages))

    def timed(fn, reps: int = 5) -> float:
        fn()
        ts = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
        return statistics.median(ts)

    rows = [("L2 host copy -> L1", timed(lambda: tiers.mover.from_host(slots, pages)) / n_tok)]
    payload = tiers.mover._gather_payload(pages)
    raw = payload.contiguous().view(torch.uint8).reshape(n_pages, -1).numpy()
    keys = tiers.keyer.keys(prompt)[:n_pages]
    ns = tiers.keyer.namespace
    records = [(k, encode_page(ns, k, raw[i].tobytes())) for i, k in enumerate(keys)]

    def read_into(backend) -> None:
        got = backend.get_many(keys)
        payloads = [decode_page(ns, k, r, tiers.payload_bytes) for k, r in zip(keys, got)]
        tiers.mover.load_payloads(payloads, pages)

    with tempfile.TemporaryDirectory() as d:
        fb = FileStorage(d, ns)
        fb.put_many(records)
        rows.append(("L3 file read+check -> L1", timed(lambda: read_into(fb)) / n_tok))
    with RedisServer() as redis:
        rb = RedisStorage(redis.url, ns)
        rb.put_many(records)
        rows.append(("L3 redis read+check -> L1", timed(lambda: read_into(rb)) / n_tok))
        rb.close()
    engine.close()
    print(f"[load] {n_tok}-token run, {tiers.payload_bytes} B per page of {P} tokens")
    print(f"{'source':<28}{'us/token':>10}{'vs prefill':>12}")
    print(f"{'prefill (compute)':<28}{1e6 * prefill:>10.1f}{1.0:>12.2f}")
    for name, v in rows:
        print(f"{name:<28}{1e6 * v:>10.2f}{prefill / v:>11.0f}x")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--tiny-arch", default=None,
                    help="instead of --model: a random-weight checkpoint of this class (hidden 256, 8 layers; "
                         "e.g. Qwen3NextForCausalLM or BailingHybridForCausalLM for the hybrid snapshot tiers)")
    ap.add_argument("--parts", default=",".join(PARTS))
    ap.add_argument("--sessions", type=int, default=8)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--concurrency", type=int, default=2)
    ap.add_argument("--first-tokens", type=int, default=384)
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--max-batch-tokens", type=int, default=512)
    ap.add_argument("--load-tokens", type=int, default=1024)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    parts = [p for p in args.parts.split(",") if p]
    bad = set(parts) - set(PARTS)
    if bad:
        ap.error(f"unknown parts {sorted(bad)}; choose from {PARTS}")
    import torch

    torch.set_num_threads(args.threads)
    with open("/proc/loadavg") as f:
        print(f"load average at start: {f.read().split()[:3]}")
    if args.tiny_arch:
        from hybrid_multiturn import size_overrides

        from tokenmill.loader.tiny import build_tiny_checkpoint

        args.model = str(build_tiny_checkpoint(Path(tempfile.mkdtemp(prefix="tiered-tiny-")) / args.tiny_arch,
                                               args.tiny_arch, seed=args.seed,
                                               **size_overrides(args.tiny_arch, 256, 8)))
    loaded = load_model(args.model)
    w = make_workload(args, int(loaded.model.args.vocab_size))
    store = Path(tempfile.mkdtemp(prefix="tokenmill-l3-"))
    results: list[ModeResult] = []
    if "tiers" in parts:
        results = part_tiers(loaded, w, args, store)
    if "restart" in parts:
        prior = next((r for r in results if r.mode == "L1+L2+L3file"), None)
        part_restart(loaded, w, args, store, prior)
    if "failover" in parts:
        part_failover(loaded, w, args)
    if "load" in parts:
        part_load(loaded, args)
    if args.json and results:
        Path(args.json).write_text(json.dumps([{"mode": r.mode, "chr": r.chr, "ttft": r.ttft,
                                                "by_tier": r.by_tier, "total_s": r.total_s} for r in results]))
    with open("/proc/loadavg") as f:
        print(f"load average at end: {f.read().split()[:3]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
