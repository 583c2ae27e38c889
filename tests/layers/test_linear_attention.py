"""The linear-attention kernels: chunked == recurrent, both == HF's own torch functions, varlen
steps == each sequence alone, and the conv state carried across calls."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tokenmill.contracts.batch import ForwardBatch
from tokenmill.contracts.kv import KVCacheSpec, LinearState
from tokenmill.layers.attention.base import ForwardContext
from tokenmill.layers.linear_attention import (causal_conv1d_varlen, causal_conv_step, chunk_gated_delta_rule,
                                               gated_delta_step, recurrent_gated_delta_rule)
from tokenmill.layers.state_pool import StatePool

H, DK, DV = 3, 8, 6
TOL = 1e-5


def _inputs(t: int, per_channel: bool, seed: int = 0, h: int = H) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(t, h, DK, generator=gen)
    k = torch.randn(t, h, DK, generator=gen)
    v = torch.randn(t, h, DV, generator=gen)
    if per_channel:   # KDA's safe gate: lower_bound * sigmoid(.) in (-5, 0)
        g = -5.0 * torch.sigmoid(torch.randn(t, h, DK, generator=gen))
    else:             # GDN: -exp(A_log) * softplus(.)
        g = -F.softplus(torch.randn(t, h, generator=gen)) * 0.7
    beta = torch.sigmoid(torch.randn(t, h, generator=gen))
    return q, k, v, g, beta


def _state(seed: int = 9, b: int | None = None) -> torch.Tensor:
    shape = (H, DK, DV) if b is None else (b, H, DK, DV)
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * 0.5


def _recurrent_all(q, k, v, g, beta, state, use_l2norm=True):
    outs = []
    s = state[None]
    for t in range(q.shape[0]):
        o, s = recurrent_gated_delta_rule(q[t:t + 1], k[t:t + 1], v[t:t + 1], g[t:t + 1], beta[t:t + 1], s,
                                          use_l2norm=use_l2norm)
        outs.append(o)
    return torch.cat(outs), s[0]


@pytest.mark.parametrize("per_channel", [True, False], ids=["per_channel", "per_head"])
@pytest.mark.parametrize("piece", [1, 7, 64, 150], ids=lambda n: f"chunk{n}")
def test_chunked_equals_recurrent(per_channel: bool, piece: int) -> None:
    """A 150-token prompt prefilled in engine chunks of ``piece`` tokens (each continuing from the
    state the previous one left) equals 150 recurrent steps, outputs and final state."""
    t = 150
    q, k, v, g, beta = _inputs(t, per_channel)
    s0 = _state()
    ref_out, ref_state = _recurrent_all(q, k, v, g, beta, s0)
    outs, s = [], s0
    for a in range(0, t, piece):
        o, s = chunk_gated_delta_rule(q[a:a + piece], k[a:a + piece], v[a:a + piece], g[a:a + piece],
                                      beta[a:a + piece], s, use_l2norm=True)
        outs.append(o)
    torch.testing.assert_close(torch.cat(outs), ref_out, atol=TOL, rtol=0)
    torch.testing.assert_close(s, ref_state, atol=TOL, rtol=0)


@pytest.mark.parametrize("block", [1, 7, 64, 200])
def test_kernel_block_size_does_not_change_results(block: int) -> None:
    q, k, v, g, beta = _inputs(100, True, seed=3)
    ref_out, ref_state = chunk_gated_delta_rule(q, k, v, g, beta, _state(), use_l2norm=True, chunk_size=64)
    out, s = chunk_gated_delta_rule(q, k, v, g, beta, _state(), use_l2norm=True, chunk_size=block)
    torch.testing.assert_close(out, ref_out, atol=TOL, rtol=0)
    torch.testing.assert_close(s, ref_state, atol=TOL, rtol=0)


def test_without_in_kernel_l2norm_and_custom_scale() -> None:
    q, k, v, g, beta = _inputs(40, False, seed=5)
    k = F.normalize(k, dim=-1)
    ref_out, ref_state = [], _state()[None]
    for t in range(40):
        o, ref_state = recurrent_gated_delta_rule(q[t:t + 1], k[t:t + 1], v[t:t + 1], g[t:t + 1], beta[t:t + 1],
                                                  ref_state, scale=0.3)
        ref_out.append(o)
    out, s = chunk_gated_delta_rule(q, k, v, g, beta, _state(), scale=0.3, chunk_size=16)
    torch.testing.assert_close(out, torch.cat(ref_out), atol=TOL, rtol=0)
    torch.testing.assert_close(s, ref_state[0], atol=TOL, rtol=0)


def test_equals_hf_kimi_delta_attention() -> None:
    hf = pytest.importorskip("transformers.models.bailing_hybrid.modeling_bailing_hybrid")
    q, k, v, g, beta = _inputs(90, True, seed=11)
    s0 = _state()
    b = lambda x: x[None]   # HF takes [B, T, H, D]
    hf_out, hf_state = hf.chunk_kimi_delta_attention(b(q), b(k), b(v), b(g), b(beta), initial_state=s0[None],
                                                     output_final_state=True, use_qk_l2norm_in_kernel=True)
    out, s = chunk_gated_delta_rule(q, k, v, g, beta, s0, use_l2norm=True)
    torch.testing.assert_close(out, hf_out[0], atol=TOL, rtol=0)
    torch.testing.assert_close(s, hf_state[0], atol=TOL, rtol=0)
    hf_out, hf_state = hf.recurrent_kimi_delta_attention(b(q), b(k), b(v), b(g), b(beta), initial_state=s0[None],
                                                         output_final_state=True, use_qk_l2norm_in_kernel=True)
    out, s = _recurrent_all(q, k, v, g, beta, s0)
    torch.testing.assert_close(out, hf_out[0], atol=TOL, rtol=0)
    torch.testing.assert_close(s, hf_state[0], atol=TOL, rtol=0)


def test_equals_hf_gated_delta_rule() -> None:
    hf = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")
    q, k, v, g, beta = _inputs(90, False, seed=12)
    s0 = _state()
    b = lambda x: x[None]
    hf_out, hf_state = hf.torch_chunk_gated_delta_rule(b(q), b(k), b(v), b(g), b(beta), initial_state=s0[None],
                                                       output_final_state=True, use_qk_l2norm_in_kernel=True)
    out, s = chunk_gated_delta_rule(q, k, v, g, beta, s0, use_l2norm=True)
    torch.testing.assert_close(out, hf_out[0], atol=TOL, rtol=0)
    torch.testing.assert_close(s, hf_state[0], atol=TOL, rtol=0)
    hf_out, hf_state = hf.torch_recurrent_gated_delta_rule(b(q), b(k), b(v), b(g), b(beta), initial_state=s0[None],
                                                           output_final_state=True, use_qk_l2norm_in_kernel=True)
    out, s = _recurrent_all(q, k, v, g, beta, s0)
    torch.testing.assert_close(out, hf_out[0], atol=TOL, rtol=0)
    torch.testing.assert_close(s, hf_state[0], atol=TOL, rtol=0)


def test_recurrent_is_batched_over_sequences() -> None:
    q, k, v, g, beta = _inputs(5, True, seed=4)
    states = _state(b=5)
    out, new = recurrent_gated_delta_rule(q, k, v, g, beta, states, use_l2norm=True)
    for i in range(5):
        o, s = recurrent_gated_delta_rule(q[i:i + 1], k[i:i + 1], v[i:i + 1], g[i:i + 1], beta[i:i + 1],
                                          states[i:i + 1], use_l2norm=True)
        torch.testing.assert_close(out[i], o[0], atol=1e-6, rtol=0)
        torch.testing.assert_close(new[i], s[0], atol=1e-6, rtol=0)


def test_shapes_are_checked() -> None:
    q, k, v, g, beta = _inputs(4, True)
    with pytest.raises(ValueError, match="g must be"):
        chunk_gated_delta_rule(q, k, v, g[..., :3], beta)
    with pytest.raises(ValueError, match="beta must be"):
        chunk_gated_delta_rule(q, k, v, g, beta[:, :2])


# ---- convolution ----------------------------------------------------------------------------

C, KW = 10, 4


def _conv_weights(seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(C, KW, generator=gen), torch.randn(C, generator=gen)


def test_conv_equals_hf_and_state_split_equals_one_call() -> None:
    hf = pytest.importorskip("transformers.models.bailing_hybrid.modeling_bailing_hybrid")
    w, _ = _conv_weights()
    x = torch.randn(23, C, generator=torch.Generator().manual_seed(2))
    ref = hf.causal_conv1d_fn(x.T[None], w, None, activation="silu")[0].T
    whole = causal_conv1d_varlen(x, w, None, [0, 23], activation="silu")
    torch.testing.assert_close(whole.out, ref, atol=1e-6, rtol=0)
    torch.testing.assert_close(whole.state[0], x[-(KW - 1):].T, atol=0, rtol=0)
    # Split in pieces of 1, 2, 7, 13 tokens, the state carried across calls.
    state, outs, a = None, [], 0
    for n in (1, 2, 7, 13):
        res = causal_conv1d_varlen(x[a:a + n], w, None, [0, n], state, activation="silu")
        outs.append(res.out)
        state, a = res.state, a + n
    torch.testing.assert_close(torch.cat(outs), whole.out, atol=1e-6, rtol=0)
    torch.testing.assert_close(state, whole.state, atol=0, rtol=0)


def test_conv_varlen_batch_equals_each_alone() -> None:
    w, bias = _conv_weights(3)
    gen = torch.Generator().manual_seed(4)
    lens = [5, 1, 2, 9]
    xs = [torch.randn(n, C, generator=gen) for n in lens]
    states = torch.randn(len(lens), C, KW - 1, generator=gen)
    qsl = [0]
    for n in lens:
        qsl.append(qsl[-1] + n)
    res = causal_conv1d_varlen(torch.cat(xs), w, bias, torch.tensor(qsl), states)
    for i, x in enumerate(xs):
        alone = causal_conv1d_varlen(x, w, bias, [0, len(x)], states[i:i + 1])
        torch.testing.assert_close(res.out[qsl[i]:qsl[i + 1]], alone.out, atol=1e-6, rtol=0)
        torch.testing.assert_close(res.state[i], alone.state[0], atol=0, rtol=0)


# ---- per-layer step entry points over the state pool ------------------------------------------

def _batch(lens: list[int], starts: list[int], slots: list[int]) -> ForwardBatch:
    positions = torch.cat([torch.arange(s, s + n) for s, n in zip(starts, lens)])
    qsl = torch.tensor([0] + list(torch.tensor(lens).cumsum(0).tolist()))
    t, b = int(qsl[-1]), len(lens)
    return ForwardBatch(input_ids=torch.zeros(t, dtype=torch.int64), positions=positions,
                        slot_mapping=torch.zeros(t, dtype=torch.int64), query_start_loc=qsl,
                        seq_lens=torch.tensor([s + n for s, n in zip(starts, lens)]),
                        block_tables=torch.zeros(b, 1, dtype=torch.int64), logits_indices=qsl[1:] - 1,
                        page_size=16, state_slots=torch.tensor(slots))


def _ctx(batch: ForwardBatch, pool: StatePool) -> ForwardContext:
    return ForwardContext(batch=batch, attn=None, meta=None, kv_caches=[None], states=pool)


def _pool(slots: int = 6) -> StatePool:
    return StatePool(KVCacheSpec((LinearState(H, DK, DV, C, KW),)), slots)


def test_step_mixed_batch_equals_each_sequence_alone() -> None:
    """Three sequences in one step: a fresh 9-token prefill (its slot holds garbage that must not be
    read), a decode and a 5-token continuation chunk; each equals the same sequence run alone."""
    pool = _pool()
    gen = torch.Generator().manual_seed(7)
    for slot in range(6):
        pool.rec[0][slot] = torch.randn(H, DK, DV, generator=gen)
        pool.conv[0][slot] = torch.randn(C, KW - 1, generator=gen)
    before_rec, before_conv = pool.rec[0].clone(), pool.conv[0].clone()
    lens, starts, slots = [9, 1, 5], [0, 12, 3], [4, 1, 2]
    t = sum(lens)
    q, k, v, g, beta = _inputs(t, True, seed=8)
    x = torch.randn(t, C, generator=gen)
    w, bias = _conv_weights(5)
    batch = _batch(lens, starts, slots)
    out = gated_delta_step(q, k, v, g, beta, _ctx(batch, pool), 0)
    conv = causal_conv_step(x, w, bias, _ctx(batch, pool), 0, activation="silu")
    a = 0
    for n, start, slot in zip(lens, starts, slots):
        sl = slice(a, a + n)
        init = torch.zeros(H, DK, DV) if start == 0 else before_rec[slot]
        ref_out, ref_state = _recurrent_all(q[sl], k[sl], v[sl], g[sl], beta[sl], init)
        torch.testing.assert_close(out[sl], ref_out, atol=TOL, rtol=0)
        torch.testing.assert_close(pool.rec[0][slot], ref_state, atol=TOL, rtol=0)
        cinit = torch.zeros(1, C, KW - 1) if start == 0 else before_conv[slot:slot + 1]
        ref_conv = causal_conv1d_varlen(x[sl], w, bias, [0, n], cinit, activation="silu")
        torch.testing.assert_close(conv[sl], ref_conv.out, atol=1e-6, rtol=0)
        torch.testing.assert_close(pool.conv[0][slot], ref_conv.state[0], atol=0, rtol=0)
        a += n
    for untouched in (0, 3, 5):
        assert torch.equal(pool.rec[0][untouched], before_rec[untouched])
        assert torch.equal(pool.conv[0][untouched], before_conv[untouched])


def test_step_prefill_in_chunks_then_decode_equals_one_pass() -> None:
    """Engine-style: a 20-token prompt prefilled in chunks of 7 through the pool, then 3 decodes,
    equals the whole 23 tokens computed at once from zero state."""
    pool = _pool(2)
    q, k, v, g, beta = _inputs(23, False, seed=13)
    ref_out, ref_state = _recurrent_all(q, k, v, g, beta, torch.zeros(H, DK, DV))
    outs = []
    for a, n in [(0, 7), (7, 7), (14, 6), (20, 1), (21, 1), (22, 1)]:
        sl = slice(a, a + n)
        outs.append(gated_delta_step(q[sl], k[sl], v[sl], g[sl], beta[sl], _ctx(_batch([n], [a], [1]), pool), 0))
    torch.testing.assert_close(torch.cat(outs), ref_out, atol=TOL, rtol=0)
    torch.testing.assert_close(pool.rec[0][1], ref_state, atol=TOL, rtol=0)


def test_step_needs_slots_and_pool() -> None:
    q, k, v, g, beta = _inputs(3, True)
    batch = _batch([3], [0], [0])
    with pytest.raises(ValueError, match="state pool"):
        gated_delta_step(q, k, v, g, beta, _ctx(batch, None), 0)
    batch.state_slots = None
    with pytest.raises(ValueError, match="state_slots"):
        gated_delta_step(q, k, v, g, beta, _ctx(batch, _pool()), 0)


@pytest.mark.parametrize("strength", [0.02, 5.0, 60.0], ids=["weak", "kda", "extreme"])
def test_chunked_per_channel_any_decay_strength(strength: float) -> None:
    """Weak decay (whole 64-blocks factorised), KDA's range (blocks halved) and extreme decay
    (short blocks with every pairwise difference exponentiated) all equal the recurrence."""
    q, k, v, _, beta = _inputs(130, True, seed=17)
    g = -strength * torch.sigmoid(torch.randn(130, H, DK, generator=torch.Generator().manual_seed(18)))
    ref_out, ref_state = _recurrent_all(q, k, v, g, beta, _state())
    out, s = chunk_gated_delta_rule(q, k, v, g, beta, _state(), use_l2norm=True)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, ref_out, atol=TOL, rtol=0)
    torch.testing.assert_close(s, ref_state, atol=TOL, rtol=0)
