"""How long `tokenmill serve` takes to come up, and what the GGUF parser changed in it.

Two measurements in one run:

1. Opening the default model's GGUF file, in this process, alternating the loader's own parser
   (``tokenmill.loader.gguf_file.GGUFFile``, vocabulary arrays skipped) and the ``gguf``
   package's ``GGUFReader`` (what the loader used before), ``--rounds`` times each; prints the
   medians and their ratio.
2. `tokenmill serve` from process start to a 200 on ``/health``, ``--runs`` times, the cases
   interleaved: the default model (Q4_1 GGUF) as shipped, with transformers' config class
   (``TOKENMILL_CONFIG_CLASSES=1``) and with that and ``GGUFReader`` (``TOKENMILL_GGUF_READER=gguf``:
   the loader before both changes); a tiny random Llama directory (what most server tests start)
   with and without the config class. Prints each run, the medians and the differences.

    .venv/bin/python benchmarks/startup.py [--rounds 3] [--runs 3] [--threads 1]
"""
from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path


def time_open(path: Path, rounds: int) -> tuple[list[float], list[float]]:
    import gguf

    from tokenmill.loader.gguf import _SKIPPED_ARRAYS
    from tokenmill.loader.gguf_file import GGUFFile

    ours, ref = [], []
    for _ in range(rounds):
        t0 = time.perf_counter()
        GGUFFile(path, skip=_SKIPPED_ARRAYS)
        t1 = time.perf_counter()
        gguf.GGUFReader(str(path))
        t2 = time.perf_counter()
        ours.append(t1 - t0)
        ref.append(t2 - t1)
    return ours, ref


def time_serve(model: str, log_dir: Path, env: dict[str, str] | None = None) -> float:
    from tokenmill.utils.proc import ServiceProcess

    t0 = time.monotonic()
    with ServiceProcess(["serve", "--model", model], log_path=log_dir / "serve.log", start_timeout=600, env=env):
        return time.monotonic() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS for the servers")
    args = ap.parse_args()
    os.environ["OMP_NUM_THREADS"] = str(args.threads)

    from tokenmill.loader.resolve import DEFAULT_MODEL, resolve_model_path
    from tokenmill.loader.tiny import build_tiny_checkpoint

    print(f"load average {os.getloadavg()[0]:.2f}")
    path = resolve_model_path(DEFAULT_MODEL)
    ours, ref = time_open(path, args.rounds)
    mo, mr = statistics.median(ours), statistics.median(ref)
    print(f"open {path.name}: GGUFFile {', '.join(f'{t * 1e3:.1f}' for t in ours)} ms (median {mo * 1e3:.1f}); "
          f"GGUFReader {', '.join(f'{t:.2f}' for t in ref)} s (median {mr:.2f}); GGUFReader / GGUFFile {mr / mo:.0f}x")
    with tempfile.TemporaryDirectory() as tmp:
        tiny = str(build_tiny_checkpoint(Path(tmp) / "tiny", arch="LlamaForCausalLM", seed=0))
        old = {"TOKENMILL_CONFIG_CLASSES": "1"}
        cases = {f"{DEFAULT_MODEL} (GGUFFile, light config)": (DEFAULT_MODEL, None),
                 f"{DEFAULT_MODEL} (GGUFFile, config class)": (DEFAULT_MODEL, old),
                 f"{DEFAULT_MODEL} (GGUFReader, config class)": (DEFAULT_MODEL, {**old, "TOKENMILL_GGUF_READER": "gguf"}),
                 "tiny random Llama (light config)": (tiny, None),
                 "tiny random Llama (config class)": (tiny, old)}
        times: dict[str, list[float]] = {name: [] for name in cases}
        for _ in range(args.runs):
            for name, (model, env) in cases.items():
                times[name].append(time_serve(model, Path(tmp), env))
        for name, ts in times.items():
            print(f"tokenmill serve --model {name}: healthy after {', '.join(f'{t:.2f}' for t in ts)} s "
                  f"(median {statistics.median(ts):.2f} s)")
        med = {name: statistics.median(ts) for name, ts in times.items()}
        names = list(cases)
        for before, after in ((names[2], names[1]), (names[1], names[0]), (names[2], names[0]), (names[4], names[3])):
            print(f"{before} -> {after}: {med[before] - med[after]:.2f} s less ({med[before] / med[after]:.2f}x)")
    print(f"load average at the end {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
