"""FP8 KV accuracy: logits with an fp8 pool against the same model with an fp32 pool, 512 tokens.

The sequence is fed in chunks after a first token, so every logit (except the first) is
computed from keys and values read back from the pool; positions agree when both pools give
the same argmax (teacher forcing: greedy agreement without the drift of free generation).
Measured numbers (printed with ``-s``) are recorded in docs/benchmarks.md.
"""
from __future__ import annotations

import random
from pathlib import Path

import torch
from paged_driver import PagedDriver

from tokenmill.layers.attention import select_attention_backend
from tokenmill.loader import load_model
from tokenmill.loader.tiny import build_tiny_checkpoint

N = 512


def _run(model, tokens, kv_dtype: str) -> torch.Tensor:
    drv = PagedDriver(model, num_pages=N // 16 + 2, page_size=16)
    drv.attn = select_attention_backend(model.kv_cache_spec().with_dtype(kv_dtype), "cpu", model.dtype)
    drv.kv = drv.attn.allocate(N // 16 + 2, 16)
    out = [drv.step([("s", tokens[:1])], all_rows=True)]
    for i in range(1, len(tokens), 73):
        out.append(drv.step([("s", tokens[i:i + 73])], all_rows=True))
    return torch.cat(out)


def _compare(model, tokens) -> dict[str, float]:
    exact, fp8 = _run(model, tokens, "float32"), _run(model, tokens, "float8_e4m3fn")
    diff = (fp8 - exact).abs()
    stats = {"max_abs": diff.max().item(), "mean_abs": diff.mean().item(),
             "logit_std": exact.std().item(),
             "agreement": (fp8.argmax(-1) == exact.argmax(-1)).float().mean().item()}
    print(f"\n{type(model).__name__}: fp8 vs fp32 KV over {len(tokens)} tokens: {stats}")
    return stats


def test_default_model_fp8_kv_accuracy(smollm2):
    loaded, _ = smollm2
    text = (Path(__file__).parents[2] / "README.md").read_text()
    tokens = loaded.tokenizer(text).input_ids[:N]
    assert len(tokens) == N
    s = _compare(loaded.model, tokens)
    assert s["agreement"] >= 0.93 and s["mean_abs"] < 0.3 and s["max_abs"] < 4.0


def test_tiny_deepseek_v3_fp8_kv_accuracy(tmp_path):
    """HF's default init scale (0.02): the model-test checkpoints use 0.2, which makes a random
    MoE so chaotic that even a bf16 pool flips routing (max logit diff ~6, see docs/benchmarks.md)."""
    path = build_tiny_checkpoint(tmp_path / "dsv3", "DeepseekV3ForCausalLM", seed=2, initializer_range=0.02)
    model = load_model(str(path)).model
    rng = random.Random(0)
    s = _compare(model, [rng.randrange(49152) for _ in range(N)])
    assert s["agreement"] >= 0.95 and s["mean_abs"] < 0.02 * s["logit_std"] and s["max_abs"] < s["logit_std"]
