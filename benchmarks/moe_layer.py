"""One DeepSeek-V3 MoE layer: tokenmill's grouped experts vs HF transformers' layer, one run.

The layer (default: 64 routed experts, top-6, hidden 1024, expert width 512, one shared expert,
sigmoid router with one group, fp32) is built once by HF transformers (``DeepseekV3MoE``) and
tokenmill's :class:`~tokenmill.models.deepseek_v3.MoE` gets the same tensors. For each token
count the script times, best of ``--repeats``:

* ``tokenmill``: router + experts sorted by expert, one prepacked oneDNN matmul pair per expert
  with tokens, the shared expert through the same kernels (``tm-grouped``: the same layer with one
  ``grouped_mm`` pair for all experts instead, i.e. MKL on unpacked weights);
* ``hf-grouped``: HF's layer with ``grouped_mm`` experts (what ``from_pretrained`` picks here);
* ``hf-eager``: HF's layer with its reference loop (one-hot mask, ``torch.where`` per expert).

It checks that the outputs agree, and prints the planner's roofline bound for this machine
(``tokenmill plan --hardware cpu-local --moe-bounds``: FLOPs / measured matmul FLOP/s and expert
bytes / measured copy bandwidth, the larger one), with each time's ratio to it.

``--dtype bf16`` runs both layers with bf16 weights and activations (the serving dtype of the
real models; on a CPU with AVX512-BF16 the matmuls run several times faster than fp32), with the
roofline from the planner's bf16 figures.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/moe_layer.py [--threads 1] [--tokens 1,16,256,2048] [--dtype fp32]
"""
from __future__ import annotations

import argparse
import time

import torch


def build(experts: int, top_k: int, hidden: int, inter: int, shared: int, seed: int,
          dtype: torch.dtype = torch.float32):
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE

    from tokenmill.models.deepseek_v3 import MoE
    from tokenmill.models.registry import _deepseek_v3

    cfg = DeepseekV3Config(hidden_size=hidden, moe_intermediate_size=inter, n_routed_experts=experts,
                           num_experts_per_tok=top_k, n_group=1, topk_group=1, n_shared_experts=shared,
                           intermediate_size=4 * hidden, num_hidden_layers=1, first_k_dense_replace=0,
                           num_attention_heads=8, num_key_value_heads=8, vocab_size=1000,
                           architectures=["DeepseekV3ForCausalLM"])
    torch.manual_seed(seed)
    hf = DeepseekV3MoE(cfg).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0, 0.02)
        hf.gate.e_score_correction_bias.normal_(0, 0.01)
    if dtype != torch.float32:   # HF keeps the router's bias in fp32, as do we
        bias = hf.gate.e_score_correction_bias.data.clone()
        hf = hf.to(dtype)
        hf.gate.e_score_correction_bias.data = bias
    ours = MoE(_deepseek_v3(cfg), dtype)
    ours.gate.data = hf.gate.weight.data
    ours.e_score_correction_bias.copy_(hf.gate.e_score_correction_bias)
    ours.experts_gate_up.data = hf.experts.gate_up_proj.data
    ours.experts_down.data = hf.experts.down_proj.data
    if ours.shared is not None:
        s = hf.shared_experts
        ours.shared.gate_up_proj.data = torch.cat((s.gate_proj.weight, s.up_proj.weight)).detach()
        ours.shared.down_proj.data = s.down_proj.weight.detach()
    return cfg, hf, ours


def best_time(fn, repeats: int) -> float:
    fn()  # warm-up
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def roofline(cfg, tokens: int, dtype: str = "fp32") -> tuple[float, float, float]:
    """(bound s, compute s, weight-read s) from the planner's MoE cost model on cpu-local."""
    from tokenmill.plan.capacity import Deployment
    from tokenmill.plan.hardware import get_hardware
    from tokenmill.plan.models import parse_config
    from tokenmill.plan.moe import MoEBoundsInput, moe_bounds

    spec = parse_config(cfg.to_dict(), "moe-bench")
    bits = 32 if dtype == "fp32" else 16
    dep = Deployment(weight_bits={"experts": bits, "shared_experts": bits}, compute_dtype=dtype)
    hw = _HW.setdefault("cpu", get_hardware("cpu-local"))
    r = moe_bounds(spec, hw, dep, MoEBoundsInput(tokens=tokens, shared_rows=tokens))
    return max(r.compute_time_s, r.weight_read_s), r.compute_time_s, r.weight_read_s


_HW: dict = {}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--top-k", type=int, default=6)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--inter", type=int, default=512, help="expert (moe_intermediate) width")
    ap.add_argument("--shared", type=int, default=1)
    ap.add_argument("--tokens", default="1,16,256,2048")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    cfg, hf, ours = build(args.experts, args.top_k, args.hidden, args.inter, args.shared, seed=0, dtype=dtype)
    loop = ours.experts()
    from tokenmill.layers.moe import GroupedExperts

    ours_loop_experts = GroupedExperts(loop.gate_up, loop.down, mode="grouped")
    print(f"MoE layer: {args.experts} experts, top-{args.top_k}, hidden {args.hidden}, expert width {args.inter}, "
          f"{args.shared} shared; {args.dtype}; {args.threads} thread(s); tokenmill experts mode: {loop.mode}")
    hdr = f"{'tokens':>7} {'tokenmill':>10} {'tm-grouped':>10} {'hf-grouped':>10} {'hf-eager':>10} " \
          f"{'vs grouped':>10} {'vs eager':>9} {'roofline':>9} {'x bound':>8}"
    print(hdr)
    for n in [int(t) for t in args.tokens.split(",")]:
        x = torch.randn(n, args.hidden).to(dtype)
        with torch.inference_mode():
            want = hf(x.view(1, n, -1)).view(n, -1).float()
            got = ours(x).float()
            err = (got - want).abs().max().item()
            # bf16: the same routing and math, rounded at different points (~2^-8 relative per op)
            tol = 1e-4 if dtype == torch.float32 else 0.05
            assert err < tol * max(1.0, want.abs().max().item()), f"outputs differ by {err}"

            def ours_loop() -> None:
                w, ids = _route(ours, x)
                ours_loop_experts(x, w, ids, out=ours.shared(x))

            t_ours = best_time(lambda: ours(x), args.repeats)
            t_loop = best_time(ours_loop, args.repeats)
            hf.experts.config._experts_implementation = "grouped_mm"
            t_hfg = best_time(lambda: hf(x.view(1, n, -1)), args.repeats)
            hf.experts.config._experts_implementation = "eager"
            t_hfe = best_time(lambda: hf(x.view(1, n, -1)), max(1, args.repeats // 2))
        bound, comp, read = roofline(cfg, n, args.dtype)
        print(f"{n:>7} {t_ours * 1e3:>8.2f}ms {t_loop * 1e3:>8.2f}ms {t_hfg * 1e3:>8.2f}ms {t_hfe * 1e3:>8.2f}ms "
              f"{t_hfg / t_ours:>9.2f}x {t_hfe / t_ours:>8.2f}x {bound * 1e3:>7.2f}ms {t_ours / bound:>7.2f}x"
              f"   (compute {comp * 1e3:.2f} ms, weight read {read * 1e3:.2f} ms)")
    hw = _HW["cpu"]
    print(f"cpu-local measured: {args.dtype} {hw.peak_flops[args.dtype] / 1e9:.1f} GFLOP/s, "
          f"copy {hw.hbm_bw / 1e9:.1f} GB/s")


def _route(moe, x):
    from tokenmill.layers.moe import route_sigmoid_grouped

    a = moe.a
    return route_sigmoid_grouped(x, moe.gate, moe.e_score_correction_bias, top_k=a.num_experts_per_tok,
                                 n_group=a.n_group, topk_group=a.topk_group, norm_topk_prob=a.norm_topk_prob,
                                 routed_scaling_factor=a.routed_scaling_factor)


if __name__ == "__main__":
    main()
