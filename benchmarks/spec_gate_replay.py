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

Bounds (``--bounds``): what a drafter that knew the answer would get from the same step times.
Its steps send only drafts that will be accepted, and a backward pass over the answer chooses
how many of them each step sends so that the answer's modelled time is least (a row that costs
more than it brings is left out), so the figure is a ceiling on any rule that decides how many
drafts to send:
  - ``clairvoyant-ngram`` / ``-suffix``: the proposer's own draft, cut where it goes wrong (the
    ceiling of the decision rule, with that proposer's choice of what to copy);
  - ``copy-m2`` / ``copy-m1``: the best copy anywhere in the context (prompt and answer so far)
    that follows an occurrence of the last 2 / 1 tokens (the ceiling of any model-free copying
    drafter that keys on 2 / 1 tokens, however it chooses among the occurrences).

    python benchmarks/spec_gate_replay.py [--prompts 24] [--max-tokens 96] [--with-bench]
        [--quantization none] [--k 8] [--bounds]
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


def _copy_run(full: list[int], c: int, p: int, limit: int) -> int:
    """How many tokens from ``full[c]`` on equal those from ``full[p]`` on (p < c), copying only
    what precedes ``c`` and at most ``limit``."""
    n = 0
    while n < limit and p + n < c and full[p + n] == full[c + n]:
        n += 1
    return n


def bound(proposer_factory, answers: list[tuple[list[int], list[int]]], costs: dict[int, float], k: int,
          min_match: int = 0) -> tuple[float, int, int, int]:
    """The clairvoyant ceilings of the module docstring, as ``replay``'s tuple: drafts from
    ``proposer_factory`` if given, else the best copy after an occurrence of the last
    ``min_match`` tokens. At each position the longest draft that would be accepted is known, and
    a backward pass over the answer picks how many of it each step sends so that the answer's
    total modelled time is least (sending fewer may pay where a row costs more than it brings)."""
    from tokenmill import SamplingParams
    from tokenmill.engine.request import Request

    top = max(costs)
    cost = [0.0] + [costs[min(r, top)] for r in range(1, k + 2)]
    seconds = 0.0
    steps = drafted = drafted_tokens = 0
    for i, (prompt, answer) in enumerate(answers):
        proposer = proposer_factory() if proposer_factory else None
        req = Request(f"r{i}", list(prompt), SamplingParams(max_tokens=len(answer) + 1))
        full = list(prompt) + list(answer)
        most = [0] * len(answer)        # the longest accepted draft at each answer position
        for done in range(1, len(answer)):
            c = len(prompt) + done
            kk = min(k, len(answer) - done - 1)
            if kk <= 0:
                continue
            if proposer is not None:
                req.all_token_ids = full[:c]
                draft = proposer.propose([req], [kk])[0]
                n = 0
                while n < len(draft.token_ids) and draft.token_ids[n] == full[c + n]:
                    n += 1
            else:
                n, key = 0, full[c - min_match:c]
                for p in range(min_match, c):
                    if full[p] == full[c] and full[p - min_match:p] == key:
                        n = max(n, _copy_run(full, c, p, kk))
                        if n == kk:
                            break
            most[done] = n
        # least time from each position to the end, and the drafts sent there
        best, send = [0.0] * (len(answer) + 1), [0] * (len(answer) + 1)
        for done in range(len(answer) - 1, 0, -1):
            options = [(cost[m + 1] + best[min(done + m + 1, len(answer))], m) for m in range(most[done] + 1)]
            best[done], send[done] = min(options)
        done = 1
        while done < len(answer):
            n = send[done]
            seconds += cost[n + 1]
            steps += 1
            if n:
                drafted += 1
                drafted_tokens += n + 1
            done += n + 1
    return seconds, steps, drafted, drafted_tokens


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=24, help="prompts per workload")
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--with-bench", action="store_true", help="also spec_decode.py's agent and prose prompts")
    ap.add_argument("--quantization", default=None,
                    help="weights as in serve (default: the GGUF's blocks; none: fp32), which set the step times")
    ap.add_argument("--k", type=int, default=None, help="num_speculative_tokens (default: the engine's)")
    ap.add_argument("--bounds", action="store_true", help="also the clairvoyant ceilings (module docstring)")
    args = ap.parse_args()
    import torch

    from tokenmill import LLM, SamplingParams
    from tokenmill.engine.spec.ngram import NgramProposer
    from tokenmill.engine.spec.suffix import SuffixProposer
    from tokenmill.loader import load_model

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    print(f"load average at start: {open('/proc/loadavg').read().strip()}")
    loaded = load_model("smollm2-135m-instruct", quantization=args.quantization)
    llm = LLM(loaded=loaded, kv_cache_tokens=32768, speculative_method="suffix",
              **({"num_speculative_tokens": args.k} if args.k else {}))
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
    print(f"\n{'workload':12s} {'config':18s} {'x none':>7s} {'steps':>6s} {'drafted':>8s} {'per drafted':>11s}")
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
            print(f"{name:12s} {label:18s} {rate / base_rate:7.3f} {steps:6d} {drafted:8d} {per}", flush=True)
        if args.bounds:
            for label, factory, m in (("clairvoyant-ngram", ngram, 0), ("clairvoyant-suffix", suffix, 0),
                                      ("copy-m2", None, 2), ("copy-m1", None, 1)):
                s, steps, drafted, dtok = bound(factory, answers, costs, decoder.k, m)
                rate = sum(len(a) - 1 for _, a in answers) / s
                per = f"{dtok / drafted:11.2f}" if drafted else f"{'-':>11s}"
                print(f"{name:12s} {label:18s} {rate / base_rate:7.3f} {steps:6d} {drafted:8d} {per}", flush=True)
    print(f"\nload average at end: {open('/proc/loadavg').read().strip()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
