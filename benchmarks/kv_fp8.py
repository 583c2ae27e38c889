"""FP8 KV cache: accuracy against an fp32 pool, scale granularity, and capacity at equal memory.

1. Accuracy: the default model (SmolLM2-135M, README text) and a tiny random DeepSeek-V3 run the
   same ``--tokens`` tokens over an fp32 pool, a bf16 pool and fp8 pools with both scale schemes
   (``static``: per layer and head, calibrated by the model runner's built-in start-up prefill;
   ``token``: per token and head), fed as chunks after a first token, so every logit reads K/V
   back from the pool; max / mean |logit difference| and the share of positions whose argmax
   agrees (teacher-forced greedy agreement).
2. Scale granularity: the K/V vectors the fp32 run stored are quantized to e4m3 with one scale
   per token and head, one per page and head (amax over the page's tokens), the calibrated
   static scales, and no scale; relative RMS error of each, and the scale bytes per token.
3. Capacity at ``--memory-gib``: tokens an fp32, bf16 and fp8 pool hold (KVCacheSpec.capacity_tokens,
   the engine's and the planner's formula).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/kv_fp8.py [--tokens 512] [--memory-gib 1]
"""
from __future__ import annotations

import argparse
import random
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch

from tokenmill.contracts.batch import ForwardBatch
from tokenmill.engine.kv_calibration import calibration_tokens
from tokenmill.engine.model_runner import ModelRunner
from tokenmill.layers.attention import ForwardContext
from tokenmill.layers.attention.fp8 import FP8, FP8_MAX, static_scale_tensors
from tokenmill.loader import load_model
from tokenmill.loader.tiny import build_tiny_checkpoint

PAGE = 16


def run(loaded, tokens: list[int], kv_dtype: str, scales: str = "static", chunk: int = 73,
        after_step: Callable[[int, list], None] | None = None):
    """Logits of every position, and the pool, for ``tokens`` fed as 1 + chunks of ``chunk``;
    ``after_step(end, pool)`` runs after each step (``end``: tokens in the pool by then)."""
    model = loaded.model
    n = len(tokens)
    pages = n // PAGE + 2
    vocab = model.args.vocab_size
    runner = ModelRunner(model, pages, PAGE, vocab,
                         kv_spec=model.kv_cache_spec().with_dtype(kv_dtype).with_fp8_scales(scales),
                         calibration_tokens=calibration_tokens(loaded.tokenizer, vocab, 512))
    attn, kv = runner.attn, runner.kv_caches
    table = torch.arange(pages)
    out = []
    start = 0
    for end in [1, *range(1 + chunk, n, chunk), n]:
        if end <= start:
            continue
        pos = torch.arange(start, end)
        batch = ForwardBatch(input_ids=torch.tensor(tokens[start:end]), positions=pos, slot_mapping=pos,
                             query_start_loc=torch.tensor([0, end - start]), seq_lens=torch.tensor([end]),
                             block_tables=table[None, :], logits_indices=torch.arange(end - start), page_size=PAGE,
                             max_seq_len=end)
        with torch.inference_mode():
            out.append(model(ForwardContext.prepare(attn, batch, kv)))
            if after_step is not None:
                after_step(end, kv)
        start = end
    return torch.cat(out), kv


def quant_error(x: torch.Tensor, group: int) -> float:
    """Relative RMS error of e4m3 with one scale per ``group`` consecutive vectors (rows of x);
    ``group=0``: no scale at all (a static per-tensor scale of 1, values clipped at 448)."""
    if group == 0:
        q = x.clamp(-FP8_MAX, FP8_MAX).to(FP8).float()
        return ((q - x).pow(2).mean() / x.pow(2).mean()).sqrt().item()
    rows = x.shape[0] // group * group
    v = x[:rows].view(-1, group, x.shape[-1])
    scale = (v.abs().amax(dim=(1, 2), keepdim=True) / FP8_MAX).clamp_min(1e-12)
    q = (v / scale).to(FP8).float() * scale
    return ((q - v).pow(2).mean() / v.pow(2).mean()).sqrt().item()


def quant_error_static(x: torch.Tensor, scale: torch.Tensor) -> float:
    """Relative RMS error of e4m3 under a fixed scale (broadcast over the rows of x), saturating."""
    q = (x / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8).float() * scale
    return ((q - x).pow(2).mean() / x.pow(2).mean()).sqrt().item()


def static_scales(fp8_kv) -> list[torch.Tensor]:
    """The calibrated static scales in the order of :func:`vectors`' rows (per head or per latent)."""
    out = []
    for s in static_scale_tensors(fp8_kv):
        if s.shape[-1] == 1:   # dense: [1, 1, H, 1] per K or V
            out += [s.view(-1)[h] for h in range(s.numel())]
        else:                  # MLA: [1, 1, E], one value per feature
            out.append(s.view(-1))
    return out


def vectors(model, kv) -> torch.Tensor:
    """Every stored vector of every layer, [N, D] per head (dense) or per latent (MLA)."""
    rows = []
    for layer in kv:
        if layer.dim() == 5:  # [2, pages, page, heads, dim] -> per head, token-major within a page
            rows += [layer[kv_i, :, :, h].reshape(-1, layer.shape[-1]) for kv_i in range(2) for h in range(layer.shape[3])]
        else:
            rows.append(layer.reshape(-1, layer.shape[-1]))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--memory-gib", type=float, default=1.0)
    args = ap.parse_args()
    torch.set_num_threads(1)
    smol = load_model("smollm2-135m-instruct")
    text = (Path(__file__).parents[1] / "README.md").read_text()
    models = [("SmolLM2-135M (README text)", smol, smol.tokenizer(text).input_ids[: args.tokens])]
    with tempfile.TemporaryDirectory() as tmp:
        for init in (0.02, 0.2):
            path = build_tiny_checkpoint(Path(tmp) / f"dsv3-{init}", "DeepseekV3ForCausalLM", seed=2,
                                         initializer_range=init)
            rng = random.Random(0)
            models.append((f"tiny DeepSeek-V3, init {init} (random ids)", load_model(str(path)),
                           [rng.randrange(49152) for _ in range(args.tokens)]))
        print(f"1. fp8 (and bf16) pool vs fp32 pool, {args.tokens} tokens, teacher-forced")
        print(f"{'model':<40} {'pool':<11} {'max |d|':>8} {'mean |d|':>9} {'logit std':>9} {'argmax agree':>12}")
        stored = {}
        for name, loaded, toks in models:
            exact, kv = run(loaded, toks, "float32")
            for dt, scales, label in (("bfloat16", "static", "bf16"), ("float8_e4m3fn", "static", "fp8 static"),
                                      ("float8_e4m3fn", "token", "fp8 token")):
                got, pool = run(loaded, toks, dt, scales)
                if label == "fp8 static":
                    stored[name] = (loaded.model, kv, len(toks), static_scales(pool))
                d = (got - exact).abs()
                agree = (got.argmax(-1) == exact.argmax(-1)).float().mean().item()
                print(f"{name:<40} {label:<11} {d.max().item():>8.4f} {d.mean().item():>9.5f} "
                      f"{exact.std().item():>9.3f} {agree * 100:>11.1f}%")
        print("\n2. e4m3 relative RMS error of the stored K/V (latents), by scale granularity")
        print(f"{'model':<40} {'per token(+head)':>16} {'per page(+head)':>16} {'static calibr.':>14} "
              f"{'none (1.0)':>10} {'scale B/token, token vs page vs static':>40}")
        for name, (model, kv, n, cal) in stored.items():
            vs = [v[:n] for v in vectors(model, kv)]
            tok = sum(quant_error(v, 1) for v in vs) / len(vs)
            page = sum(quant_error(v, PAGE) for v in vs) / len(vs)
            static = sum(quant_error_static(v, s) for v, s in zip(vs, cal)) / len(vs)
            none = sum(quant_error(v, 0) for v in vs) / len(vs)
            spec = model.kv_cache_spec().with_dtype("float8_e4m3fn")
            per_tok = sum(layer.scales_per_token() for layer in spec.layers) * 4
            print(f"{name:<40} {tok:>16.4f} {page:>16.4f} {static:>14.4f} {none:>10.4f} "
                  f"{per_tok:>20} vs {per_tok / PAGE:>6.2f} vs 0")
        print(f"\n3. tokens in a {args.memory_gib:g} GiB pool (pages of {PAGE})")
        for name, model in (("SmolLM2-135M", smol.model), ("tiny DeepSeek-V3", models[1][1].model)):
            spec = model.kv_cache_spec()
            pools = {"fp32": spec.with_dtype("float32"), "bf16": spec.with_dtype("bfloat16"),
                     "fp8 static": spec.with_dtype("float8_e4m3fn"),
                     "fp8 token": spec.with_dtype("float8_e4m3fn").with_fp8_scales("token")}
            caps = {k: p.capacity_tokens(args.memory_gib * 2**30, PAGE) for k, p in pools.items()}
            print(f"{name:<20} " + ", ".join(f"{k} {c:,} ({pools[k].bytes_per_token()} B/token)"
                                              for k, c in caps.items()))
            for k in ("fp8 static", "fp8 token"):
                print(f"{'':<20} {k}: {caps[k] / caps['fp32']:.3f}x fp32, {caps[k] / caps['bf16']:.3f}x bf16")


if __name__ == "__main__":
    main()
