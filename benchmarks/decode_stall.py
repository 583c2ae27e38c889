"""Do decodes stall behind prefill? The Mooncake trace at concurrency 4 with short outputs,
against tokenmill with the step-time prefill bound on (serve's default ``--decode-slowdown 1.75``,
or ``--slowdown``) and off (a step's prefill may fill ``--max-batch-tokens``, the behaviour
before the bound), in one run.

Every request streams a few tokens; its TPOT is the time between its streamed tokens, i.e. the
steps it decoded in, which at concurrency 4 mostly also carry other requests' prefill. TPOT
alone is measured first: single requests with cached prompts, nothing else running.

    .venv/bin/python benchmarks/decode_stall.py --num-requests 40

``--stagger-too N`` (repeatable) adds the bounded server with ``--prefill-stagger-tokens N``: one
streamed prompt completes per step without streamed decodes, the others N tokens later (serve's
default is 0: prompts that complete in the same step decode together).

``--lone-too X`` (repeatable) adds the bounded server with ``--decode-slowdown-lone X``: a step of
several streamed decodes also keeps within X times a lone decode step. ``--also 'ARGS'``
(repeatable) adds the bounded server with any extra serve arguments, e.g. both of the above.
On packed weights serve's defaults include the lone cap (2) and the prefill hold (16 tokens); the
plain bound of earlier landings is ``--also "--decode-slowdown-lone 0 --prefill-hold-below 0"``.

``--no-chain-too`` adds the bounded server without chained decode steps
(``--num-continuous-decode-steps 1``): what the chains do to TTFT (a request arriving during a
chain waits for its end) and to TPOT, alone and beside prefill.

``--quantization none`` serves fp32 weights, the precision the issue's aim was set on (the engine
had no packed weights then); the default is serve's, the GGUF's int4 blocks, on which a decode
step of 4 streams already takes about 2.2x one stream's (``benchmarks/decode_batch_rows.py``).

``--workload agentic`` runs the same comparison on ``tokenmill bench``'s agent sessions instead
(closed loop, ``--duration`` seconds per run): there the prefills are turns after a cache hit,
and the table's TTFT is the turns' time to first token beside other sessions' streams.

Prints TPOT p50/mean, TTFT p50 and total tok/s per setting, TPOT relative to alone, and the
engine's steps by kind (decode / mixed / prefill: count and mean wall time, from ``/metrics``).
Both servers run side by side (one idle while the other is measured); with ``--rounds N`` the
two settings take turns N times, each round from an empty prefix cache, and the table gives
medians, since on a shared machine one run's throughput moves by +-15% with the load.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import re
import statistics
import subprocess
import sys
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TRACE = ROOT.parent / "shared" / "data" / "mooncake" / "conversation_trace.jsonl"
sys.path.insert(0, str(ROOT / "src"))

from tokenmill.utils.proc import ServiceProcess  # noqa: E402


def bench(base_url: str, out: Path, args, *, concurrency: int, num_requests: int) -> dict:
    cmd = [sys.executable, "-m", "tokenmill.cli", "bench", "--base-url", base_url, "--concurrency", str(concurrency),
           "--no-progress", "--out", str(out)]
    if args.workload == "agentic":   # closed-loop sessions: --duration seconds, the first 5 not counted
        cmd += ["--workload", "agentic", "--sessions", str(2 * concurrency), "--turns", str(args.turns),
                "--duration", f"{args.duration if concurrency > 1 else args.duration / 2:g}", "--warmup", "5"]
    else:
        cmd += ["--workload", "trace", "--trace", str(args.trace), "--block-tokens", str(args.block_tokens),
                "--max-output-tokens", str(args.output_tokens), "--num-requests", str(num_requests),
                "--warmup", "0"]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return json.loads((out / "results.json").read_text())["runs"][0]


def step_seconds(base_url: str) -> dict[str, tuple[int, float]]:
    """The server's engine_step_seconds histogram: kind -> (steps, mean seconds)."""
    text = urllib.request.urlopen(base_url.rstrip("/") + "/metrics", timeout=30).read().decode()
    sums, counts = {}, {}
    for m in re.finditer(r'^tokenmill:engine_step_seconds_(sum|count)\{([^}]*)\} (\S+)$', text, re.M):
        kind = re.search(r'kind="([^"]+)"', m.group(2)).group(1)
        (sums if m.group(1) == "sum" else counts)[kind] = float(m.group(3))
    return {k: (int(counts[k]), sums[k] / counts[k]) for k in counts if counts[k]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--workload", choices=["trace", "agentic"], default="trace",
                    help="trace: the Mooncake replay (default); agentic: tokenmill bench's closed-loop agent "
                         "sessions (turns of 64 new tokens after a cache hit, 16 output tokens), for the time "
                         "to first token of turns beside streams")
    ap.add_argument("--duration", type=float, default=60.0, help="agentic: seconds per loaded run (alone: half)")
    ap.add_argument("--turns", type=int, default=6, help="agentic: turns per session")
    ap.add_argument("--trace", type=Path, default=TRACE)
    ap.add_argument("--block-tokens", type=int, default=16)
    ap.add_argument("--output-tokens", type=int, default=4)
    ap.add_argument("--num-requests", type=int, default=40)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--slowdown", type=float, default=1.75,
                    help="--decode-slowdown of the bounded server (serve's default)")
    ap.add_argument("--finish", type=float, default=None,
                    help="--prefill-finish-slowdown of the bounded server (default: serve's default)")
    ap.add_argument("--no-finish-too", action="store_true",
                    help="also run the bounded server with the finishing exception off "
                         "(--prefill-finish-slowdown 0), as a third setting")
    ap.add_argument("--stagger-too", type=int, action="append", default=[], metavar="N",
                    help="also run the bounded server with --prefill-stagger-tokens N (0: prompts that "
                         "complete in one step decode together), as another setting; may be repeated")
    ap.add_argument("--lone-too", type=float, action="append", default=[], metavar="X",
                    help="also run the bounded server with --decode-slowdown-lone X (a step of several decodes "
                         "keeps within X times a lone decode step), as another setting; may be repeated")
    ap.add_argument("--also", action="append", default=[], metavar="'SERVE ARGS'",
                    help="also run the bounded server with these extra serve arguments (one string, e.g. "
                         "'--decode-slowdown-lone 2 --prefill-stagger-tokens 32'), as another setting; may be repeated")
    ap.add_argument("--no-chain-too", action="store_true",
                    help="also run the bounded server without chained decode steps "
                         "(--num-continuous-decode-steps 1; chains are serve's default)")
    ap.add_argument("--quantization", default=None,
                    help="serve's --quantization for every server (default: serve's default, the "
                         "GGUF's packed int4 blocks; none = fp32 weights, the precision the issue was "
                         "written against)")
    ap.add_argument("--rounds", type=int, default=1,
                    help="repeat both settings, alternating which goes first (the load here drifts)")
    ap.add_argument("--out", type=Path, default=ROOT / "out" / "decode_stall")
    args = ap.parse_args()
    if args.rounds < 1:
        ap.error("--rounds must be >= 1")
    print(f"load average at start: {open('/proc/loadavg').read().split()[:3]}", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    finish = [] if args.finish is None else ["--prefill-finish-slowdown", f"{args.finish:g}"]
    settings = {f"bound on (--decode-slowdown {args.slowdown:g}{' ' + ' '.join(finish) if finish else ''})":
                ["--decode-slowdown", f"{args.slowdown:g}"] + finish}
    if args.no_finish_too:
        settings["bound on, no finishing (--prefill-finish-slowdown 0)"] = [
            "--decode-slowdown", f"{args.slowdown:g}", "--prefill-finish-slowdown", "0"]
    for n in args.stagger_too:
        settings[f"bound on, --prefill-stagger-tokens {n}"] = [
            "--decode-slowdown", f"{args.slowdown:g}", "--prefill-stagger-tokens", str(n)] + finish
    for x in args.lone_too:
        settings[f"bound on, --decode-slowdown-lone {x:g}"] = [
            "--decode-slowdown", f"{args.slowdown:g}", "--decode-slowdown-lone", f"{x:g}"] + finish
    for extra in args.also:
        settings[f"bound on, {extra}"] = ["--decode-slowdown", f"{args.slowdown:g}"] + extra.split() + finish
    if args.no_chain_too:
        settings["bound on, no chains (--num-continuous-decode-steps 1)"] = [
            "--decode-slowdown", f"{args.slowdown:g}", "--num-continuous-decode-steps", "1"] + finish
    settings["bound off"] = ["--decode-slowdown", "0"]
    rows: dict[str, list[tuple[dict, dict]]] = {label: [] for label in settings}
    with contextlib.ExitStack() as stack:
        servers = {}
        for i, (label, extra) in enumerate(settings.items()):
            argv = ["serve", "--model", args.model, "--served-model-name", "m", "--threads", str(args.threads),
                    "--kv-cache-tokens", "65536"] + extra
            if args.quantization:
                argv += ["--quantization", args.quantization]
            log = args.out.parent / f"decode_stall_server_{i}.log"
            servers[label] = stack.enter_context(ServiceProcess(argv, start_timeout=600, log_path=log))
        for r in range(args.rounds):
            # both servers are up (one idles while the other runs); rounds alternate which goes
            # first, so a change of load on the machine falls on both settings
            order = list(settings) if r % 2 == 0 else list(settings)[::-1]
            for label in order:
                srv = servers[label]
                if r:   # every round starts from an empty prefix cache, as the first does
                    urllib.request.urlopen(urllib.request.Request(srv.base_url + "/flush_cache", method="POST"),
                                           timeout=60).read()
                out = args.out / f"setting{list(settings).index(label)}" / f"round{r}"
                alone = bench(srv.base_url, out / "alone", args, concurrency=1, num_requests=8)
                before = step_seconds(srv.base_url)
                loaded = bench(srv.base_url, out / "c4", args, concurrency=args.concurrency,
                               num_requests=args.num_requests)
                after = step_seconds(srv.base_url)
                steps = []
                for kind, (n, mean) in after.items():   # the loaded run's steps only
                    n0, mean0 = before.get(kind, (0, 0.0))
                    if n > n0:
                        steps.append(f"{kind} {n - n0} x {(n * mean - n0 * mean0) / (n - n0) * 1000:.1f} ms")
                rows[label].append((alone, loaded))
                print(f"[round {r + 1}, {label}] alone TPOT p50 {alone['tpot_p50_s'] * 1000:.0f} ms; "
                      f"c={args.concurrency}: TPOT p50 {loaded['tpot_p50_s'] * 1000:.0f} ms, mean "
                      f"{loaded['tpot_mean_s'] * 1000:.0f} ms, TTFT p50 {loaded['ttft_p50_s']:.2f} s, total "
                      f"{loaded['total_tokens_per_s']:.0f} tok/s; engine steps (mean): "
                      f"{', '.join(steps) or 'not reported'}; load {open('/proc/loadavg').read().split()[0]}",
                      flush=True)
    print(f"load average at end: {open('/proc/loadavg').read().split()[:3]}")
    med = statistics.median
    print(f"\n| setting | TPOT alone p50 | TPOT c={args.concurrency} p50 | ratio to alone | TPOT mean | "
          f"TTFT p50 | total tok/s |" + ("  (medians over rounds)" if args.rounds > 1 else ""))
    print("|---|---|---|---|---|---|---|")
    for label, runs in rows.items():
        alone_s = med(a["tpot_p50_s"] for a, _ in runs)
        tpot = med(l["tpot_p50_s"] for _, l in runs)
        ratio = med(l["tpot_p50_s"] / a["tpot_p50_s"] for a, l in runs)
        print(f"| {label} | {alone_s * 1000:.0f} ms | {tpot * 1000:.0f} ms | {ratio:.2f}x | "
              f"{med(l['tpot_mean_s'] for _, l in runs) * 1000:.0f} ms | "
              f"{med(l['ttft_p50_s'] for _, l in runs):.2f} s | {med(l['total_tokens_per_s'] for _, l in runs):.0f} |")
    labels = list(rows)
    off = rows[labels[-1]]
    for label in labels[:-1]:
        on = rows[label]
        tp = [a[1]["total_tokens_per_s"] / b[1]["total_tokens_per_s"] for a, b in zip(on, off)]
        tpot = [a[1]["tpot_p50_s"] / b[1]["tpot_p50_s"] for a, b in zip(on, off)]
        print(f"\n{label} / bound off, per round: TPOT p50 {', '.join(f'{x:.2f}x' for x in tpot)}; total "
              f"throughput {', '.join(f'{x:.2f}x' for x in tp)}" + (f" (median {med(tp):.2f}x)" if args.rounds > 1 else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
