"""Multi-turn agent sessions on a tiny hybrid (linear-attention) model: prefix caching with state
snapshots against prefix caching off, and the dense model's hit rate on the same workload.

Workload (benchmarks/multiturn_cache.py's, all randomness from --seed): ``--sessions`` closed-loop
sessions of ``--turns`` turns; turn 1 is a ``--system-tokens`` prompt shared by every session plus
``--new-tokens`` of its own, turn T resends turn T-1's prompt + output plus ``--new-tokens`` fresh
ones; every turn generates exactly ``--max-tokens`` tokens (greedy, ignore_eos). All sessions start
together. The driver is the engine's own step loop; TTFT is wall time from ``add_request`` to the
end of the step that returns the first token (queueing included), also given in engine steps.

Modes, each on a fresh engine (the same loaded weights, a warm-up request first, not counted):

* ``snap``: the hybrid model with its prefix cache (state snapshots: default budget, interval
  ``--snapshot-interval``);
* ``off``: the hybrid model, prefix cache off (every turn recomputes its whole history);
* ``dense``: a dense tiny Llama of the same width and depth, prefix cache on: its CHR is the
  reference for the hybrid model's ("within 2 points"); its times are not comparable;
* ``snap-http`` / ``vllm``: the same workload over HTTP (``/v1/completions`` with token-id prompts,
  streamed, one asyncio task per session) against ``tokenmill serve`` with snapshots and against
  vLLM's CPU build (``benchmarks/peers.py``; vLLM's own hybrid prefix caching, "align" mode) on the
  same checkpoint: the side-by-side pair. CHR there comes from ``usage.prompt_tokens_details``.

The theoretical maximum CHR assumes an unbounded cache and whole-page matching (turn T reuses
the whole pages of turn T-1's computed tokens; turn 1 the system prompt's whole pages once
another session computed them). Tiny random-weight checkpoints are built in a temporary
directory; ``--hidden-size`` / ``--layers`` size them (compute, not Python overhead, should
dominate a step for the TTFT ratio to mean anything).

vLLM's CPU attention needs a head size of 32 or more (hence ``head_dim`` 64 here), and its CPU
Gated DeltaNet kernel needs bfloat16 (``--vllm-dtype``) and the real models' linear head size
(``--linear-head-dim 128``), so its outputs are not expected to equal tokenmill's fp32 ones; CHR and
times still compare:

    .venv/bin/python benchmarks/hybrid_multiturn.py --modes snap-http,vllm --linear-head-dim 128 --max-running-requests 16

    .venv/bin/python benchmarks/hybrid_multiturn.py                    # 8 x 8, Qwen3-Next
    .venv/bin/python benchmarks/hybrid_multiturn.py --arch BailingHybridForCausalLM
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from multiturn_cache import ModeResult, make_workload, run_mode, theoretical_max_chr  # noqa: E402

from tokenmill.loader import load_model  # noqa: E402
from tokenmill.loader.tiny import build_tiny_checkpoint  # noqa: E402

MODES = ("snap", "off", "dense", "snap-http", "vllm")


def size_overrides(arch: str, hidden: int, layers: int, linear_head_dim: int = 32) -> dict:
    """Checkpoint fields that scale a tiny model to ``hidden`` x ``layers``."""
    heads = max(hidden // 64, 1)
    if arch == "LlamaForCausalLM":
        return dict(hidden_size=hidden, intermediate_size=4 * hidden, num_hidden_layers=layers,
                    num_attention_heads=heads * 2, num_key_value_heads=heads)
    if arch == "Qwen3NextForCausalLM":
        return dict(hidden_size=hidden, intermediate_size=4 * hidden, num_hidden_layers=layers,
                    num_attention_heads=heads * 2, num_key_value_heads=heads, head_dim=64,
                    linear_num_key_heads=heads, linear_num_value_heads=heads * 2,
                    linear_key_head_dim=linear_head_dim, linear_value_head_dim=linear_head_dim,
                    moe_intermediate_size=hidden, shared_expert_intermediate_size=hidden)
    if arch == "BailingHybridForCausalLM":   # KDA heads = attention heads, MLA latent of hidden / 4
        return dict(hidden_size=hidden, intermediate_size=4 * hidden, num_hidden_layers=layers,
                    num_attention_heads=heads * 2, num_key_value_heads=heads * 2, head_dim=32,
                    kv_lora_rank=hidden // 4, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32,
                    moe_intermediate_size=hidden)
    raise SystemExit(f"no size overrides for {arch}")


async def _drive_http(base_url: str, model: str, w, args: argparse.Namespace, mode: str) -> ModeResult:
    from tokenmill.bench.client import BenchClient, EndpointConfig
    from tokenmill.bench.prompts import RequestPayload

    client = BenchClient(EndpointConfig(base_url=base_url, model=model, ignore_eos=True, return_token_ids=True))
    res = ModeResult(mode, 0.0, [[0.0] * w.sessions for _ in range(w.turns)],
                     [[0] * w.sessions for _ in range(w.turns)])
    async with client:
        warm = RequestPayload("/v1/completions", {"prompt": [11] * 64}, [11] * 64)
        for warning in await client.probe(warm):
            print(f"  [{mode}] {warning}", file=sys.stderr)
        await client.flush_cache()

        async def session(s: int) -> None:
            history = list(w.system)
            for t in range(w.turns):
                history = history + w.new_tokens[s][t]
                r = await client.send(RequestPayload("/v1/completions", {"prompt": history}, list(history)),
                                      max_tokens=args.max_tokens, session_id=f"s{s}", turn=t)
                rec = r.record
                if rec.error is not None:
                    raise RuntimeError(f"{mode} session {s} turn {t}: {rec.error}")
                if r.token_ids is None:
                    raise RuntimeError(f"{mode} did not return token ids; the session cannot resend them")
                res.ttft_by_turn[t][s] = rec.first_token_time - rec.send_time
                res.prompt_tokens += rec.prompt_tokens
                res.cached_tokens += rec.cached_tokens or 0
                res.outputs[(s, t)] = list(r.token_ids)
                history = history + list(r.token_ids)

        t0 = time.perf_counter()
        await asyncio.gather(*(session(s) for s in range(w.sessions)))
        res.total_s = time.perf_counter() - t0
    return res


def run_http(mode: str, ckpt: str, w, args: argparse.Namespace) -> ModeResult:
    """``mode`` over HTTP: a ``tokenmill serve`` subprocess or vLLM, started and stopped here."""
    if mode == "vllm":
        from peers import start_vllm

        srv = start_vllm(model_dir=ckpt, served_name="tiny-hybrid", kv_cache_gb=2, max_model_len=4096,
                         dtype=args.vllm_dtype,
                         threads=args.threads or 2,
                         extra_args=["--max-num-seqs", str(args.max_running_requests),
                                     "--max-num-batched-tokens", str(args.max_batch_tokens)])
        print(f"  [vllm] started in {srv.startup_s:.0f}s", file=sys.stderr, flush=True)
        with srv:
            return asyncio.run(_drive_http(srv.base_url, "tiny-hybrid", w, args, mode))
    from tokenmill.utils.proc import ServiceProcess

    argv = ["serve", "--model", ckpt, "--served-model-name", "tiny-hybrid", "--page-size", str(args.page_size),
            "--kv-cache-tokens", str(args.kv_cache_tokens), "--max-batch-tokens", str(args.max_batch_tokens),
            "--max-running-requests", str(args.max_running_requests),
            "--state-snapshot-interval", str(args.snapshot_interval)]
    if args.snapshot_slots is not None:
        argv += ["--state-snapshot-slots", str(args.snapshot_slots)]
    env = {"OMP_NUM_THREADS": str(args.threads)} if args.threads else None
    with ServiceProcess(argv, env=env, log_path=os.path.join(tempfile.gettempdir(), "hybrid-multiturn-serve.log")) as srv:
        return asyncio.run(_drive_http(srv.base_url, "tiny-hybrid", w, args, mode))


def ttft_p50(r: ModeResult, first_turn: int = 0) -> float:
    return statistics.median(x for row in r.ttft_by_turn[first_turn:] for x in row)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--arch", default="Qwen3NextForCausalLM")
    ap.add_argument("--hidden-size", type=int, default=256)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--linear-head-dim", type=int, default=32,
                    help="Qwen3-Next: key/value head size of the linear layers (vLLM's CPU kernel: 128)")
    ap.add_argument("--sessions", type=int, default=8)
    ap.add_argument("--turns", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=150, help="fresh tokens per turn (+-10%%)")
    ap.add_argument("--system-tokens", type=int, default=128, help="prompt prefix shared by all")
    ap.add_argument("--max-tokens", type=int, default=16, help="generated tokens per turn")
    ap.add_argument("--think-steps", type=int, default=0)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--max-batch-tokens", type=int, default=512)
    ap.add_argument("--max-running-requests", type=int, default=64)
    ap.add_argument("--kv-cache-tokens", type=int, default=32768)
    ap.add_argument("--snapshot-interval", type=int, default=512)
    ap.add_argument("--snapshot-slots", type=int, default=None, help="snapshot budget (default: the engine's)")
    ap.add_argument("--modes", default="snap,off,dense", help=f"comma list of {MODES}")
    ap.add_argument("--vllm-dtype", default="bfloat16",
                    help="vLLM's dtype (its CPU Gated DeltaNet kernel requires bfloat16; tokenmill runs fp32)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch default)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None, help="also write the results here")
    args = ap.parse_args(argv)
    args.model = args.arch
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    bad = [m for m in modes if m not in MODES]
    if bad or not modes:
        ap.error(f"unknown mode(s) {bad}; choose from {MODES}")
    if args.threads:
        import torch
        torch.set_num_threads(args.threads)

    tmp = tempfile.mkdtemp(prefix="hybrid-multiturn-")
    models = {}
    paths = {}
    for kind, arch in (("hybrid", args.arch), ("dense", "LlamaForCausalLM")):
        if kind == "dense" and "dense" not in modes:
            continue
        paths[kind] = str(build_tiny_checkpoint(os.path.join(tmp, kind), arch, seed=args.seed,
                                                **size_overrides(arch, args.hidden_size, args.layers,
                                                                 args.linear_head_dim)))
        models[kind] = load_model(paths[kind])
    any_model = next(iter(models.values()))
    w = make_workload(args, int(any_model.model.args.vocab_size))
    max_chr, _ = theoretical_max_chr(w, args.max_tokens, args.page_size)
    print(f"model {args.arch} (hidden {args.hidden_size}, {args.layers} layers); workload {w.sessions} sessions "
          f"x {w.turns} turns, ~{args.new_tokens} new tokens per turn, {args.max_tokens} generated, system "
          f"prompt {len(w.system)}, page {args.page_size}; load {open('/proc/loadavg').read().split()[:3]}")
    print(f"theoretical max CHR (whole pages): {max_chr:.4f}")

    results: dict[str, ModeResult] = {}
    snaps = {}
    for mode in modes:
        if mode in ("snap-http", "vllm"):
            try:
                r = run_http(mode, paths["hybrid"], w, args)
            except Exception as e:   # a peer that cannot serve the model: say so, keep the rest
                print(f"[{mode}] FAILED: {type(e).__name__}: {str(e)[-1500:]}", flush=True)
                continue
            results[mode] = r
            print(f"[{mode}] total {r.total_s:.2f}s  CHR {r.chr:.4f} ({r.chr / max_chr:.1%} of max)  prompt "
                  f"{r.prompt_tokens}  cached {r.cached_tokens}  TTFT p50 {1000 * ttft_p50(r):.1f} ms  "
                  f"(turns 2+: {1000 * ttft_p50(r, 1):.1f} ms)", flush=True)
            continue
        loaded = models["dense" if mode == "dense" else "hybrid"]
        extra = {}
        if mode == "snap":
            extra = dict(state_snapshot_interval=args.snapshot_interval, state_snapshot_slots=args.snapshot_slots)
        r = run_mode("off" if mode == "off" else "on", loaded, w, args, **extra)
        r.mode = mode
        results[mode] = r
        print(f"[{mode}] total {r.total_s:.2f}s  CHR {r.chr:.4f} ({r.chr / max_chr:.1%} of max)  prompt "
              f"{r.prompt_tokens}  cached {r.cached_tokens}  TTFT p50 {1000 * ttft_p50(r):.1f} ms  "
              f"(turns 2+: {1000 * ttft_p50(r, 1):.1f} ms)  preemptions {r.preemptions}", flush=True)

    print(f"{'turn':>4}" + "".join(f"{'TTFT ' + m + ' (ms)':>22}{'(steps)':>8}" for m in results))
    for t in range(w.turns):   # steps: engine steps (in-process modes only)
        print(f"{t + 1:>4}" + "".join(
            f"{1000 * statistics.mean(r.ttft_by_turn[t]):>22.1f}"
            + (f"{statistics.mean(r.ttft_steps_by_turn[t]):>8.1f}" if m not in ("snap-http", "vllm") else f"{'-':>8}")
            for m, r in results.items()))
    summary: dict[str, float] = {}
    if "snap" in results and "off" in results:
        on, off = results["snap"], results["off"]
        same = sum(on.outputs[k] == off.outputs[k] for k in off.outputs)
        summary.update(ttft_ratio=ttft_p50(off) / ttft_p50(on), ttft_ratio_turns2=ttft_p50(off, 1) / ttft_p50(on, 1),
                       total_ratio=off.total_s / on.total_s)
        print(f"snap vs off: TTFT p50 x{summary['ttft_ratio']:.2f} lower (turns 2+: "
              f"x{summary['ttft_ratio_turns2']:.2f}), total time x{summary['total_ratio']:.2f} faster; "
              f"outputs identical {same}/{len(off.outputs)}")
    if "snap-http" in results and "vllm" in results:
        a, v = results["snap-http"], results["vllm"]
        same = sum(a.outputs[k] == v.outputs[k] for k in a.outputs)
        summary.update(vllm_ttft_ratio=ttft_p50(v) / ttft_p50(a), vllm_total_ratio=v.total_s / a.total_s)
        print(f"snap-http vs vllm: CHR {a.chr:.4f} vs {v.chr:.4f}, TTFT p50 x{summary['vllm_ttft_ratio']:.2f} "
              f"lower, total time x{summary['vllm_total_ratio']:.2f} faster; outputs identical {same}/{len(a.outputs)}")
    if "snap" in results and "dense" in results:
        summary["chr_points_below_dense"] = 100 * (results["dense"].chr - results["snap"].chr)
        print(f"CHR snap {results['snap'].chr:.4f} vs dense {results['dense'].chr:.4f}: "
              f"{summary['chr_points_below_dense']:.2f} points below the dense model")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "max_chr": max_chr, "summary": summary,
                       "results": {m: {"total_s": r.total_s, "chr": r.chr, "prompt_tokens": r.prompt_tokens,
                                       "cached_tokens": r.cached_tokens, "ttft_p50_s": ttft_p50(r),
                                       "ttft_by_turn": r.ttft_by_turn} for m, r in results.items()}},
                      f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
