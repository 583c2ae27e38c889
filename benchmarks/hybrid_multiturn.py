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
  reference for the hybrid model's ("within 2 points"); its times are not comparable.

The theoretical maximum CHR assumes an unbounded cache and whole-page matching (turn T reuses
the whole pages of turn T-1's computed tokens; turn 1 the system prompt's whole pages once
another session computed them). Tiny random-weight checkpoints are built in a temporary
directory; ``--hidden-size`` / ``--layers`` size them (compute, not Python overhead, should
dominate a step for the TTFT ratio to mean anything).

vLLM: its CPU build (0.32) is not run here: its Qwen3-Next Gated DeltaNet layers need Triton
kernels (FLA) that have no CPU backend; see docs/benchmarks.md for the check.

    .venv/bin/python benchmarks/hybrid_multiturn.py                    # 8 x 8, Qwen3-Next
    .venv/bin/python benchmarks/hybrid_multiturn.py --arch BailingHybridForCausalLM
"""
from __future__ import annotations

import argparse
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

MODES = ("snap", "off", "dense")


def size_overrides(arch: str, hidden: int, layers: int) -> dict:
    """Checkpoint fields that scale a tiny model to ``hidden`` x ``layers``."""
    heads = max(hidden // 64, 1)
    if arch == "LlamaForCausalLM":
        return dict(hidden_size=hidden, intermediate_size=4 * hidden, num_hidden_layers=layers,
                    num_attention_heads=heads * 2, num_key_value_heads=heads)
    if arch == "Qwen3NextForCausalLM":
        return dict(hidden_size=hidden, intermediate_size=4 * hidden, num_hidden_layers=layers,
                    num_attention_heads=heads * 2, num_key_value_heads=heads, head_dim=32,
                    linear_num_key_heads=heads, linear_num_value_heads=heads * 2,
                    linear_key_head_dim=32, linear_value_head_dim=32,
                    moe_intermediate_size=hidden, shared_expert_intermediate_size=hidden)
    return dict(hidden_size=hidden, num_hidden_layers=layers)


def ttft_p50(r: ModeResult, first_turn: int = 0) -> float:
    return statistics.median(x for row in r.ttft_by_turn[first_turn:] for x in row)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--arch", default="Qwen3NextForCausalLM")
    ap.add_argument("--hidden-size", type=int, default=256)
    ap.add_argument("--layers", type=int, default=8)
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
    for kind, arch in (("hybrid", args.arch), ("dense", "LlamaForCausalLM")):
        if kind == "hybrid" and not {"snap", "off"} & set(modes) or kind == "dense" and "dense" not in modes:
            continue
        path = build_tiny_checkpoint(os.path.join(tmp, kind), arch, seed=args.seed,
                                     **size_overrides(arch, args.hidden_size, args.layers))
        models[kind] = load_model(str(path))
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

    print(f"{'turn':>4}" + "".join(f"{'TTFT ' + m + ' (ms)':>18}{'(steps)':>8}" for m in results))
    for t in range(w.turns):
        print(f"{t + 1:>4}" + "".join(f"{1000 * statistics.mean(r.ttft_by_turn[t]):>18.1f}"
                                      f"{statistics.mean(r.ttft_steps_by_turn[t]):>8.1f}" for r in results.values()))
    summary: dict[str, float] = {}
    if "snap" in results and "off" in results:
        on, off = results["snap"], results["off"]
        same = sum(on.outputs[k] == off.outputs[k] for k in off.outputs)
        summary.update(ttft_ratio=ttft_p50(off) / ttft_p50(on), ttft_ratio_turns2=ttft_p50(off, 1) / ttft_p50(on, 1),
                       total_ratio=off.total_s / on.total_s)
        print(f"snap vs off: TTFT p50 x{summary['ttft_ratio']:.2f} lower (turns 2+: "
              f"x{summary['ttft_ratio_turns2']:.2f}), total time x{summary['total_ratio']:.2f} faster; "
              f"outputs identical {same}/{len(off.outputs)}")
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
