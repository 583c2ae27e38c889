"""The draft gate's decisions replayed on recorded greedy answers, free of the machine's noise.

Speculation is lossless, so a greedy answer is the same with any drafts: record each answer once
(no speculation), then replay its decode step by step: at each step the real proposer (ngram or
suffix) drafts from the context so far, the real decision rule of the engine's speculative
decoder picks how many drafts to send (``SpeculativeDecoder._cut``: the draft gate, or with
``gate=False`` the match-length rule before it), the drafts accepted are those equal to the
recorded answer, and the step costs the engine's own start-up time for a step of that many rows
(``SpeculativeDecoder.calibrate`` on the loaded model). The modelled speed-up is tokens per
modelled second against one token per one-row step. Each request starts from fresh statistics,
as in ``spec_decode.py``'s single-stream runs (a fresh engine per prompt).

It leaves out what the replay cannot see: the proposer's own time (0.02-0.05 ms a step) and the
load of the machine; ``spec_decode.py`` measures those. Prompts: agent turns over
standard-library functions (a seed neither the drafter's traces nor ``spec_decode.py`` use)
and prose prompts of their own, plus ``spec_decode.py``'s two workloads with ``--with-bench``.

    python benchmarks/spec_gate_replay.py [--prompts 24] [--max-tokens 96] [--with-bench]
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "benchmarks"))

SUBJECTS = ["a tailor who sews a coat for a giant", "a boy who talks to the wind", "a lost dog in a big city",
            "an old woman who grows blue roses", "a robot that learns to paint", "two brothers building a boat",
            "a cat that guards a library", "a musician who forgets a song", "a village that never sleeps",
            "a farmer and a talking crow", "a soldier coming home", "a girl who collects stones"]
PLACES = ["a frozen lake at midnight", "a crowded train in the rain", "a quiet monastery in the hills",
          "a jungle after the rain", "a fishing village at dawn", "a city square on a holiday",
          "an abandoned castle", "a vineyard in autumn", "a bakery before sunrise",
          "a school on the last day of term", "a ship in a calm sea", "a garden at night"]


def prompts(n: int, tokenizer, with_bench: bool) -> dict[str, list[list[int]]]:
    from tokenmill.train.traces import agent_prompts

    def enc(conv):
        text = tokenizer.apply_chat_template(conv, tokenize=False, add_generation_prompt=True)
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])

    prose = [f"Write a short story about {s}." for s in SUBJECTS] + [f"Describe {p}." for p in PLACES]
    out = {"agent": [enc(c) for c in agent_prompts(n, seed=31337)],
           "prose": [enc([{"role": "user", "content": p}]) for p in prose[:n]]}
    if with_bench:
        from spec_decode import workloads

        for name, ps in workloads(4, tokenizer).items():
            out[f"bench-{name}"] = ps
    return out


def replay(decoder, proposer_factory, answers: list[tuple[list[int], list[int]]], costs: dict[int, float],
           gate: bool | None) -> tuple[float, int, int, int]:
    """(modelled seconds, decode steps, drafted steps, tokens those emitted) over ``answers``,
    each on fresh statistics; ``gate`` None: no speculation."""
    from tokenmill import SamplingParams
    from tokenmill.engine.request import Request
    from tokenmill.engine.spec.base import ConfidenceCalibration

    seconds = 0.0
    steps = drafted = drafted_tokens = 0
    for i, (prompt, answer) in enumerate(answers):
        proposer = proposer_factory()
        decoder.proposer = proposer
        decoder.gate = bool(gate)
        decoder.calibration = ConfidenceCalibration()
        decoder.kinds = {}
        decoder._steps = 1
        req = Request(f"r{i}", list(prompt), SamplingParams(max_tokens=len(answer) + 1))
        done = 1                        # the first token comes from the prefill
        while done < len(answer):
            req.all_token_ids = list(prompt) + answer[:done]
            decoder._steps += 1
            k = min(decoder.k, len(answer) - done - 1)
            n, accepted, draft = 0, 0, None
            if gate is not None and k > 0:
                draft = proposer.propose([req], [k])[0]
                if draft.token_ids:
                    n = decoder._cut([req], [draft], 1)[0]
            if n:
                while accepted < n and draft.token_ids[accepted] == answer[done + accepted]:
                    accepted += 1
                if decoder.gate and draft.confidence is not None:
                    decoder.calibration.record(draft.confidence[:n], n, accepted)
                if draft.kind is not None:
                    decoder._kind(draft.kind).record(n, accepted)
                drafted += 1
                drafted_tokens += accepted + 1
            seconds += costs[min(1 + n, max(costs))]
            steps += 1
            done += accepted + 1
    return seconds, steps, drafted, drafted_tokens


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=24, help="prompts per workload")
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--with-bench", action="store_true", help="also spec_decode.py's agent and prose prompts")
    args = ap.parse_args()
    import torch

    from tokenmill import LLM, SamplingParams
    from tokenmill.engine.spec.ngram import NgramProposer
    from tokenmill.engine.spec.suffix import SuffixProposer
    from tokenmill.loader import load_model

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    print(f"load average at start: {open('/proc/loadavg').read().strip()}")
    loaded = load_model("smollm2-135m-instruct")
    llm = LLM(loaded=loaded, kv_cache_tokens=32768, speculative_method="suffix")
    eng = llm.engine
    decoder = eng.spec
    costs = dict(decoder.table.calibrated)
    print("start-up step times (ms, rows: time): "
          + ", ".join(f"{n}: {1000 * t:.2f}" for n, t in sorted(costs.items())))
    control = eng.spec.proposer.control_token_ids
    cfg = eng.config

    def ngram():
        p = NgramProposer(cfg.prompt_lookup_min, cfg.prompt_lookup_max)
        p.control_token_ids = control
        return p

    def suffix():
        p = SuffixProposer(cfg.suffix_max_depth, cfg.suffix_cache_tokens, cfg.suffix_min_prob)
        p.control_token_ids = control
        return p

    greedy = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    print(f"\n{'workload':12s} {'config':14s} {'x none':>7s} {'steps':>6s} {'drafted':>8s} {'per drafted':>11s}")
    for name, ps in prompts(args.prompts, loaded.tokenizer, args.with_bench).items():
        plain = LLM(loaded=loaded, kv_cache_tokens=32768)
        answers = [(p, list(o.token_ids)) for p, o in zip(ps, plain.generate(ps, greedy))]
        base_s, base_steps, _, _ = replay(decoder, ngram, answers, costs, None)
        base_rate = sum(len(a) - 1 for _, a in answers) / base_s
        for label, factory, gate in (("ngram", ngram, True), ("ngram-nogate", ngram, False),
                                     ("suffix", suffix, True), ("suffix-nogate", suffix, False)):
            s, steps, drafted, dtok = replay(decoder, factory, answers, costs, gate)
            rate = sum(len(a) - 1 for _, a in answers) / s
            per = f"{dtok / drafted:11.2f}" if drafted else f"{'-':>11s}"
            print(f"{name:12s} {label:14s} {rate / base_rate:7.3f} {steps:6d} {drafted:8d} {per}", flush=True)
    print(f"\nload average at end: {open('/proc/loadavg').read().strip()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
