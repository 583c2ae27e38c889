"""Token-id traces for drafter training: reading them, and recording new ones.

A trace file is JSONL in the format the server writes with ``--log-token-ids`` (one record per
request: ``prompt_token_ids``, ``output_token_ids``, ``model``, ``sampling``; see
:mod:`tokenmill.server.token_log`). Training reads ids only, never text.

``python -m tokenmill.train.traces --set {general,agent,stdlib} --out FILE`` records traces from
the target itself (the offline engine, which is the server's engine) on prompts built here:

* ``general``: questions and writing tasks on everyday topics (a general mix);
* ``agent``: agent-style turns over functions taken from the Python standard library's own
  source (PSF licence, found on every machine with Python): repeat a function with a rename,
  add a docstring, return a JSON record with one field changed, explain a traceback that quotes
  the code. The answers repeat their context, as coding-agent output does;
* ``stdlib``: no generation: chunks of standard-library source as plain token sequences (all
  positions supervised), a cheap code component of the base mix.
"""
from __future__ import annotations

import argparse
import ast
import json
import random
import sys
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path


@dataclass
class Trace:
    prompt: list[int]
    output: list[int]

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output


def read_traces(paths: list[str | Path]) -> list[Trace]:
    """Traces from JSONL files or directories of them (``*.jsonl``)."""
    out: list[Trace] = []
    for p in paths:
        p = Path(p)
        files = sorted(p.glob("*.jsonl")) if p.is_dir() else [p]
        for f in files:
            for n, line in enumerate(f.read_text().splitlines(), 1):
                if not line.strip():
                    continue
                try:
                    rec = json.loads(line)
                    prompt = [int(t) for t in rec["prompt_token_ids"]]
                    output = [int(t) for t in rec["output_token_ids"]]
                except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
                    raise ValueError(f"{f}:{n}: not a token-id trace record: {e}") from None
                out.append(Trace(prompt, output))
    return out


# -- prompt sets -----------------------------------------------------------------------------------
TOPICS = ["the ocean", "bread baking", "the history of maps", "volcanoes", "learning a language",
          "city gardens", "bicycles", "the moon", "coffee", "rainforests", "chess", "libraries",
          "honeybees", "trains", "winter", "photography", "the printing press", "deserts",
          "music practice", "recycling", "bridges", "clouds", "museums", "friendship"]
GENERAL = ["Write a short paragraph about {t}.", "Explain {t} to a ten-year-old.",
           "Give three interesting facts about {t}.", "Write a four-line poem about {t}.",
           "What are the pros and cons of {t}?", "Describe a day spent thinking about {t}."]


def _stdlib_functions(rng: random.Random, limit: int) -> list[tuple[str, str]]:
    """(module, source) of small top-level functions from the standard library."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.glob("*.py") if not p.name.startswith("_"))
    rng.shuffle(files)
    found: list[tuple[str, str]] = []
    for f in files:
        try:
            text = f.read_text(encoding="utf-8")
            tree = ast.parse(text)
        except (SyntaxError, UnicodeDecodeError):
            continue
        for node in tree.body:
            if isinstance(node, ast.FunctionDef) and node.end_lineno is not None:
                n = node.end_lineno - node.lineno + 1
                if 4 <= n <= 18:
                    src = ast.get_source_segment(text, node)
                    if src:
                        found.append((f.stem, src))
                        break
        if len(found) >= limit:
            break
    return found


def agent_prompts(n: int, seed: int = 0) -> list[list[dict[str, str]]]:
    rng = random.Random(seed)
    funcs = _stdlib_functions(rng, n)
    convs = []
    for i, (module, src) in enumerate(funcs):
        name = src.split("(")[0].removeprefix("def ").strip()
        kind = i % 4
        if kind == 0:
            msg = f"Rename the function `{name}` to `{name}_v2` and show the whole function:\n\n```python\n{src}\n```"
        elif kind == 1:
            msg = f"Add a one-line docstring to this function and show the full code:\n\n```python\n{src}\n```"
        elif kind == 2:
            record = {"module": module, "function": name, "lines": src.count("\n") + 1, "status": "ok"}
            msg = (f"Return this JSON again with \"status\" changed to \"failed\":\n\n"
                   f"{json.dumps(record, indent=2)}")
        else:
            line = src.splitlines()[min(2, src.count(chr(10)))].strip()
            msg = (f"Explain this error and quote the failing line:\n\nTraceback (most recent call last):\n"
                   f"  File \"{module}.py\", line 3, in {name}\n    {line}\nTypeError: unsupported operand type(s)\n\n"
                   f"The code:\n```python\n{src}\n```")
        convs.append([{"role": "user", "content": msg}])
    return convs


def general_prompts(n: int, seed: int = 0) -> list[list[dict[str, str]]]:
    rng = random.Random(seed)
    pairs = [(g, t) for g in GENERAL for t in TOPICS]
    rng.shuffle(pairs)
    return [[{"role": "user", "content": g.format(t=t)}] for g, t in pairs[:n]]


def stdlib_chunks(tokenizer, n: int, length: int, seed: int = 0) -> Iterator[list[int]]:
    rng = random.Random(seed)
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.glob("*.py") if not p.name.startswith("_"))
    rng.shuffle(files)
    made = 0
    for f in files:
        try:
            ids = tokenizer(f.read_text(encoding="utf-8"), add_special_tokens=False)["input_ids"]
        except UnicodeDecodeError:
            continue
        for start in range(0, max(len(ids) - length, 1), length * 4):
            yield list(ids[start:start + length])
            made += 1
            if made >= n:
                return


def record(kind: str, out: Path, n: int, max_tokens: int, model: str, seed: int = 0) -> int:
    from tokenmill import LLM, SamplingParams

    llm = LLM(model, speculative_method="ngram", kv_cache_tokens=32768)
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out, "w") as f:
        if kind == "stdlib":
            for ids in stdlib_chunks(llm.tokenizer, n, max_tokens, seed):
                f.write(json.dumps({"model": model, "prompt_token_ids": ids[:1], "output_token_ids": ids[1:],
                                    "sampling": None, "source": "python-stdlib (PSF licence)"}) + "\n")
            return n
        convs = agent_prompts(n, seed) if kind == "agent" else general_prompts(n, seed)
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
        for start in range(0, len(convs), 16):
            batch = convs[start:start + 16]
            outs = llm.generate([llm.encode_chat(c) for c in batch], params)
            for o in outs:
                f.write(json.dumps({"model": model, "prompt_token_ids": list(o.prompt_token_ids),
                                    "output_token_ids": list(o.token_ids), "finish_reason": o.finish_reason,
                                    "sampling": {"temperature": 0.0, "max_tokens": max_tokens}}) + "\n")
            print(f"{kind}: {start + len(batch)}/{len(convs)}", file=sys.stderr)
    return len(convs)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--set", dest="kind", required=True, choices=("general", "agent", "stdlib"))
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("-n", type=int, default=64, help="number of traces")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    print(record(args.kind, args.out, args.n, args.max_tokens, args.model, args.seed), "traces written to", args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
