"""Linear-attention kernels of hybrid models: the gated delta rule and the short causal conv.

Gated delta rule (Gated DeltaNet of Qwen3-Next, Kimi Delta Attention of Ling), per head, with
state ``S`` ``[Dk, Dv]`` and log-decay ``g_t`` (one scalar per head, ``[T, H]``, or one per key
channel, ``[T, H, Dk]``)::

    S'  = diag(exp(g_t)) S_{t-1}                  decay (per row of S for per-channel g)
    u_t = beta_t * (v_t - S'^T k_t)               the delta-rule correction
    S_t = S' + k_t u_t^T
    o_t = scale * S_t^T q_t

with q and k optionally l2-normalised first (``x * rsqrt(sum x^2 + 1e-6)``, as FLA does) and
``scale = 1/sqrt(Dk)`` by default. Everything runs in fp32; outputs come back in q's dtype.

Two forms, equal up to fp32 rounding:

* :func:`chunk_gated_delta_rule`: one sequence's prefill chunk from a given state. Within each
  block of ``chunk_size`` positions, with ``G`` the cumulative log-decay from the block start and
  ``S0`` the state at the block start, all corrections come from one unit lower-triangular solve::

      (I + A) u = beta * (v - (k * exp(G)) S0),   A[t, s] = beta_t sum_d k_t[d] k_s[d] exp(G_t[d] - G_s[d])  (s < t)
      o         = scale * ((q * exp(G)) S0 + P u), P[t, s] = sum_d q_t[d] k_s[d] exp(G_t[d] - G_s[d])      (s <= t)
      S_end     = exp(G_last) * S0 + (k * exp(G_last - G))^T u

  With per-channel decay, ``exp(G_t - G_s)`` is computed as ``exp(G_t) * exp(-G_s)`` (so ``A`` and
  ``P`` are plain matmuls) while the block's cumulative decay stays within fp32's normal range
  (``-80 <= G <= 0``); a block with more decay is halved, and below 8 positions each difference
  ``G_t - G_s`` (``t >= s``) is exponentiated on its own, so nothing overflows however strong the
  decay. The Python loop runs over blocks, never over positions.
* :func:`recurrent_gated_delta_rule`: one token for each of B sequences, states ``[B, H, Dk, Dv]``.

Short causal conv (:func:`causal_conv1d_varlen`): depthwise, width K, over a varlen batch of
sequences packed as ``[T, C]``, each continuing from its conv state (its last K-1 inputs).

The per-layer entry points :func:`gated_delta_step` and :func:`causal_conv_step` take a whole
engine step (prefill chunks and decodes mixed) and read and write the state pool
(``ctx.states``) by ``ctx.batch.state_slots``. A sequence whose chunk starts at position 0 starts
from zero state (its slot's old contents are never read); every sequence's slot holds the state
after its chunk's last token when the step returns. Decodes (1-token chunks) go through the
batched recurrent form, longer chunks through the chunked form.

Speculative verification (``ctx.states.verify_rows``, set by the model runner): the sequences
verifying drafts (their last token then k drafts, a short chunk) run the recurrent form one
position at a time, batched over those sequences, and the pool keeps the state after every
position and the chunk's conv inputs, so that after verification the runner can leave each slot
exactly as if only the accepted tokens had been fed (``StatePool.commit_verify``).
"""
from __future__ import annotations

from typing import Any, NamedTuple

import torch
import torch.nn.functional as F

L2NORM_EPS = 1e-6
# Per-channel decay: a block whose cumulative log-decay stays within [-_MAX_LOG_DECAY, 0] is
# computed with exp(G_t) and exp(-G_s) as separate factors (plain matmuls; e^80 and e^-80 are
# normal fp32 numbers); a block with more decay is halved, down to _MIN_SPLIT positions, below
# which every pairwise difference is exponentiated.
_MAX_LOG_DECAY = 80.0
_MIN_SPLIT = 8


def l2norm(x: torch.Tensor, eps: float = L2NORM_EPS) -> torch.Tensor:
    """``x / sqrt(sum(x^2) + eps)`` over the last dim (FLA's convention, eps inside the root)."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def _prepare_qk(q: torch.Tensor, k: torch.Tensor, use_l2norm: bool,
                scale: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    q, k = q.float(), k.float()
    if use_l2norm:
        q, k = l2norm(q), l2norm(k)
    return q * (q.shape[-1] ** -0.5 if scale is None else scale), k


def _factorizable(cum: torch.Tensor) -> bool:
    return bool(cum.max() <= 0) and bool(cum.min() >= -_MAX_LOG_DECAY)


def _check_shapes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor) -> None:
    if q.shape != k.shape or q.dim() != 3 or v.dim() != 3 or v.shape[:2] != q.shape[:2]:
        raise ValueError(f"q, k must be [N, H, Dk] and v [N, H, Dv]; got {tuple(q.shape)}, {tuple(k.shape)}, "
                         f"{tuple(v.shape)}")
    if tuple(beta.shape) != tuple(q.shape[:2]):
        raise ValueError(f"beta must be [N, H]={tuple(q.shape[:2])}, got {tuple(beta.shape)}")
    if tuple(g.shape) not in (tuple(q.shape[:2]), tuple(q.shape)):
        raise ValueError(f"g must be [N, H] (per head) or [N, H, Dk] (per channel), got {tuple(g.shape)}")


def recurrent_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                               beta: torch.Tensor, state: torch.Tensor | None = None, *,
                               use_l2norm: bool = False, scale: float | None = None,
                               ) -> tuple[torch.Tensor, torch.Tensor]:
    """One step for B sequences: ``q, k`` [B, H, Dk], ``v`` [B, H, Dv], ``g`` [B, H] or [B, H, Dk],
    ``beta`` [B, H], ``state`` [B, H, Dk, Dv] (None: zeros). Returns ``(out [B, H, Dv], new state)``;
    ``state`` is not modified."""
    _check_shapes(q, k, v, g, beta)
    out_dtype = q.dtype
    q, k = _prepare_qk(q, k, use_l2norm, scale)
    v, g, beta = v.float(), g.float(), beta.float()
    b, h, dk = k.shape
    if state is None:
        state = torch.zeros(b, h, dk, v.shape[-1], dtype=torch.float32, device=v.device)
    decay = g.exp()
    s = state.float() * (decay[..., None] if g.dim() == 3 else decay[..., None, None])
    predicted = torch.einsum("bhk,bhkv->bhv", k, s)
    u = (v - predicted) * beta[..., None]
    s = s + k[..., :, None] * u[..., None, :]
    out = torch.einsum("bhk,bhkv->bhv", q, s)
    return out.to(out_dtype), s


def chunk_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                           beta: torch.Tensor, initial_state: torch.Tensor | None = None, *,
                           use_l2norm: bool = False, scale: float | None = None, chunk_size: int = 64,
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence: ``q, k`` [T, H, Dk], ``v`` [T, H, Dv], ``g`` [T, H] or [T, H, Dk], ``beta`` [T, H],
    ``initial_state`` [H, Dk, Dv] (None: zeros). Returns ``(out [T, H, Dv], final state [H, Dk, Dv])``."""
    _check_shapes(q, k, v, g, beta)
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    out_dtype = q.dtype
    q, k = _prepare_qk(q, k, use_l2norm, scale)
    per_channel = g.dim() == 3
    # Head-major: [H, T, ...].
    q, k, v = (x.transpose(0, 1) for x in (q, k, v.float()))
    g, beta = g.float().transpose(0, 1), beta.float().transpose(0, 1)
    h, t, dk = k.shape
    dv = v.shape[-1]
    s = (torch.zeros(h, dk, dv, dtype=torch.float32, device=v.device) if initial_state is None
         else initial_state.float().clone())
    out = torch.empty(h, t, dv, dtype=torch.float32, device=v.device)
    blocks = [(c0, min(t, c0 + chunk_size)) for c0 in range(0, t, chunk_size)][::-1]
    while blocks:
        c0, c1 = blocks.pop()
        n = c1 - c0
        qc, kc, vc, bc = q[:, c0:c1], k[:, c0:c1], v[:, c0:c1], beta[:, c0:c1]
        cum = g[:, c0:c1].cumsum(dim=1)                       # [H, n] or [H, n, Dk]
        causal = torch.ones(n, n, dtype=torch.bool, device=v.device).tril()
        last = cum[:, -1]                                      # [H] or [H, Dk]
        if per_channel:
            if n > _MIN_SPLIT and not _factorizable(cum):
                mid = c0 + n // 2                               # too much decay inside: halve the block
                blocks += [(mid, c1), (c0, mid)]
                continue
            eg = cum.exp()
            if _factorizable(cum):
                # exp(G_t - G_s) = exp(G_t) * exp(-G_s): two matmuls, exact while neither factor
                # leaves fp32's normal range (checked above)
                k_inv = kc * (-cum).exp()
                kk = (kc * eg) @ k_inv.transpose(1, 2)
                qk = ((qc * eg) @ k_inv.transpose(1, 2)).masked_fill(~causal, 0.0)
            else:  # a short block with extreme decay: exponentiate each difference
                diff = (cum[:, :, None, :] - cum[:, None, :, :]).masked_fill(~causal[None, :, :, None], float("-inf"))
                pair = diff.exp()                              # [H, n, n, Dk]
                kk = torch.einsum("htd,hsd,htsd->hts", kc, kc, pair)
                qk = torch.einsum("htd,hsd,htsd->hts", qc, kc, pair)
            k_read, q_read = kc * eg, qc * eg
            k_write = kc * (last[:, None, :] - cum).exp()
            s_decay = last.exp()[:, :, None]
        else:
            pair = (cum[:, :, None] - cum[:, None, :]).masked_fill(~causal, float("-inf")).exp()   # [H, n, n]
            kk = (kc @ kc.transpose(1, 2)) * pair
            qk = (qc @ kc.transpose(1, 2)) * pair
            k_read = kc * cum.exp()[..., None]
            q_read = qc * cum.exp()[..., None]
            k_write = kc * (last[:, None] - cum).exp()[..., None]
            s_decay = last.exp()[:, None, None]
        system = (bc[..., None] * kk).tril(-1) + torch.eye(n, dtype=torch.float32, device=v.device)
        rhs = bc[..., None] * (vc - k_read @ s)
        u = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
        out[:, c0:c1] = q_read @ s + qk @ u
        s = s * s_decay + k_write.transpose(1, 2) @ u
    return out.transpose(0, 1).to(out_dtype), s


class ConvOutput(NamedTuple):
    out: torch.Tensor      # [T, C]
    state: torch.Tensor    # [B, C, K-1] fp32: each sequence's last K-1 inputs


def causal_conv1d_varlen(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                         query_start_loc: torch.Tensor | list[int], state: torch.Tensor | None = None,
                         activation: str | None = None) -> ConvOutput:
    """Depthwise causal conv of width K over sequences packed in ``x`` [T, C].

    ``weight`` [C, K] (HF's ``conv1d.weight`` squeezed), ``bias`` [C] or None, ``query_start_loc``
    [B+1] cumulative lengths, ``state`` [B, C, K-1] the inputs before each sequence (oldest
    first; None: zeros). ``activation``: None or ``"silu"``. Computed in fp32, returned in x's dtype.
    """
    if x.dim() != 2 or weight.dim() != 2 or weight.shape[0] != x.shape[1]:
        raise ValueError(f"x must be [T, C] and weight [C, K]; got {tuple(x.shape)}, {tuple(weight.shape)}")
    if activation not in (None, "silu", "swish"):
        raise ValueError(f"conv activation must be None or 'silu', got {activation!r}")
    qsl = query_start_loc.tolist() if isinstance(query_start_loc, torch.Tensor) else list(query_start_loc)
    b = len(qsl) - 1
    c, kw = weight.shape
    if state is None:
        state = torch.zeros(b, c, kw - 1, dtype=torch.float32, device=x.device)
    if tuple(state.shape) != (b, c, kw - 1):
        raise ValueError(f"conv state must be [B={b}, C={c}, K-1={kw - 1}], got {tuple(state.shape)}")
    t, dev, w1 = x.shape[0], x.device, kw - 1
    if b == 0:
        return ConvOutput(x.new_empty(0, c), state)
    # Extended buffer [T + B(K-1), C], built without a loop over sequences: sequence i's K-1 state
    # inputs at rows qsl[i] + i(K-1) .., then its tokens; token r's window (its K inputs, oldest
    # first) starts at row r + i(K-1).
    lens = torch.tensor([qsl[i + 1] - qsl[i] for i in range(b)], device=dev)
    seq_of = torch.repeat_interleave(torch.arange(b, device=dev), lens)                  # [T]
    rows = torch.arange(t, device=dev) + seq_of * w1                                    # window start
    seq_start = torch.tensor(qsl[:-1], device=dev) + torch.arange(b, device=dev) * w1   # [B]
    taps = torch.arange(w1, device=dev)
    ext = torch.empty(t + b * w1, c, dtype=torch.float32, device=dev)
    ext[rows + w1] = x.float()
    ext[(seq_start[:, None] + taps[None, :]).reshape(-1)] = state.float().transpose(1, 2).reshape(-1, c)
    idx = rows[:, None] + torch.arange(kw, device=dev)[None, :]                        # [T, K]
    out = (ext[idx] * weight.float().transpose(0, 1)[None]).sum(dim=1)
    if bias is not None:
        out = out + bias.float()
    if activation is not None:
        out = F.silu(out)
    tail = (seq_start + lens)[:, None] + taps[None, :]                                   # [B, K-1]
    new_state = ext[tail].transpose(1, 2)
    return ConvOutput(out.to(x.dtype), new_state.contiguous())


class StepLayout(NamedTuple):
    starts: list[int]        # first token row of each sequence
    lens: list[int]          # query tokens of each sequence
    fresh: torch.Tensor      # [B] bool: the sequence's chunk starts at position 0 (zero state)
    slots: torch.Tensor      # [B] int64 state-pool slots


def step_layout(batch: Any) -> StepLayout:
    """The per-sequence layout of one engine step, as the linear layers need it."""
    if batch.state_slots is None:
        raise ValueError("a hybrid model's step needs ForwardBatch.state_slots (one state-pool slot per sequence)")
    qsl = batch.query_start_loc.tolist()
    starts = qsl[:-1]
    lens = [b - a for a, b in zip(qsl[:-1], qsl[1:])]
    if any(n <= 0 for n in lens):
        raise ValueError(f"every sequence of a hybrid step needs at least one query token, got lengths {lens}")
    slots = batch.state_slots.to(torch.int64)
    if tuple(slots.shape) != (len(lens),):
        raise ValueError(f"state_slots must be [B={len(lens)}], got {tuple(slots.shape)}")
    fresh = batch.positions[torch.tensor(starts, dtype=torch.int64, device=batch.positions.device)] == 0
    return StepLayout(starts, lens, fresh, slots)


def _layer_states(ctx: Any, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
    states = ctx.states
    if states is None:
        raise ValueError("a hybrid model's step needs ForwardContext.states (the state pool)")
    rec, conv = states.rec[layer_idx], states.conv[layer_idx]
    if rec is None or conv is None:
        raise ValueError(f"layer {layer_idx} is not a LinearState layer of the state pool")
    return rec, conv


def _read_slots(pool: torch.Tensor, layout: StepLayout) -> torch.Tensor:
    """The slots' states, zero for sequences starting at position 0 (their slot is never read)."""
    got = pool.index_select(0, layout.slots)
    keep = (~layout.fresh).to(got.dtype).view(-1, *([1] * (got.dim() - 1)))
    return torch.where(keep.bool(), got, torch.zeros((), dtype=got.dtype, device=got.device))


def causal_conv_step(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, ctx: Any,
                     layer_idx: int, activation: str | None = None) -> torch.Tensor:
    """The short causal conv of layer ``layer_idx`` over a whole step (``x`` [T, C]), continuing
    each sequence from its conv state in the pool and writing the new state back."""
    layout = step_layout(ctx.batch)
    _, conv_pool = _layer_states(ctx, layer_idx)
    init = _read_slots(conv_pool, layout)
    res = causal_conv1d_varlen(x, weight, bias, ctx.batch.query_start_loc, init, activation)
    conv_pool.index_copy_(0, layout.slots, res.state.to(conv_pool.dtype))
    verify = ctx.states.verify_rows
    if verify:
        ctx.states.keep_verify_conv(layer_idx, _conv_windows(x, init, layout, verify))
    return res.out


def _conv_windows(x: torch.Tensor, init: torch.Tensor, layout: StepLayout, rows: list[int]) -> torch.Tensor:
    """``[n, C, K-1+L]`` for batch sequences ``rows``: each one's conv state before the chunk,
    then its chunk's inputs (fp32), zero-padded to the longest chunk L."""
    lens = [layout.lens[i] for i in rows]
    width = max(lens)
    sel = torch.tensor(rows, dtype=torch.int64, device=x.device)
    win = init.new_zeros(len(rows), init.shape[1], init.shape[2] + width)
    win[:, :, :init.shape[2]] = init.index_select(0, sel)
    for j, (i, n) in enumerate(zip(rows, lens)):   # a few short verify chunks
        a = layout.starts[i]
        win[j, :, init.shape[2]:init.shape[2] + n] = x[a:a + n].float().transpose(0, 1)
    return win


def gated_delta_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                     ctx: Any, layer_idx: int, *, use_l2norm: bool = True, scale: float | None = None,
                     chunk_size: int = 64) -> torch.Tensor:
    """The gated delta rule of layer ``layer_idx`` over a whole step: ``q, k`` [T, H, Dk], ``v``
    [T, H, Dv], ``g`` [T, H] or [T, H, Dk], ``beta`` [T, H]. Returns ``[T, H, Dv]`` in q's dtype and
    leaves each sequence's state after its last token in its slot."""
    _check_shapes(q, k, v, g, beta)
    layout = step_layout(ctx.batch)
    rec_pool, _ = _layer_states(ctx, layer_idx)
    init = _read_slots(rec_pool, layout)
    final = torch.empty_like(init)
    out = torch.empty(v.shape, dtype=q.dtype, device=v.device)
    verify = ctx.states.verify_rows or []
    if verify:
        _verify_recurrent(q, k, v, g, beta, init, final, out, layout, verify, ctx.states, layer_idx,
                          use_l2norm, scale)
    skip = set(verify)
    decode = [i for i, n in enumerate(layout.lens) if n == 1 and i not in skip]
    if decode:
        rows = torch.tensor([layout.starts[i] for i in decode], dtype=torch.int64, device=q.device)
        sel = torch.tensor(decode, dtype=torch.int64, device=q.device)
        o, s = recurrent_gated_delta_rule(q[rows], k[rows], v[rows], g[rows], beta[rows], init[sel],
                                          use_l2norm=use_l2norm, scale=scale)
        out[rows] = o
        final[sel] = s
    for i, (a, n) in enumerate(zip(layout.starts, layout.lens)):
        if n == 1 or i in skip:
            continue
        sl = slice(a, a + n)
        o, s = chunk_gated_delta_rule(q[sl], k[sl], v[sl], g[sl], beta[sl], init[i], use_l2norm=use_l2norm,
                                      scale=scale, chunk_size=chunk_size)
        out[sl] = o
        final[i] = s
    rec_pool.index_copy_(0, layout.slots, final.to(rec_pool.dtype))
    return out


def _verify_recurrent(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                      init: torch.Tensor, final: torch.Tensor, out: torch.Tensor, layout: StepLayout,
                      rows: list[int], states: Any, layer_idx: int, use_l2norm: bool,
                      scale: float | None) -> None:
    """The verify sequences ``rows``: the recurrent form position by position (batched over the
    sequences), the same computation a decode step does, keeping the state after each position
    in the pool (``keep_verify_states``) and the one after the last in ``final``."""
    lens = [layout.lens[i] for i in rows]
    dev = q.device
    sel = torch.tensor(rows, dtype=torch.int64, device=dev)
    s = init.index_select(0, sel)
    # the state after a chunk's last position is its final state (in the slot); only the ones
    # before it can be needed by a rollback
    kept = s.new_zeros(len(rows), max(lens) - 1, *s.shape[1:])
    for t in range(max(lens)):
        act = [j for j, n in enumerate(lens) if n > t]
        r = torch.tensor([layout.starts[rows[j]] + t for j in act], dtype=torch.int64, device=dev)
        a = torch.tensor(act, dtype=torch.int64, device=dev)
        o, s_new = recurrent_gated_delta_rule(q[r], k[r], v[r], g[r], beta[r], s[a], use_l2norm=use_l2norm,
                                              scale=scale)
        out[r] = o
        s[a] = s_new
        if t < kept.shape[1]:
            kept[a, t] = s_new
    final[sel] = s
    states.keep_verify_states(layer_idx, kept)
