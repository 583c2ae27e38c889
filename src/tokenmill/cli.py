"""One entry point, ``tokenmill``, with one subcommand per part.

Each subcommand lives in its own package and exposes two functions:

    add_arguments(parser: argparse.ArgumentParser) -> None
    run(args: argparse.Namespace) -> int

They are imported lazily so that ``tokenmill plan`` does not pay for importing torch.
"""
from __future__ import annotations

import argparse
import importlib
import os
import sys

# Spin iterations of an idle OpenMP thread before it sleeps (libgomp's default is 300000, i.e.
# about a millisecond). Read once when torch loads libgomp, so it is set here, before the engine's
# subcommands import torch; GOMP_SPINCOUNT in the environment wins. With the default, a step whose
# second thread shares its core with another busy process took 3.4x as long (68.5 ms instead of
# 20.2 ms per decode step with a busy-loop process beside it); with this value 1.6x, and the step
# on idle cores is as fast (docs/results/engine.md, "The server's per-token overhead").
OMP_SPIN_COUNT = "1000"
ENGINE_COMMANDS = ("serve", "generate")

# subcommand -> (module, help)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "serve": ("tokenmill.server.cli", "run the OpenAI-compatible server on one model"),
    "generate": ("tokenmill.engine.cli", "generate a completion offline and print it"),
    "route": ("tokenmill.router.cli", "KV-aware router in front of many replicas"),
    "bench": ("tokenmill.bench.cli", "closed-loop agentic benchmark against an OpenAI-compatible server"),
    "sim": ("tokenmill.sim.cli", "discrete-event fleet simulator driven by the router's policies"),
    "train-drafter": ("tokenmill.train.drafter", "train a DFlash-style drafter for speculative decoding from token-id traces"),
    "plan": ("tokenmill.plan.cli", "capacity planner: memory, KV capacity and roofline bounds"),
}


def build_parser(argv: list[str]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tokenmill", description="LLM serving stack for coding agents")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    chosen = next((a for a in argv if not a.startswith("-")), None)
    for name, (module, help_text) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        if name == chosen:  # only import the module of the subcommand that runs
            importlib.import_module(module).add_arguments(p)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if next((a for a in argv if not a.startswith("-")), None) in ENGINE_COMMANDS and "torch" not in sys.modules:
        os.environ.setdefault("GOMP_SPINCOUNT", OMP_SPIN_COUNT)
    parser = build_parser(argv)
    args = parser.parse_args(argv)
    if not args.command:
        parser.print_help()
        return 2
    module = importlib.import_module(SUBCOMMANDS[args.command][0])
    try:
        return int(module.run(args) or 0)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
