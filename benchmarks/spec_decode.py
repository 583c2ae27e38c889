"""Speculative decoding side by side: none / ngram / suffix / dflash (base) / dflash (fine-tuned),
and vLLM's CPU build with its n-gram speculator, on the same prompts in one run.

Two workloads on SmolLM2-135M-Instruct, greedy:

* agent: turns whose answer reuses the context (rename a function and show it, add a docstring,
  return a JSON record with one field changed, explain a traceback that quotes the code), over
  standard-library functions chosen with a seed the drafter's training traces did not use;
* prose: free writing on topics absent from the training prompts.

Per configuration and workload: single-stream decode tok/s (each of the first ``--single``
prompts alone on a fresh engine; all decode tokens after the first / their time), acceptance
length (output tokens per decode step), and total output tok/s with the prompts at concurrency
4. The configurations run interleaved (prompt by prompt, ``--rounds`` rounds, every other one in
reverse order) so that the machine's changing load hits them alike. The concurrent batch runs
``--c4-reps`` times per round for every configuration, interleaved the same way; besides the
total rate, each configuration's c4 ratio to no speculation is given as the median over those
runs of the ratio to the adjacent run without it ("c4 paired"): one batch takes a few seconds, and
this host's speed moves by up to 1.5x over that time, so a ratio of totals over two batches can
read 0.6x or 1.2x for the same code. Single stream gets the same paired ratio: the median over
prompts and rounds of each run's rate over the run without speculation on the same prompt and
round. tokenmill runs in-process
(offline engine, ``OMP_NUM_THREADS`` threads); vLLM through its OpenAI server (streaming, 2
threads), started by ``benchmarks/peers.py``.

    python benchmarks/spec_decode.py [--max-tokens 112] [--prompts 4] [--rounds 2] [--c4-reps 3]
                                     [--no-vllm] [--spec-gate on|off|both]
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "benchmarks"))

PROSE = ["Write a short story about a clockmaker who loses her keys.",
         "Describe a thunderstorm over a mountain village.",
         "Write a letter from a sailor to his sister about the first week at sea.",
         "Explain why people enjoy walking in autumn forests.",
         "Write a fable about a fox and a heron who share a river.",
         "Describe the morning market of a small coastal town."]


def workloads(n: int, tokenizer) -> dict[str, list[list[int]]]:
    from tokenmill.train.traces import agent_prompts

    def enc(conv):
        text = tokenizer.apply_chat_template(conv, tokenize=False, add_generation_prompt=True)
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])

    agent = [enc(c) for c in agent_prompts(n, seed=4242)]
    prose = [enc([{"role": "user", "content": p}]) for p in PROSE[:n]]
    return {"agent": agent, "prose": prose}


def _single(loaded, prompt: list[int], max_tokens: int, spec: dict) -> tuple[list[int], float, int, tuple[int, int]]:
    """One prompt alone on a fresh engine (so the suffix index knows nothing of earlier runs):
    (output ids, seconds from the first to the last token, decode steps after the first,
    (steps that verified drafts, tokens those steps emitted))."""
    from tokenmill import LLM, SamplingParams

    llm = LLM(loaded=loaded, kv_cache_tokens=16384, **spec)
    eng = llm.engine
    llm.generate([prompt[:16]], SamplingParams(max_tokens=4, temperature=0.0))  # warm-up
    eng.flush_cache()
    eng.add_request("s", prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0))
    first = last = None
    n_steps = 0
    final = None
    while eng.has_unfinished_requests():
        for o in eng.step():
            now = time.perf_counter()
            if first is None:
                first = now
            else:
                n_steps += 1
            last = now
            if o.finished:
                final = o
    st = eng.spec.stats if eng.spec is not None else None
    return list(final.token_ids), last - first, n_steps, (st.verify_steps, st.emitted) if st else (0, 0)


def _concurrent(loaded, prompts: list[list[int]], max_tokens: int, spec: dict) -> tuple[int, float]:
    """All prompts at once on a fresh engine: (output tokens, wall seconds incl. prefill)."""
    from tokenmill import LLM, SamplingParams

    llm = LLM(loaded=loaded, kv_cache_tokens=16384, **spec)
    llm.generate([prompts[0][:16]], SamplingParams(max_tokens=4, temperature=0.0))
    llm.engine.flush_cache()
    t0 = time.perf_counter()
    batch = llm.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0.0))
    return sum(len(o.token_ids) for o in batch), time.perf_counter() - t0


def run_tokenmill(loaded, configs: dict[str, dict], prompts: list[list[int]], max_tokens: int, single: int,
                  rounds: int, c4_reps: int = 1) -> dict[str, dict]:
    """Every configuration on the same prompts, interleaved: each round runs prompt 1 under every
    configuration, then prompt 2, ... (odd rounds in reverse configuration order), so a change of
    the machine's load hits all configurations alike. Decode tok/s = all single-stream decode
    tokens / their time; c4 = the prompts at once, ``c4_reps`` times per round, tokens / wall time,
    and each run's rate over that of the run without speculation next to it (``c4_paired``)."""
    labels = list(configs)
    acc = {k: {"tokens": 0, "seconds": 0.0, "steps": 0, "c4_tokens": 0, "c4_seconds": 0.0, "outputs": [],
               "verify_steps": 0, "verify_emitted": 0, "c4_runs": [], "single_runs": []}
           for k in labels}
    for r in range(rounds):
        order = labels if r % 2 == 0 else labels[::-1]
        for i, p in enumerate(prompts[:single]):
            _single(loaded, p, max_tokens, {})   # unmeasured: whoever runs a prompt first pays its warm-up
            for label in order:
                ids, secs, steps, (vsteps, vemitted) = _single(loaded, p, max_tokens, configs[label])
                a = acc[label]
                a["verify_steps"] += vsteps
                a["verify_emitted"] += vemitted
                a["tokens"] += len(ids) - 1
                a["seconds"] += secs
                a["single_runs"].append((len(ids) - 1) / secs)
                a["steps"] += steps
                if r == 0:
                    a["outputs"].append(ids)
        for rep in range(c4_reps):
            for label in (order if rep % 2 == 0 else order[::-1]):
                n, secs = _concurrent(loaded, prompts, max_tokens, configs[label])
                acc[label]["c4_tokens"] += n
                acc[label]["c4_seconds"] += secs
                acc[label]["c4_runs"].append(n / secs)
    base = acc["none"]["c4_runs"] if "none" in acc else None
    base1 = acc["none"]["single_runs"] if "none" in acc else None
    return {k: {"decode_tok_s": a["tokens"] / a["seconds"],
                "acceptance_length": a["tokens"] / a["steps"] if a["steps"] else None,
                # vLLM's metric: tokens per step that verified drafts (steps without one left out)
                "accept_per_drafted_step": a["verify_emitted"] / a["verify_steps"] if a["verify_steps"] else None,
                "total_tok_s_c4": a["c4_tokens"] / a["c4_seconds"], "c4_runs": a["c4_runs"],
                "c4_paired": (statistics.median(x / y for x, y in zip(a["c4_runs"], base)) if base else None),
                # each single-stream run over the run without speculation on the same prompt and round
                "single_paired": (statistics.median(x / y for x, y in zip(a["single_runs"], base1))
                                  if base1 else None),
                "outputs": a["outputs"]}
            for k, a in acc.items()}


def run_vllm(prompts: dict[str, list[list[int]]], max_tokens: int, spec: dict | None, single: int) -> dict:
    import httpx
    from peers import PeerNotInstalled, PeerStartError, start_vllm

    extra = ["--speculative-config", json.dumps(spec)] if spec else []
    try:
        srv = start_vllm(extra_args=extra, threads=2)
    except (PeerNotInstalled, PeerStartError) as e:
        return {"error": str(e)[-1500:]}
    results = {}
    try:
        with srv, httpx.Client(base_url=srv.base_url, timeout=600) as c:
            def one(p):
                t_first = t_last = None
                n = 0
                with c.stream("POST", "/v1/completions", json={
                        "model": srv.model, "prompt": p, "max_tokens": max_tokens, "temperature": 0.0,
                        "stream": True, "stream_options": {"include_usage": True}}) as r:
                    for line in r.iter_lines():
                        if not line.startswith("data: ") or line == "data: [DONE]":
                            continue
                        chunk = json.loads(line[6:])
                        if chunk.get("usage"):
                            n = chunk["usage"]["completion_tokens"]
                        if chunk.get("choices") and chunk["choices"][0].get("text"):
                            now = time.perf_counter()
                            t_first = t_first or now
                            t_last = now
                return n, t_first, t_last

            one(prompts["agent"][0][:32])   # warm-up
            for name, ps in prompts.items():
                before = _vllm_spec_counts(c)
                rates = []
                for p in ps[:single]:
                    c.post("/reset_prefix_cache")
                    n, a, b = one(p)
                    if n > 1 and b and a and b > a:
                        rates.append((n - 1) / (b - a))
                after = _vllm_spec_counts(c)
                acc = None
                if after and before and after[1] > before[1]:
                    acc = 1 + (after[0] - before[0]) / (after[1] - before[1])
                import concurrent.futures as cf

                c.post("/reset_prefix_cache")
                t0 = time.perf_counter()
                with cf.ThreadPoolExecutor(len(ps)) as ex:
                    ns = [r[0] for r in ex.map(one, ps)]
                wall = time.perf_counter() - t0
                results[name] = {"decode_tok_s": statistics.mean(rates) if rates else None,
                                 "acceptance_length": None, "accept_per_drafted_step": acc,
                                 "total_tok_s_c4": sum(ns) / wall}
    except Exception as e:  # noqa: BLE001 - reported in the table
        results["error"] = f"{type(e).__name__}: {e}"
    return results


def _vllm_spec_counts(c) -> tuple[float, float] | None:
    text = c.get("/metrics").text
    acc = re.findall(r"^vllm:spec_decode_num_accepted_tokens_total\{[^}]*\} ([0-9.e+]+)", text, re.M)
    drafts = re.findall(r"^vllm:spec_decode_num_drafts_total\{[^}]*\} ([0-9.e+]+)", text, re.M)
    if not acc or not drafts:
        return None
    return float(acc[0]), float(drafts[0])


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--max-tokens", type=int, default=112)
    ap.add_argument("--prompts", type=int, default=4, help="prompts per workload (= the concurrency level)")
    ap.add_argument("--single", type=int, default=3, help="of which run single-stream")
    ap.add_argument("--base-drafter", default=str(ROOT / "drafters" / "smollm2-135m-dflash-base"))
    ap.add_argument("--drafter", default=str(ROOT / "drafters" / "smollm2-135m-dflash"))
    ap.add_argument("--rounds", type=int, default=2, help="interleaved rounds over all configurations")
    ap.add_argument("--c4-reps", type=int, default=3, help="concurrent batches per configuration and round")
    ap.add_argument("--workloads", default="agent,prose", help="comma-separated subset of agent,prose")
    ap.add_argument("--num-speculative-tokens", type=int, default=None, help="k for every method (default: engine's)")
    ap.add_argument("--quantization", default="auto", help="tokenmill weights: auto (the GGUF's Q4_1) or none (fp32)")
    ap.add_argument("--no-vllm", action="store_true")
    ap.add_argument("--configs", default=None, help="comma-separated subset of none,ngram,suffix,dflash-base,dflash-ft")
    ap.add_argument("--spec-gate", choices=("on", "off", "both"), default="on",
                    help="the draft gate for ngram/suffix (engine default: on); off: the match-length rule "
                         "before it (speculative_gate=False); both: each ngram/suffix config also as "
                         "'<method>-nogate', side by side in the same run")
    ap.add_argument("--json", default=None, help="write the results here")
    args = ap.parse_args()
    import torch

    from tokenmill.loader import load_model

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "2")))
    print(f"load average at start: {open('/proc/loadavg').read().strip()}")
    loaded = load_model("smollm2-135m-instruct", quantization=args.quantization)
    print(f"tokenmill weights: {args.quantization}, {torch.get_num_threads()} thread(s)")
    prompts = {w: ps for w, ps in workloads(args.prompts, loaded.tokenizer).items()
               if w in args.workloads.split(",")}
    configs = {"none": {}, "none-single": {"num_continuous_decode_steps": 1}, "ngram": {"speculative_method": "ngram"},
               "ngram-single": {"speculative_method": "ngram", "num_continuous_decode_steps": 1},
               "suffix": {"speculative_method": "suffix"}}
    for label, path in (("dflash-base", args.base_drafter), ("dflash-ft", args.drafter)):
        if Path(path, "config.json").is_file():
            configs[label] = {"speculative_method": "dflash", "speculative_model": path}
    if args.num_speculative_tokens:
        for spec in configs.values():
            if spec:
                spec["num_speculative_tokens"] = args.num_speculative_tokens
    if args.configs:
        keep = set(args.configs.split(",")) | {"none"}
        configs = {k: v for k, v in configs.items() if k in keep}
    for label in [k for k in configs if k in ("ngram", "suffix")]:
        if args.spec_gate == "off":
            configs[label] = {**configs[label], "speculative_gate": False}
        elif args.spec_gate == "both":
            configs[f"{label}-nogate"] = {**configs[label], "speculative_gate": False}
    results: dict[str, dict] = {label: {} for label in configs}
    for wname, ps in prompts.items():
        per = run_tokenmill(loaded, configs, ps, args.max_tokens, args.single, args.rounds, args.c4_reps)
        for label, r in per.items():
            results[label][wname] = r
            print(f"{label:14s} {wname:6s} decode {r['decode_tok_s']:6.1f} tok/s  acceptance "
                  f"{r['acceptance_length'] or 1:5.2f}  c4 total {r['total_tok_s_c4']:6.1f} tok/s", flush=True)
        print(f"load average after {wname}: {open('/proc/loadavg').read().strip()}", flush=True)
    ref = {w: results["none"][w]["outputs"] for w in prompts}
    for label in results:
        same = all(results[label][w]["outputs"] == ref[w] for w in prompts)
        print(f"{label}: outputs identical to no speculation: {same}")
    if not args.no_vllm:
        print(f"load average before vLLM: {open('/proc/loadavg').read().strip()}", flush=True)
        spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 5, "prompt_lookup_min": 2}
        v = run_vllm(prompts, args.max_tokens, spec, args.single)
        if "error" in v and len(v) == 1:
            print(f"vLLM CPU refused n-gram speculation:\n{v['error']}\n-- comparing with vLLM plain")
            results["vllm-plain"] = run_vllm(prompts, args.max_tokens, None, args.single)
        else:
            results["vllm-ngram"] = v
    print(f"\nload average at end: {open('/proc/loadavg').read().strip()}")
    print("\naccept len: output tokens per decode step (all steps); per drafted: tokens per step that "
          "verified drafts (vLLM's spec_decode metrics; the only one it reports); paired: median over the "
          "runs of the ratio to the run without speculation on the same prompt and round (single stream) "
          "or to the adjacent batch without it (c4)")
    print(f"\n{'config':14s} {'workload':8s} {'decode tok/s':>12s} {'x none':>7s} {'paired':>7s} {'accept len':>10s} "
          f"{'per drafted':>11s} {'c' + str(args.prompts) + ' tok/s':>9s} {'x none':>7s} {'paired':>7s}")
    for label, per in results.items():
        for w in prompts:
            r = per.get(w)
            if not r:
                print(f"{label:14s} {w:8s} {per.get('error', 'no result')[:80]}")
                continue
            base = results["none"][w]
            d, c4 = r.get("decode_tok_s"), r.get("total_tok_s_c4")
            al, pd = r.get("acceptance_length"), r.get("accept_per_drafted_step")
            al_s = f"{al:10.2f}" if al else f"{'-':>10s}"
            pd_s = f"{pd:11.2f}" if pd else f"{'-':>11s}"
            paired, paired1 = r.get("c4_paired"), r.get("single_paired")
            paired_s = f"{paired:7.2f}" if paired else f"{'-':>7s}"
            paired1_s = f"{paired1:7.2f}" if paired1 else f"{'-':>7s}"
            print(f"{label:14s} {w:8s} {d or 0:12.1f} {(d or 0) / base['decode_tok_s']:7.2f} {paired1_s} "
                  f"{al_s} {pd_s} {c4 or 0:9.1f} {(c4 or 0) / base['total_tok_s_c4']:7.2f} {paired_s}")
    if args.json:
        for per in results.values():
            for r in per.values():
                if isinstance(r, dict):
                    r.pop("outputs", None)
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
