"""What bf16 products in prefill attention would cost in accuracy: a simulation, not a kernel.

The torch reference attention backend runs with ``scaled_dot_product_attention`` replaced by an
explicit softmax attention whose QK^T inputs (q, k) and/or PV inputs (probabilities, v) are
rounded to bf16 first. A product of two bf16 values is exact in float32 and the sums stay
float32, as ``vdpbf16ps`` (AVX-512 BF16: two products per lane per instruction, twice the fp32
FMA rate) computes them. The default Q4_1 model teacher-forces ``--tokens`` held-out tokens (the
stdlib ``difflib`` source) in chunks of 250 after their cached context on an fp16 KV pool, with
fp32 activations, and each variant is compared with plain float32 attention: top-1 agreement and
KL(fp32 || variant).

    .venv/bin/python benchmarks/attention_bf16_accuracy.py [--tokens 2000] [--threads 2]
"""
from __future__ import annotations

import argparse
import difflib
import inspect
import sys

import torch


def _attention(mode: dict[str, bool]):
    def rnd(x: torch.Tensor) -> torch.Tensor:
        return x.bfloat16().float()

    def sdpa(q, k, v, attn_mask=None, is_causal=False, scale=None, enable_gqa=False):
        hq, hk = q.shape[-3], k.shape[-3]
        if hq != hk:
            k, v = k.repeat_interleave(hq // hk, dim=-3), v.repeat_interleave(hq // hk, dim=-3)
        qq, kk = (rnd(q), rnd(k)) if mode["qk"] else (q, k)
        s = (qq @ kk.transpose(-1, -2)) * (scale if scale is not None else q.shape[-1] ** -0.5)
        if is_causal:
            n, m = s.shape[-2:]
            s = s.masked_fill(~torch.ones(n, m, dtype=torch.bool).tril(m - n), float("-inf"))
        elif attn_mask is not None:
            s = s.masked_fill(~attn_mask, float("-inf")) if attn_mask.dtype == torch.bool else s + attn_mask
        p = (s - s.amax(-1, keepdim=True)).exp()
        l = p.sum(-1, keepdim=True)
        pp, vv = (rnd(p), rnd(v)) if mode["pv"] else (p, v)
        return (pp @ vv) / l
    return sdpa


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=2000)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    from tokenmill.contracts.batch import ForwardBatch
    from tokenmill.layers.attention import ForwardContext, select_attention_backend, torch_ref
    from tokenmill.layers.quant.packed import fp32_activations
    from tokenmill.loader import load_model

    mode = {"qk": False, "pv": False}
    torch_ref.F = type("F", (), {"scaled_dot_product_attention": staticmethod(_attention(mode))})
    loaded = load_model("smollm2-135m-instruct")
    model = loaded.model
    ids = loaded.tokenizer(inspect.getsource(difflib)).input_ids[: args.tokens]

    def chunk(attn, kv, part: list[int], start: int) -> torch.Tensor:
        end = start + len(part)
        pos = torch.arange(start, end)
        batch = ForwardBatch(
            input_ids=torch.tensor(part), positions=pos, slot_mapping=pos.clone(),
            query_start_loc=torch.tensor([0, len(part)]), seq_lens=torch.tensor([end]),
            block_tables=torch.arange((end + 15) // 16).unsqueeze(0), logits_indices=torch.arange(len(part)),
            page_size=16, max_seq_len=end)
        return model(ForwardContext.prepare(attn, batch, kv))

    def forced() -> torch.Tensor:
        attn = select_attention_backend(model.kv_cache_spec().with_dtype("float16"), "cpu", model.dtype, "torch")
        kv = attn.allocate(len(ids) // 16 + 2, 16)
        return torch.cat([chunk(attn, kv, ids[s:s + 250], s) for s in range(0, len(ids), 250)])

    with torch.no_grad(), fp32_activations():
        ref = forced()
        lp_ref = torch.log_softmax(ref.double(), -1)
        for qk, pv in ((False, True), (True, False), (True, True)):
            mode.update(qk=qk, pv=pv)
            got = forced()
            kl = (lp_ref.exp() * (lp_ref - torch.log_softmax(got.double(), -1))).sum(-1)
            agree = float((got.argmax(-1) == ref.argmax(-1)).double().mean())
            print(f"QK inputs bf16: {qk!s:5}  PV inputs bf16: {pv!s:5}  top-1 agreement {agree:.4f}, "
                  f"KL mean {float(kl.mean()):.2e} max {float(kl.max()):.2e} nats", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
