"""Speculative decoding on a tiny hybrid (linear-attention) model: single-stream greedy decode
speed and acceptance, without speculation and with the ngram and suffix proposers, side by side.

Random-weight checkpoints have no structure for prompt lookup to find, so the workloads are
about the proposers' two regimes rather than about realistic acceptance:

* ``repeat``: every prompt is answered once untimed, then again timed; the suffix proposer's
  global index holds the first answer, so its drafts are right (an agent re-reading its own
  earlier output); ngram finds little;
* ``fresh``: new prompts made of a run repeated four times, so prompt lookup proposes drafts that
  the model rejects: the cost of verifying rejected drafts (the hybrid verify rows run the
  recurrent update position by position and keep per-position states), which adaptive ``k``
  should keep small; ``ngram-fixed`` (adaptive k off) shows the raw cost.

The prefix cache is on in every mode (the timed repeat pass reuses the cached prompt in all of
them). One engine per mode on the same loaded weights, a warm-up request first.

    .venv/bin/python benchmarks/hybrid_spec.py
    .venv/bin/python benchmarks/hybrid_spec.py --arch BailingHybridForCausalLM --hidden-size 512
"""
from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from hybrid_multiturn import size_overrides  # noqa: E402

from tokenmill import LLM, SamplingParams  # noqa: E402
from tokenmill.loader import load_model  # noqa: E402
from tokenmill.loader.tiny import build_tiny_checkpoint  # noqa: E402

MODES = ("off", "ngram", "suffix", "ngram-fixed")   # ngram-fixed: adaptive k off (always k drafts)


def run(lm, mode: str, prompts: list[list[int]], params: SamplingParams, repeat: bool, k: int) -> dict:
    kw = {} if mode == "off" else dict(speculative_method=mode.split("-")[0], num_speculative_tokens=k,
                                       speculative_adaptive=not mode.endswith("-fixed"))
    llm = LLM(loaded=lm, kv_cache_tokens=16384, **kw)
    llm.generate([[5, 6, 7, 8] * 8], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))  # warm-up
    outs = []
    if repeat:
        for p in prompts:
            outs.append(list(llm.generate([p], params)[0].token_ids))
    before = llm.engine.spec.stats.snapshot() if llm.engine.spec is not None else None
    t0 = time.perf_counter()
    timed = [list(llm.generate([p], params)[0].token_ids) for p in prompts]
    dt = time.perf_counter() - t0
    res = {"tok_s": sum(map(len, timed)) / dt, "outputs": timed, "accept_len": 1.0}
    if before is not None:
        st = llm.engine.spec.stats
        steps, emitted = st.verify_steps - before.verify_steps, st.emitted - before.emitted
        res["accept_len"] = emitted / steps if steps else 1.0
        res["proposed"], res["accepted"] = st.proposed - before.proposed, st.accepted - before.accepted
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", default="Qwen3NextForCausalLM")
    ap.add_argument("--hidden-size", type=int, default=256)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--prompt-tokens", type=int, default=200)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--num-speculative-tokens", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    rng = random.Random(args.seed)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    with tempfile.TemporaryDirectory() as tmp:
        path = build_tiny_checkpoint(tmp, args.arch, seed=args.seed,
                                     **size_overrides(args.arch, args.hidden_size, args.layers))
        lm = load_model(str(path))
        print(f"model {args.arch} (hidden {args.hidden_size}, {args.layers} layers), {args.prompts} prompts of "
              f"{args.prompt_tokens} tokens, {args.max_tokens} generated each, k={args.num_speculative_tokens}, "
              f"single stream; load {open('/proc/loadavg').read().split()[0]}")
        for workload in ("repeat", "fresh"):
            n = args.prompt_tokens if workload == "repeat" else args.prompt_tokens // 4
            prompts = [[rng.randrange(3, 40000) for _ in range(n)] * (1 if workload == "repeat" else 4)
                       for _ in range(args.prompts)]
            results = {m: run(lm, m, prompts, params, workload == "repeat", args.num_speculative_tokens)
                       for m in MODES}
            base = results["off"]
            for m, r in results.items():
                same = r["outputs"] == base["outputs"]
                extra = f", drafts {r['accepted']}/{r['proposed']} accepted" if "proposed" in r else ""
                print(f"  {workload:6s} {m:11s}: {r['tok_s']:7.1f} tok/s  x{r['tok_s'] / base['tok_s']:.2f}  "
                      f"acceptance length {r['accept_len']:.2f}{extra}  outputs == off: {same}")


if __name__ == "__main__":
    main()
