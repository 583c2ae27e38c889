"""Speculative verify steps of the linear layers: sequences marked for verification keep the
state after every chunk position, and committing ``n`` kept tokens leaves the slot (recurrent and
conv state) exactly as if only those ``n`` tokens had been decoded; other sequences of the step
are unaffected."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tokenmill.contracts.batch import ForwardBatch
from tokenmill.contracts.kv import KVCacheSpec, LinearState
from tokenmill.layers.attention.base import ForwardContext
from tokenmill.layers.linear_attention import causal_conv_step, gated_delta_step
from tokenmill.layers.state_pool import StatePool

H, DK, DV, C, KW = 2, 8, 4, 6, 4


def _batch(lens: list[int], starts: list[int], slots: list[int]) -> ForwardBatch:
    positions = torch.cat([torch.arange(s, s + n) for s, n in zip(starts, lens)])
    qsl = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])
    t = int(qsl[-1])
    return ForwardBatch(input_ids=torch.zeros(t, dtype=torch.int64), positions=positions,
                        slot_mapping=torch.zeros(t, dtype=torch.int64), query_start_loc=qsl,
                        seq_lens=torch.tensor([s + n for s, n in zip(starts, lens)]),
                        block_tables=torch.zeros(len(lens), 1, dtype=torch.int64), logits_indices=qsl[1:] - 1,
                        page_size=16, state_slots=torch.tensor(slots))


def _pool(seed: int = 3) -> StatePool:
    pool = StatePool(KVCacheSpec((LinearState(H, DK, DV, C, KW),)), 6)
    gen = torch.Generator().manual_seed(seed)
    pool.rec[0].copy_(torch.randn(pool.rec[0].shape, generator=gen) * 0.5)
    pool.conv[0].copy_(torch.randn(pool.conv[0].shape, generator=gen))
    return pool


def _inputs(t: int, per_channel: bool, seed: int = 5):
    gen = torch.Generator().manual_seed(seed)
    q, k = torch.randn(t, H, DK, generator=gen), torch.randn(t, H, DK, generator=gen)
    v, x = torch.randn(t, H, DV, generator=gen), torch.randn(t, C, generator=gen)
    g = (-5.0 * torch.sigmoid(torch.randn(t, H, DK, generator=gen)) if per_channel
         else -F.softplus(torch.randn(t, H, generator=gen)))
    beta = torch.sigmoid(torch.randn(t, H, generator=gen))
    w = torch.randn(C, KW, generator=gen)
    return q, k, v, g, beta, x, w


def _step(pool: StatePool, lens, starts, slots, q, k, v, g, beta, x, w):
    ctx = ForwardContext(batch=_batch(lens, starts, slots), attn=None, meta=None, kv_caches=[None], states=pool)
    conv = causal_conv_step(x, w, None, ctx, 0, activation="silu")
    return gated_delta_step(q, k, v, g, beta, ctx, 0), conv


@pytest.mark.parametrize("per_channel", [True, False], ids=["per_channel", "per_head"])
@pytest.mark.parametrize("keep", [1, 2, 4, 5])
def test_commit_equals_decoding_only_the_kept_tokens(per_channel: bool, keep: int) -> None:
    # one step: a 5-token verify chunk (slot 1), a decode (slot 2), a fresh 9-token prefill
    # (slot 4), a 3-token verify chunk kept whole (slot 3)
    lens, starts, slots = [5, 1, 9, 3], [10, 7, 0, 4], [1, 2, 4, 3]
    q, k, v, g, beta, x, w = _inputs(sum(lens), per_channel)
    pool, ref = _pool(), _pool()
    before = pool.rec[0].clone(), pool.conv[0].clone()
    pool.begin_verify([0, 3], [1, 3], [5, 3])
    out, conv = _step(pool, lens, starts, slots, q, k, v, g, beta, x, w)
    after_step = pool.rec[0].clone(), pool.conv[0].clone()
    pool.commit_verify([keep, 3])
    assert pool.verify_rows is None

    # the reference: the same tokens of slot 1 and slot 3 decoded one step at a time, the
    # others run in a step without verification
    ref_out = torch.empty_like(out)
    ref_conv = torch.empty_like(conv)
    rows = {0: range(0, 5), 3: range(15, 18)}
    for i, r in rows.items():
        for t, row in enumerate(r):
            if i == 0 and t >= keep:
                break
            sl = slice(row, row + 1)
            o, c = _step(ref, [1], [starts[i] + t], [slots[i]], q[sl], k[sl], v[sl], g[sl], beta[sl], x[sl], w)
            ref_out[sl], ref_conv[sl] = o, c
    other = torch.tensor([5] + list(range(6, 15)))
    o, c = _step(ref, [1, 9], [7, 0], [2, 4], q[other], k[other], v[other], g[other], beta[other], x[other], w)
    ref_out[other], ref_conv[other] = o, c

    kept_rows = torch.tensor(list(range(keep)) + list(range(5, 18)))
    torch.testing.assert_close(out[kept_rows], ref_out[kept_rows], atol=1e-6, rtol=0)
    torch.testing.assert_close(conv[kept_rows], ref_conv[kept_rows], atol=1e-6, rtol=0)
    for slot in (1, 2, 3, 4):
        torch.testing.assert_close(pool.rec[0][slot], ref.rec[0][slot], atol=1e-6, rtol=0)
        assert torch.equal(pool.conv[0][slot], ref.conv[0][slot]), slot   # the kept inputs, copied
    assert torch.equal(pool.rec[0][0], before[0][0]) and torch.equal(pool.conv[0][5], before[1][5])
    if keep == 5:   # all kept: the commit changed nothing
        assert torch.equal(pool.rec[0], after_step[0]) and torch.equal(pool.conv[0], after_step[1])


def test_commit_checks_its_counts() -> None:
    pool = _pool()
    q, k, v, g, beta, x, w = _inputs(4, False)
    pool.begin_verify([0], [1], [4])
    _step(pool, [4], [3], [1], q, k, v, g, beta, x, w)
    with pytest.raises(ValueError, match="one count per verify sequence"):
        pool.commit_verify([1, 1])
    with pytest.raises(ValueError, match="at least its first token"):
        pool.commit_verify([0])
    pool.begin_verify([0], [1], [4])   # a step whose layers kept nothing cannot be rolled back
    with pytest.raises(RuntimeError, match="kept no verify states"):
        pool.commit_verify([2])
