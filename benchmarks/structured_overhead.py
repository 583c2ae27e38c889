"""Cost of constrained decoding: the 50 prompts x 5 schemas of the structured-output test, run
through the offline engine once constrained (JSON schema) and once unconstrained with the same
output lengths (``ignore_eos``, ``max_tokens`` = the constrained output's length), side by side
in one process. Prints both times, the ratio, and the share of outputs that validate.

    .venv/bin/python benchmarks/structured_overhead.py [--model M] [--max-tokens 96]
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import jsonschema

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "server"))
from test_structured_real_model import SCHEMAS, _prompts  # noqa: E402

from tokenmill import LLM, SamplingParams  # noqa: E402
from tokenmill.contracts.sampling import StructuredOutputs  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--max-tokens", type=int, default=96)
    args = ap.parse_args()
    llm = LLM(model=args.model, kv_cache_tokens=16384, max_running_requests=64)
    names = [n for _ in _prompts() for n in SCHEMAS]
    convs = [[{"role": "user", "content": p}] for p in _prompts() for _ in SCHEMAS]
    spec = {n: StructuredOutputs.json(s) for n, s in SCHEMAS.items()}
    compiler = llm.engine.grammar_compiler
    t = time.perf_counter()
    for s in spec.values():
        compiler.compile_now(s)
    compile_s = time.perf_counter() - t
    constrained = [SamplingParams(max_tokens=args.max_tokens, temperature=0, structured=spec[n]) for n in names]
    t = time.perf_counter()
    outs = llm.chat(convs, constrained)
    t_con = time.perf_counter() - t
    ok = 0
    for n, o in zip(names, outs):
        try:
            jsonschema.validate(json.loads(o.text), SCHEMAS[n])
            ok += 1
        except (ValueError, jsonschema.ValidationError):
            pass
    plain = [SamplingParams(max_tokens=len(o.token_ids), temperature=0, ignore_eos=True) for o in outs]
    t = time.perf_counter()
    outs2 = llm.chat(convs, plain)
    t_plain = time.perf_counter() - t
    tokens = sum(len(o.token_ids) for o in outs)
    assert tokens == sum(len(o.token_ids) for o in outs2)
    print(f"compile 5 schemas: {compile_s * 1000:.1f} ms")
    print(f"{len(outs)} requests, {tokens} output tokens; valid under their schema: {ok}/{len(outs)}")
    print(f"constrained {t_con:.1f} s, unconstrained {t_plain:.1f} s, ratio {t_con / t_plain:.3f}")


if __name__ == "__main__":
    main()
