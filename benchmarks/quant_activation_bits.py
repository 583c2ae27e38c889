"""Accuracy of quantized activations on the default model: would int8 activations do?

Feeds ``--tokens`` (2,000) tokens of held-out text (the stdlib ``difflib`` source) teacher-forced
through the default model's Q4_1 weights, in chunks of 250, with the activations of every packed
matmul (a) in fp32, (b) quantized to int16 in blocks of 32 (the served decode kernels, through
the kernels themselves) and (c) simulated variants: int8 in blocks of 32 (llama.cpp's Q8_0
rule), 16 and 8 (scale absmax/127), and int12 in blocks of 32 (absmax/2047), each rounding half
to even. A simulated variant quantizes and dequantizes x before the fp32-activation path, which
is exactly what an integer kernel with those activations computes, up to float summation order. Prints top-1
agreement with (a) and mean / max KL(fp32 || variant) per variant. The aim of the issue for int8
activations: >= 99% agreement over 2,000 tokens.

    .venv/bin/python benchmarks/quant_activation_bits.py [--tokens 2000] [--threads 1]
"""
from __future__ import annotations

import argparse
import contextlib
import difflib
import inspect
from typing import Any, Iterator

import torch


def fake_quant(x: torch.Tensor, block: int, qmax: int) -> torch.Tensor:
    m, k = x.shape
    kp = (k + block - 1) // block * block
    b = torch.nn.functional.pad(x.float(), (0, kp - k)).view(m, -1, block)
    d = b.abs().amax(-1, keepdim=True) / qmax
    q = torch.round(b * torch.where(d > 0, 1 / d, torch.zeros_like(d)))
    return (q * d).view(m, kp)[:, :k].to(x.dtype)


@contextlib.contextmanager
def simulated(block: int, qmax: int) -> Iterator[None]:
    from tokenmill.layers.quant.packed import _Packed, fp32_activations

    orig = _Packed.forward

    def forward(self: Any, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        lead = x.shape[:-1]
        xq = fake_quant(x.reshape(-1, self.in_features), block, qmax).reshape(*lead, self.in_features)
        return orig(self, xq, bias)

    _Packed.forward = forward  # type: ignore[method-assign]
    try:
        with fp32_activations():
            yield
    finally:
        _Packed.forward = orig  # type: ignore[method-assign]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=2000)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)

    from tokenmill.contracts.batch import ForwardBatch
    from tokenmill.layers.attention import ForwardContext, select_attention_backend
    from tokenmill.layers.quant.packed import fp32_activations, int16_activations
    from tokenmill.loader import load_model

    torch.set_num_threads(args.threads)
    lm = load_model("smollm2-135m-instruct")
    model = lm.model
    ids = lm.tokenizer(inspect.getsource(difflib)).input_ids[:args.tokens]
    n = len(ids)
    variants = {"fp32": fp32_activations, "int16, blocks of 32 (served)": int16_activations,
                "int8, blocks of 32": lambda: simulated(32, 127), "int8, blocks of 16": lambda: simulated(16, 127),
                "int8, blocks of 8": lambda: simulated(8, 127), "int12, blocks of 32": lambda: simulated(32, 2047)}
    spec = model.kv_cache_spec()
    pools = {}
    for name in variants:
        attn = select_attention_backend(spec, "cpu", model.dtype, "auto")
        pools[name] = (attn, attn.allocate(n // 16 + 2, 16))

    def forward_all(attn: Any, kv: Any, chunk: list[int], start: int) -> torch.Tensor:
        m = len(chunk)
        pos = torch.arange(start, start + m, dtype=torch.long)
        table = torch.arange(n // 16 + 2, dtype=torch.long).unsqueeze(0)
        batch = ForwardBatch(input_ids=torch.tensor(chunk, dtype=torch.long), positions=pos, slot_mapping=pos.clone(),
                             query_start_loc=torch.tensor([0, m], dtype=torch.long),
                             seq_lens=torch.tensor([start + m], dtype=torch.long), block_tables=table,
                             logits_indices=torch.arange(m, dtype=torch.long), page_size=16, max_seq_len=start + m,
                             state_slots=None)
        with torch.no_grad():
            return model(ForwardContext.prepare(attn, batch, kv)).float()

    stats = {name: [0, 0.0, 0.0] for name in variants if name != "fp32"}
    for s in range(0, n, 250):
        chunk = ids[s:s + 250]
        out = {}
        for name, ctx in variants.items():
            with ctx():
                out[name] = forward_all(*pools[name], chunk, s)
        lp_ref = torch.log_softmax(out["fp32"].double(), -1)
        for name in stats:
            lp = torch.log_softmax(out[name].double(), -1)
            kl = (lp_ref.exp() * (lp_ref - lp)).sum(-1)
            st = stats[name]
            st[0] += int((out[name].argmax(-1) == out["fp32"].argmax(-1)).sum())
            st[1] += float(kl.sum())
            st[2] = max(st[2], float(kl.max()))
    print(f"teacher-forced {n} tokens of difflib's source, Q4_1 weights; against fp32 activations:")
    print("| activations | top-1 agreement | mean KL (nats) | max KL |\n|---|---|---|---|")
    for name, (agree, kl_sum, kl_max) in stats.items():
        print(f"| {name} | {agree / n:.2%} ({n - agree} of {n} differ) | {kl_sum / n:.2e} | {kl_max:.2e} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
