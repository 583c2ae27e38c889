"""``tokenmill train-drafter``: train a DFlash-style drafter from token-id traces.

Pipeline:

1. **Teacher forcing.** Each trace (prompt + output ids, never re-tokenized text) goes through
   the target once, on tokenmill's own model code; the run keeps the hidden states after the
   drafter's ``target_layers`` (fp16) and the target's top-``K`` next-token distribution at every
   position. No text is generated.
2. **Training.** Each step picks a few traces, fuses their hidden states with the drafter's
   fusion layer, and samples anchors over the supervised tokens (the output; every token for
   traces with a one-token prompt). An anchor ``a`` is a block ``[token a, MASK x (B-1)]`` with
   the context of the ``W`` positions before it; block position ``j`` is trained towards the
   target's distribution of token ``a + j`` (cross-entropy against the target's top-``K``
   probabilities over the candidate set of the batch, a sampled softmax through the shared LM
   head), weighted by ``exp(-(j - 1) / gamma)`` so early positions, which decide most of the
   acceptance, count more.
3. **Evaluation.** The acceptance length on held-out traces: for sampled anchors, drafts are the
   drafter's full-vocabulary argmax, accepted while they equal the target's argmax (greedy
   verification); acceptance length = 1 + mean accepted drafts. Printed before and after.

``--init DIR`` starts from an earlier drafter (the fine-tune stage); ``--checkpoint-every N``
writes ``DIR/checkpoint/`` (weights, optimiser, step) and ``--resume`` continues from it. The
result, ``DIR/config.json`` + ``DIR/model.safetensors`` (fp16), is what ``--speculative-model``
loads.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

DEFAULT_TARGET_LAYERS = "3,16,29"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2-135m-instruct", help="the target model")
    p.add_argument("--traces", nargs="+", required=True, help="JSONL trace files or directories")
    p.add_argument("--heldout-fraction", type=float, default=0.15,
                   help="share of the traces kept out of training for the acceptance check")
    p.add_argument("--out", required=True, help="output directory (config.json + model.safetensors)")
    p.add_argument("--init", default=None, help="start from this drafter directory (fine-tuning)")
    p.add_argument("--resume", action="store_true", help="continue from OUT/checkpoint")
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seqs-per-step", type=int, default=4)
    p.add_argument("--anchors-per-seq", type=int, default=16)
    p.add_argument("--block-size", type=int, default=8)
    p.add_argument("--context-window", type=int, default=64)
    p.add_argument("--target-layers", default=DEFAULT_TARGET_LAYERS, help="comma-separated target layer indices")
    p.add_argument("--num-layers", type=int, default=1, help="drafter layers")
    p.add_argument("--gamma", type=float, default=4.0, help="position weight exp(-(j-1)/gamma)")
    p.add_argument("--top-k", type=int, default=32, help="target probabilities kept per position")
    p.add_argument("--max-len", type=int, default=640, help="longest trace used (tokens, truncated)")
    p.add_argument("--checkpoint-every", type=int, default=100)
    p.add_argument("--eval-anchors", type=int, default=400)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None, help="torch threads")


@dataclass
class SeqData:
    tokens: torch.Tensor      # [n] int64
    feats: torch.Tensor       # [n, L * hidden] fp16
    top_ids: torch.Tensor     # [n, K] int64
    top_p: torch.Tensor       # [n, K] fp32 (renormalised over the top K)
    sup_start: int            # first anchor position


def _heldout(i: int, seed: int, fraction: float) -> bool:
    h = hashlib.sha256(f"{seed}:{i}".encode()).digest()
    return int.from_bytes(h[:4], "little") / 2**32 < fraction


@torch.inference_mode()
def teacher_force(loaded, traces, layers: list[int], top_k: int, max_len: int, desc: str) -> list[SeqData]:
    """One target pass per trace: hidden states of ``layers`` and top-K next-token probabilities."""
    from tqdm import tqdm

    from tokenmill.contracts.batch import ForwardBatch
    from tokenmill.engine.model_runner import ModelRunner

    page = 16
    model = loaded.model
    runner = ModelRunner(model, -(-max_len // page) + 1, page, int(model.args.vocab_size),
                         attention_backend="torch")
    capture = frozenset(layers)
    out = []
    for tr in tqdm(traces, desc=desc, unit="trace", file=sys.stderr):
        ids = tr.tokens[:max_len]
        n = len(ids)
        if n < 3:
            continue
        pos = torch.arange(n)
        batch = ForwardBatch(
            input_ids=torch.tensor(ids), positions=pos, slot_mapping=pos,
            query_start_loc=torch.tensor([0, n]), seq_lens=torch.tensor([n]),
            block_tables=torch.arange(-(-n // page))[None], logits_indices=pos, page_size=page,
            max_seq_len=n)
        ctx = runner.forward(batch, capture)
        feats = torch.cat([ctx.captured[i] for i in sorted(layers)], dim=-1).to(torch.float16)
        lp = torch.log_softmax(ctx.logits.float(), dim=-1)
        top = lp.topk(top_k, dim=-1)
        p = top.values.exp()
        out.append(SeqData(torch.tensor(ids), feats, top.indices, p / p.sum(-1, keepdim=True),
                           max(1, min(len(tr.prompt), n - 2))))
    return out


def _windows(fused: torch.Tensor, anchors: list[int], w: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded context windows [A, W, H] of the positions before each anchor, and validity."""
    h = fused.shape[-1]
    ctx = fused.new_zeros(len(anchors), w, h)
    valid = torch.zeros(len(anchors), w, dtype=torch.bool)
    for i, a in enumerate(anchors):
        lo = max(0, a - w)
        ctx[i, w - (a - lo):] = fused[lo:a]
        valid[i, w - (a - lo):] = True
    return ctx, valid


def _block_inputs(drafter, embed, seqs: list[SeqData], picks: list[tuple[int, list[int]]], w: int):
    ctxs, valids, firsts, starts, meta = [], [], [], [], []
    for s, anchors in picks:
        sd = seqs[s]
        fused = drafter.fuse(sd.feats.float())
        c, v = _windows(fused, anchors, w)
        ctxs.append(c)
        valids.append(v)
        firsts.append(embed[sd.tokens[anchors]])
        starts.append(torch.tensor(anchors))
        meta.extend((s, a) for a in anchors)
    return torch.cat(ctxs), torch.cat(valids), torch.cat(firsts), torch.cat(starts), meta


@torch.no_grad()
def dense(weight: Any) -> torch.Tensor:
    """A weight as a plain fp32 tensor (a quantized linear method is dequantized once)."""
    if isinstance(weight, torch.Tensor):
        return weight.detach().float()
    return weight.dequantize().float()


def acceptance_length(drafter, embed, lm_head, seqs: list[SeqData], anchors: list[tuple[int, int]],
                      w: int, batch: int = 64) -> float:
    """1 + mean drafts accepted by greedy verification (full-vocabulary argmax drafts)."""
    if not anchors:
        return float("nan")
    b = drafter.config.block_size
    total = 0
    by_seq: dict[int, list[int]] = {}
    for s, a in anchors:
        by_seq.setdefault(s, []).append(a)
    for s, alist in by_seq.items():
        sd = seqs[s]
        n = sd.tokens.shape[0]
        for i in range(0, len(alist), batch):
            chunk = alist[i:i + batch]
            ctx, valid, first, start, _ = _block_inputs(drafter, embed, seqs, [(s, chunk)], w)
            h = drafter(ctx, valid, first, start)[:, 1:]
            drafts = (h @ lm_head.t()).argmax(-1)              # [A, B-1]
            for r, a in enumerate(chunk):
                acc = 0
                for j in range(1, b):
                    row = a + j - 1
                    if row >= n or int(drafts[r, j - 1]) != int(sd.top_ids[row, 0]):
                        break
                    acc += 1
                total += acc
    return 1.0 + total / len(anchors)


def _sample_eval_anchors(seqs: list[SeqData], n: int, seed: int) -> list[tuple[int, int]]:
    rng = random.Random(seed)
    pool = [(s, a) for s, sd in enumerate(seqs) for a in range(sd.sup_start, sd.tokens.shape[0] - 1)]
    rng.shuffle(pool)
    return sorted(pool[:n])


def train_step(drafter, embed, lm_head, seqs, picks, w: int, gamma: float) -> torch.Tensor:
    ctx, valid, first, start, meta = _block_inputs(drafter, embed, seqs, picks, w)
    h = drafter(ctx, valid, first, start)[:, 1:]                 # [A, B-1, H]
    b1 = h.shape[1]
    rows_h, rows_ids, rows_p, weights = [], [], [], []
    for r, (s, a) in enumerate(meta):
        sd = seqs[s]
        n = sd.tokens.shape[0]
        for j in range(1, b1 + 1):
            row = a + j - 1
            if row >= n:
                break
            rows_h.append(h[r, j - 1])
            rows_ids.append(sd.top_ids[row])
            rows_p.append(sd.top_p[row])
            weights.append(math.exp(-(j - 1) / gamma))
    hh = torch.stack(rows_h)
    ids = torch.stack(rows_ids)                                 # [N, K]
    p = torch.stack(rows_p)
    cand, inv = torch.unique(ids, return_inverse=True)          # candidate set of the batch
    logq = torch.log_softmax(hh @ lm_head[cand].t(), dim=-1)    # [N, C]
    ce = -(p * logq.gather(1, inv)).sum(-1)
    wt = torch.tensor(weights)
    return (ce * wt).sum() / wt.sum()


def run(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from tokenmill.contracts.errors import ModelLoadError
    from tokenmill.loader import load_model
    from tokenmill.models.dflash import DrafterConfig, init_drafter, load_drafter, save_drafter
    from tokenmill.train.traces import read_traces

    if args.threads:
        torch.set_num_threads(args.threads)
    t_start = time.perf_counter()
    try:
        traces = read_traces(args.traces)
    except (OSError, ValueError) as e:
        print(f"train-drafter: {e}", file=sys.stderr)
        return 2
    if len(traces) < 2:
        print("train-drafter: need at least two traces", file=sys.stderr)
        return 2
    loaded = load_model(args.model)
    target = loaded.model
    targs = target.args
    out = Path(args.out)
    ckpt = out / "checkpoint"
    try:
        if args.resume and (ckpt / "config.json").is_file():
            drafter = load_drafter(ckpt, target_hidden_size=targs.hidden_size, vocab_size=targs.vocab_size,
                                   target_num_layers=targs.num_layers)
        elif args.init:
            drafter = load_drafter(args.init, target_hidden_size=targs.hidden_size, vocab_size=targs.vocab_size,
                                   target_num_layers=targs.num_layers)
        else:
            layers = sorted(int(x) for x in args.target_layers.split(","))
            cfg = DrafterConfig(target_hidden_size=targs.hidden_size, vocab_size=targs.vocab_size,
                                target_layers=layers, hidden_size=targs.hidden_size, num_layers=args.num_layers,
                                num_heads=targs.num_heads, num_kv_heads=targs.num_kv_heads,
                                head_dim=targs.head_dim, intermediate_size=targs.intermediate_size // 2,
                                block_size=args.block_size, context_window=args.context_window,
                                rms_norm_eps=targs.rms_norm_eps, rope_theta=targs.rope_theta,
                                target_model=loaded.name)
            drafter = init_drafter(cfg, args.seed)
    except ModelLoadError as e:
        print(f"train-drafter: {e}", file=sys.stderr)
        return 2
    drafter.requires_grad_(True).train()
    c = drafter.config
    w = c.context_window
    embed, lm_head = dense(target.embed_tokens), dense(target.lm_head)

    held = [t for i, t in enumerate(traces) if _heldout(i, args.seed, args.heldout_fraction)]
    train = [t for i, t in enumerate(traces) if not _heldout(i, args.seed, args.heldout_fraction)]
    if not train or not held:
        print(f"train-drafter: {len(train)} training and {len(held)} held-out traces; need both "
              f"(change --heldout-fraction or give more traces)", file=sys.stderr)
        return 2
    print(f"traces: {len(train)} for training, {len(held)} held out; target {loaded.name}; "
          f"drafter {sum(p.numel() for p in drafter.parameters()) / 1e6:.2f}M parameters, "
          f"layers {c.target_layers}, block {c.block_size}", file=sys.stderr)
    tr_seqs = teacher_force(loaded, train, c.target_layers, args.top_k, args.max_len, "teacher forcing (train)")
    ho_seqs = teacher_force(loaded, held, c.target_layers, args.top_k, args.max_len, "teacher forcing (held out)")
    eval_anchors = _sample_eval_anchors(ho_seqs, args.eval_anchors, args.seed + 1)
    drafter.eval()
    before = acceptance_length(drafter, embed, lm_head, ho_seqs, eval_anchors, w)
    drafter.train()
    print(f"held-out acceptance length before: {before:.3f}", file=sys.stderr)

    opt = torch.optim.AdamW([p for p in drafter.parameters()], lr=args.lr, weight_decay=0.0)
    step0 = 0
    if args.resume and (ckpt / "state.pt").is_file():
        state = torch.load(ckpt / "state.pt", weights_only=False)
        opt.load_state_dict(state["optimizer"])
        step0 = int(state["step"])
        before = float(state.get("before", before))
        print(f"resumed at step {step0}", file=sys.stderr)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / 20) * 0.5 * (1 + math.cos(math.pi * min(s, args.steps) / args.steps)),
        last_epoch=step0 - 1 if step0 else -1)
    rng = random.Random(args.seed * 1000 + step0)
    weights = [max(sd.tokens.shape[0] - 1 - sd.sup_start, 0) for sd in tr_seqs]
    bar = tqdm(range(step0, args.steps), desc="training", unit="step", file=sys.stderr,
               initial=step0, total=args.steps)
    ema = None
    for step in bar:
        picks = []
        for s in rng.choices(range(len(tr_seqs)), weights=weights, k=args.seqs_per_step):
            sd = tr_seqs[s]
            hi = sd.tokens.shape[0] - 1
            picks.append((s, sorted(rng.randrange(sd.sup_start, hi) for _ in range(args.anchors_per_seq))))
        loss = train_step(drafter, embed, lm_head, tr_seqs, picks, w, args.gamma)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(drafter.parameters(), 1.0)
        opt.step()
        sched.step()
        lv = float(loss.detach())
        ema = lv if ema is None else 0.9 * ema + 0.1 * lv
        bar.set_postfix(loss=f"{ema:.3f}")
        if args.checkpoint_every and (step + 1) % args.checkpoint_every == 0 and step + 1 < args.steps:
            save_drafter(drafter, ckpt)
            torch.save({"optimizer": opt.state_dict(), "step": step + 1, "before": before}, ckpt / "state.pt")
    bar.close()
    drafter.eval()
    after = acceptance_length(drafter, embed, lm_head, ho_seqs, eval_anchors, w)
    print(f"held-out acceptance length before: {before:.3f}  after: {after:.3f}  "
          f"({len(eval_anchors)} anchors, block {c.block_size}, greedy)", file=sys.stderr)
    c.training = {"traces": [Path(t).name for t in args.traces],
                  "init": Path(args.init).name if args.init else None, "steps": args.steps,
                  "lr": args.lr, "gamma": args.gamma, "top_k": args.top_k,
                  "heldout_acceptance_before": round(before, 4), "heldout_acceptance_after": round(after, 4),
                  "train_traces": len(train), "heldout_traces": len(held),
                  "seconds": round(time.perf_counter() - t_start, 1)}
    save_drafter(drafter, out)
    print(json.dumps({"out": str(out), **c.training}))
    return 0
