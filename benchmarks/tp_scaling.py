"""Tensor parallelism on this CPU: overhead of N ranks against one process, and what TP4 costs
in communication on the seed's hardware.

Configurations (same model, same prompts, one run each, side by side):

* ``tp1-1t``: one process, 1 intra-op thread;
* ``tp1-2t``: one process, 2 intra-op threads;
* ``tpN-pinned``: N worker ranks (gloo), 1 thread each, rank r pinned to core r mod cores.

The default model (SmolLM2-135M) has 9 query heads, so it splits over 3 ranks, not 2: on a 2-core
machine its 3 ranks share 2 cores. ``--shape-model`` adds a random-weight model of the same
sizes but 8 query / 2 KV heads, which does split over 2 ranks (one per core).

Per configuration: single-stream decode tok/s (one request, ``--decode-tokens`` steps), prefill
tok/s (one ``--prompt-tokens`` prompt in one step), and from the ranks' own counters the seconds
spent in collectives per step and the payload bytes one rank puts into collectives per token.

Then the planner's view of TP4 on the seed's hardware (B200, Kimi K2.6): per decode step of one
token, the all-reduce payload is ``(2 x layers + 1) x hidden x 2 B`` (bf16; the vocabulary-parallel
logits gather is counted apart), a ring all-reduce sends ``2 (N-1)/N`` of it per rank, and at the
B200's NVLink bandwidth that is the communication floor, set against ``tokenmill plan``'s decode
step bound (which has no communication term).

``--moe`` adds a random-weight DeepSeek-V3-shaped MoE model (MLA, 32 routed experts, top 4, one
shared expert) at N=1 and at N=2 with the experts split both ways: ``--moe-parallel tp`` (every
expert's intermediate split) and ``ep`` (expert parallelism, 16 whole experts per rank); it prints
each rank's expert weights too. ``--only-moe`` skips the dense runs.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/tp_scaling.py [--shape-model] [--moe] [--decode-tokens 48]
"""
from __future__ import annotations

import argparse
import os
import tempfile
import time

import torch

from tokenmill.contracts.sampling import SamplingParams
from tokenmill.engine.config import EngineConfig
from tokenmill.engine.engine import Engine
from tokenmill.loader import load_model


def measure(model: str, loaded, tp: int, threads: int, prompt_tokens: int, decode_tokens: int,
            moe_parallel: str = "tp") -> dict:
    cfg = EngineConfig(model=model, kv_cache_tokens=4096, max_batch_tokens=max(512, prompt_tokens),
                       num_threads=threads, tensor_parallel_size=tp, tp_pin_cores=tp > 1, decode_slowdown=None,
                       moe_parallel=moe_parallel)
    eng = Engine(cfg, loaded=loaded)
    try:
        vocab = eng.vocab_size
        runner = eng.runner
        res: dict = {"tp": tp, "threads": threads, "moe": moe_parallel if tp > 1 else ""}
        if tp > 1:
            res["expert_mib_per_rank"] = [i["expert_weight_bytes"] / 2**20 for i in runner.rank_info]

        def counters():
            return runner.stats() if tp > 1 else None

        # warm-up
        eng.add_request("w", [11, 12, 13, 14], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
        while eng.has_unfinished_requests():
            eng.step()
        # prefill: one prompt in one step (its first token sampled)
        prompt = [(i * 97 + 31) % (vocab - 100) + 50 for i in range(prompt_tokens)]
        c0 = counters()
        eng.add_request("p", prompt, SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))
        t0 = time.perf_counter()
        eng.step()
        res["prefill_tok_s"] = prompt_tokens / (time.perf_counter() - t0)
        c1 = counters()
        # decode: one stream
        eng.add_request("d", prompt[:16], SamplingParams(max_tokens=decode_tokens + 1, temperature=0,
                                                          ignore_eos=True))
        eng.step()  # its prefill
        c2 = counters()
        t0 = time.perf_counter()
        steps = 0
        while eng.has_unfinished_requests():
            eng.step()
            steps += 1
        res["decode_tok_s"] = steps / (time.perf_counter() - t0)
        c3 = counters()
        if tp > 1:
            assert c0 is not None and c1 is not None and c2 is not None and c3 is not None
            res["prefill_comm_s"] = max(b["allreduce_s"] - a["allreduce_s"] for a, b in zip(c0, c1))
            res["decode_comm_s_per_step"] = max(b["allreduce_s"] - a["allreduce_s"] for a, b in zip(c2, c3)) / steps
            res["decode_bytes_per_token_rank0"] = (c3[0]["comm_bytes"] - c2[0]["comm_bytes"]) / steps
            res["decode_bytes_per_token_rank1"] = (c3[1]["comm_bytes"] - c2[1]["comm_bytes"]) / steps
        return res
    finally:
        eng.close()


def plan_tp4() -> list[str]:
    from tokenmill.plan.capacity import Deployment
    from tokenmill.plan.hardware import get_hardware
    from tokenmill.plan.models import load_model as plan_model
    from tokenmill.plan.planner import make_plan

    hw = get_hardware("b200")
    spec = plan_model("kimi-k2.6")
    plan = make_plan(spec, hw, Deployment(tp=4, kv_dtype="bf16", context=8192, batch=1))
    hidden, layers = spec.hidden_size, len(spec.layer_attention)
    payload = (2 * layers + 1) * hidden * 2
    ring = payload * 2 * 3 / 4
    t_comm = ring / hw.interconnect_bw
    step = plan.decode.step_time_s
    return [
        f"seed hardware: {hw.description}, interconnect {hw.interconnect_bw / 1e9:.0f} GB/s per direction",
        f"Kimi K2.6 TP4 decode, 1 token/step: all-reduce payload {payload / 1e6:.3f} MB/token "
        f"({2 * layers + 1} all-reduces of {hidden} x bf16), ring traffic per rank {ring / 1e6:.3f} MB",
        f"  bandwidth floor {t_comm * 1e6:.1f} us/token vs plan decode step bound {step * 1e3:.3f} ms "
        f"({t_comm / step:.1%} of the step; the fixed latency of {2 * layers + 1} all-reduce calls per step "
        f"is not in this floor and is what TP4 actually pays)",
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompt-tokens", type=int, default=256)
    ap.add_argument("--decode-tokens", type=int, default=48)
    ap.add_argument("--shape-model", action="store_true",
                    help="also run a random SmolLM2-sized model with 8/2 heads at N=2")
    ap.add_argument("--moe", action="store_true",
                    help="also run a random DeepSeek-V3-shaped MoE model at N=2 with --moe-parallel tp and ep")
    ap.add_argument("--only-moe", action="store_true", help="run the MoE model only")
    args = ap.parse_args()
    print(f"load average before: {open('/proc/loadavg').read().strip()}  cores: {os.cpu_count()}")
    runs = []
    if not args.only_moe:
        default = load_model("smollm2-135m-instruct")
        for tp, threads in ((1, 1), (1, 2), (3, 1)):
            runs.append(("smollm2-135m", measure("smollm2-135m-instruct", default, tp, threads,
                                                 args.prompt_tokens, args.decode_tokens)))
            print(runs[-1], flush=True)
        del default
    if args.moe or args.only_moe:
        from tokenmill.loader.tiny import build_tiny_checkpoint

        with tempfile.TemporaryDirectory() as d:
            path = build_tiny_checkpoint(d, arch="DeepseekV3ForCausalLM", seed=0, hidden_size=512,
                                         intermediate_size=1024, moe_intermediate_size=256, num_hidden_layers=6,
                                         num_attention_heads=8, num_key_value_heads=8, n_routed_experts=32,
                                         num_experts_per_tok=4, n_group=4, topk_group=2, n_shared_experts=1,
                                         first_k_dense_replace=1)
            moe = load_model(str(path))
            for tp, threads, mode in ((1, 1, "tp"), (2, 1, "tp"), (2, 1, "ep")):
                runs.append(("dsv3-shape-32e", measure(str(path), moe, tp, threads, args.prompt_tokens,
                                                       args.decode_tokens, mode)))
                print(runs[-1], flush=True)
    if args.shape_model:
        from tokenmill.loader.tiny import build_tiny_checkpoint

        with tempfile.TemporaryDirectory() as d:
            path = build_tiny_checkpoint(d, seed=0, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                                         num_attention_heads=8, num_key_value_heads=2)
            shaped = load_model(str(path))
            for tp, threads in ((1, 1), (1, 2), (2, 1)):
                runs.append(("smollm2-shape-8h", measure(str(path), shaped, tp, threads,
                                                         args.prompt_tokens, args.decode_tokens)))
                print(runs[-1], flush=True)
    print(f"load average after: {open('/proc/loadavg').read().strip()}")
    def label(r: dict) -> str:
        return f"tp{r['tp']}-" + (("pinned" + (f"-{r['moe']}" if r["moe"] else "")) if r["tp"] > 1
                                  else f"{r['threads']}t")

    print(f"\n{'model':18} {'config':15} {'decode tok/s':>12} {'prefill tok/s':>13} {'comm s/step':>11} "
          f"{'B/token r0':>10} {'B/token r1':>10}")
    base: dict[str, dict] = {}
    for name, r in runs:
        cfg = label(r)
        base.setdefault(name, r)
        print(f"{name:18} {cfg:15} {r['decode_tok_s']:12.1f} {r['prefill_tok_s']:13.1f} "
              f"{r.get('decode_comm_s_per_step', 0):11.5f} {r.get('decode_bytes_per_token_rank0', 0):10.0f} "
              f"{r.get('decode_bytes_per_token_rank1', 0):10.0f}")
    print("\nratios to tp1-1t of the same model (decode, prefill):")
    for name, r in runs:
        b = base[name]
        cfg = label(r)
        print(f"  {name:18} {cfg:15} {r['decode_tok_s'] / b['decode_tok_s']:.2f}x  "
              f"{r['prefill_tok_s'] / b['prefill_tok_s']:.2f}x"
              + (f"   expert weights per rank: {', '.join(f'{m:.1f}' for m in r['expert_mib_per_rank'])} MiB"
                 if r.get("expert_mib_per_rank") and any(r["expert_mib_per_rank"]) else ""))
    print("\nplanner, TP4 on the seed's hardware:")
    for line in plan_tp4():
        print("  " + line)


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
