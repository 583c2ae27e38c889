"""Multi-turn agent sessions with the radix prefix cache on and off, side by side in one run.

Workload (all randomness from --seed): ``--sessions`` closed-loop sessions of ``--turns`` turns.
Turn 1's prompt is ``--system-tokens`` shared tokens plus ``--new-tokens`` session tokens; turn
T's prompt is turn T-1's prompt + its output + ``--new-tokens`` fresh tokens. Every turn
generates exactly ``--max-tokens`` tokens (greedy, ignore_eos). Prompt tokens are random ids of
the model's vocabulary: only lengths and sharing matter here.

Driver: the engine's own step loop (``Engine.add_request`` / ``Engine.step``), one thread. All
sessions start together; a session submits its next turn as soon as the previous one finishes
(``--think-steps`` engine steps later, default 0). TTFT of a request = wall time from
``add_request`` to the end of the step that returns its first token, so it includes queueing
behind other sessions' work; it is also given in engine steps, which does not depend on how
busy the machine is. Each mode gets a fresh engine on the same loaded weights and a
warm-up request first (not counted).

Modes: ``off`` (no prefix cache), ``on`` (cache, cache-aware admission), ``on-fifo`` (cache,
strict arrival-order admission). The theoretical maximum CHR assumes an unbounded cache and
whole-page matching: turn T can reuse the whole pages of turn T-1's computed tokens (its last
sampled token has no KV yet), and turn 1 the whole pages of the system prompt if any session
computed it before.

    .venv/bin/python benchmarks/multiturn_cache.py                      # 8 x 8, ~150 new, 16 out
    .venv/bin/python benchmarks/multiturn_cache.py --kv-cache-tokens 6144 --modes on,on-fifo
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from dataclasses import dataclass, field

from tokenmill.engine.config import EngineConfig
from tokenmill.engine.engine import Engine
from tokenmill.contracts.sampling import SamplingParams
from tokenmill.loader import load_model
from tokenmill.loader.resolve import DEFAULT_MODEL

MODES = ("off", "on", "on-fifo")


@dataclass
class Workload:
    system: list[int]
    new_tokens: list[list[list[int]]]    # [session][turn] fresh tokens of that turn

    @property
    def sessions(self) -> int:
        return len(self.new_tokens)

    @property
    def turns(self) -> int:
        return len(self.new_tokens[0])


def make_workload(args: argparse.Namespace, vocab: int) -> Workload:
    rng = random.Random(args.seed)

    def toks(n: int) -> list[int]:
        return [rng.randrange(10, vocab) for _ in range(n)]

    spread = args.new_tokens // 10
    return Workload(toks(args.system_tokens),
                    [[toks(args.new_tokens + rng.randint(-spread, spread))
                      for _ in range(args.turns)] for _ in range(args.sessions)])


def theoretical_max_chr(w: Workload, out_len: int, page: int) -> tuple[float, float]:
    """(page-aware maximum, token-level maximum) CHR of the workload with an unbounded cache."""
    prompt_total = hit_pages = hit_tokens = 0
    for s in range(w.sessions):
        prev_seq = 0
        for t in range(w.turns):
            prompt = (len(w.system) if t == 0 else prev_seq) + len(w.new_tokens[s][t])
            if t == 0:
                shared_computed = len(w.system) if s > 0 else 0
            else:
                shared_computed = prev_seq - 1
            hit_pages += (min(shared_computed, prompt - 1) // page) * page
            hit_tokens += min(prev_seq if t else shared_computed, prompt - 1)
            prompt_total += prompt
            prev_seq = prompt + out_len
    return hit_pages / prompt_total, hit_tokens / prompt_total


@dataclass
class ModeResult:
    mode: str
    total_s: float
    ttft_by_turn: list[list[float]] = field(default_factory=list)   # [turn][session]
    ttft_steps_by_turn: list[list[int]] = field(default_factory=list)   # same, in engine steps
    prompt_tokens: int = 0
    cached_tokens: int = 0
    preemptions: int = 0
    outputs: dict[tuple[int, int], list[int]] = field(default_factory=dict)

    @property
    def chr(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


def run_mode(mode: str, loaded, w: Workload, args: argparse.Namespace, **config) -> ModeResult:
    """One mode on a fresh engine; ``config``: further EngineConfig fields."""
    cfg = EngineConfig(model=args.model, page_size=args.page_size,
                       kv_cache_tokens=args.kv_cache_tokens,
                       max_batch_tokens=args.max_batch_tokens,
                       max_running_requests=args.max_running_requests,
                       enable_prefix_cache=(mode != "off"), **config)
    engine = Engine(cfg, loaded=loaded)
    if hasattr(engine.scheduler, "prefer_cached_prefix"):
        engine.scheduler.prefer_cached_prefix = (mode == "on")
    elif mode == "on-fifo":
        raise SystemExit("this engine has no cache-aware admission switch; drop mode on-fifo")
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    # Warm-up (not counted): one request of unrelated tokens.
    engine.add_request("warmup", [11] * 64, params)
    while engine.has_unfinished_requests():
        engine.step()
    base = engine.stats()

    res = ModeResult(mode, 0.0, [[0.0] * w.sessions for _ in range(w.turns)],
                     [[0] * w.sessions for _ in range(w.turns)])
    added_step: dict[str, int] = {}
    history: list[list[int]] = [list(w.system) for _ in range(w.sessions)]
    turn_of = [0] * w.sessions
    added_at: dict[str, float] = {}
    first_token: set[str] = set()
    ready_at_step = [0] * w.sessions   # step index at which a session submits its next turn
    pending = set(range(w.sessions))
    done_per_turn = [0] * w.turns
    step = 0

    def submit(s: int) -> None:
        t = turn_of[s]
        prompt = history[s] + w.new_tokens[s][t]
        history[s] = prompt
        rid = f"s{s}-t{t}"
        engine.add_request(rid, prompt, params, session_id=f"s{s}")
        added_at[rid] = time.perf_counter()
        added_step[rid] = step
        pending.discard(s)

    t0 = time.perf_counter()
    for s in range(w.sessions):
        submit(s)
    while engine.has_unfinished_requests() or pending:
        for s in sorted(pending):
            if ready_at_step[s] <= step:
                submit(s)
        outs = engine.step()
        step += 1
        now = time.perf_counter()
        for o in outs:
            s_str, t_str = o.request_id[1:].split("-t")
            s, t = int(s_str), int(t_str)
            if o.request_id not in first_token:
                first_token.add(o.request_id)
                res.ttft_by_turn[t][s] = now - added_at[o.request_id]
                res.ttft_steps_by_turn[t][s] = step - added_step[o.request_id]
            if o.finished:
                res.outputs[(s, t)] = list(o.token_ids)
                done_per_turn[t] += 1
                if done_per_turn[t] == w.sessions:
                    print(f"  [{mode}] turn {t + 1} done by all sessions at "
                          f"{now - t0:.1f}s", file=sys.stderr, flush=True)
                history[s] = history[s] + list(o.token_ids)
                if t + 1 < w.turns:
                    turn_of[s] = t + 1
                    ready_at_step[s] = step + args.think_steps
                    pending.add(s)
    res.total_s = time.perf_counter() - t0
    st = engine.stats()
    res.prompt_tokens = st.prompt_tokens_total - base.prompt_tokens_total
    res.cached_tokens = st.cached_tokens_total - base.cached_tokens_total
    res.preemptions = st.num_preemptions
    engine.check_pages()
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--sessions", type=int, default=8)
    ap.add_argument("--turns", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=150, help="fresh tokens per turn (+-10%%)")
    ap.add_argument("--system-tokens", type=int, default=0, help="prompt prefix shared by all")
    ap.add_argument("--max-tokens", type=int, default=16, help="generated tokens per turn")
    ap.add_argument("--think-steps", type=int, default=0,
                    help="engine steps between a turn's end and the next turn's arrival")
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--max-batch-tokens", type=int, default=512)
    ap.add_argument("--max-running-requests", type=int, default=64)
    ap.add_argument("--kv-cache-tokens", type=int, default=32768)
    ap.add_argument("--modes", default="off,on", help=f"comma list of {MODES}")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch default)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None, help="also write the results here")
    args = ap.parse_args(argv)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    bad = [m for m in modes if m not in MODES]
    if bad or not modes:
        ap.error(f"unknown mode(s) {bad}; choose from {MODES}")
    if args.threads:
        import torch
        torch.set_num_threads(args.threads)

    t_load = time.perf_counter()
    loaded = load_model(args.model)
    print(f"model {loaded.name} loaded in {time.perf_counter() - t_load:.1f}s", flush=True)
    w = make_workload(args, int(loaded.model.args.vocab_size))
    max_chr, max_chr_tokens = theoretical_max_chr(w, args.max_tokens, args.page_size)
    print(f"workload: {w.sessions} sessions x {w.turns} turns, ~{args.new_tokens} new tokens "
          f"per turn, {args.max_tokens} generated, system prompt {len(w.system)} tokens, "
          f"page {args.page_size}")
    print(f"theoretical max CHR: {max_chr:.4f} (whole pages), {max_chr_tokens:.4f} (token level)")

    results: list[ModeResult] = []
    for mode in modes:
        r = run_mode(mode, loaded, w, args)
        results.append(r)
        print(f"[{mode}] total {r.total_s:.2f}s  CHR {r.chr:.4f}  prompt {r.prompt_tokens}  "
              f"cached {r.cached_tokens}  preemptions {r.preemptions}", flush=True)

    ref = results[0]
    for r in results[1:]:
        same = sum(r.outputs[k] == ref.outputs[k] for k in ref.outputs)
        print(f"outputs identical to {ref.mode}: {r.mode} {same}/{len(ref.outputs)}")
    header = "turn " + "".join(f"{'TTFT ' + r.mode + ' (ms)':>20}{'(steps)':>9}"
                               for r in results)
    print(header)
    for t in range(w.turns):
        cells = "".join(f"{1000 * statistics.mean(r.ttft_by_turn[t]):>20.1f}"
                        f"{statistics.mean(r.ttft_steps_by_turn[t]):>9.1f}" for r in results)
        print(f"{t + 1:>4} {cells}")
    cells = "".join(f"{1000 * statistics.mean(x for row in r.ttft_by_turn for x in row):>20.1f}"
                    f"{statistics.mean(x for row in r.ttft_steps_by_turn for x in row):>9.1f}"
                    for r in results)
    print(f"mean {cells}")
    for r in results[1:]:
        print(f"{r.mode} vs {ref.mode}: total time x{ref.total_s / r.total_s:.2f} faster, mean TTFT "
              f"x{statistics.mean(x for row in ref.ttft_by_turn for x in row) / statistics.mean(x for row in r.ttft_by_turn for x in row):.2f} lower")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "max_chr": max_chr, "max_chr_tokens": max_chr_tokens,
                       "results": [{"mode": r.mode, "total_s": r.total_s, "chr": r.chr,
                                    "prompt_tokens": r.prompt_tokens,
                                    "cached_tokens": r.cached_tokens,
                                    "preemptions": r.preemptions,
                                    "ttft_by_turn": r.ttft_by_turn,
                                    "ttft_steps_by_turn": r.ttft_steps_by_turn}
                                   for r in results]},
                      f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
