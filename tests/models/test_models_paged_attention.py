"""The paged attention backend alone against plain attention over each sequence's full K/V."""
from __future__ import annotations

import random

import pytest
import torch

from tokenmill.contracts.kv import KVCacheSpec
from tokenmill.layers.attention import ForwardBatch, TorchPagedAttention, select_attention_backend

HQ, HKV, D = 6, 2, 8


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Attention of the last len(q) tokens of a sequence over all of its k/v (float64, causal)."""
    n, s = q.shape[0], k.shape[0]
    kk = k.double().repeat_interleave(HQ // HKV, dim=1)
    vv = v.double().repeat_interleave(HQ // HKV, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), kk) * scale
    allowed = torch.arange(s)[None, :] <= torch.arange(s - n, s)[:, None]
    probs = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
    return torch.einsum("hqk,khd->qhd", probs, vv).reshape(n, HQ * D)


BACKENDS = ["torch", "native"]


@pytest.mark.parametrize("backend_name", BACKENDS)
@pytest.mark.parametrize("page_size", [1, 3, 16])
def test_mixed_step_matches_plain_attention(page_size, backend_name):
    gen = torch.Generator().manual_seed(page_size)
    rng = random.Random(page_size)
    # (cached tokens before the step, tokens in the step): decodes, a fresh prefill, a chunk after context
    shapes = [(0, 9), (15, 1), (4, 7), (31, 1), (0, 1), (2 * page_size, 5)]
    num_pages = sum((c + n + page_size - 1) // page_size for c, n in shapes) + 1
    free = list(range(1, num_pages))
    rng.shuffle(free)
    kv = torch.zeros(2, num_pages, page_size, HKV, D)
    q_all, k_all, v_all, slots, qsl, seq_lens, tables, refs = [], [], [], [], [0], [], [], []
    scale = D ** -0.5
    for cached, n in shapes:
        total = cached + n
        pages = [free.pop() for _ in range((total + page_size - 1) // page_size)]
        k = torch.randn(total, HKV, D, generator=gen)
        v = torch.randn(total, HKV, D, generator=gen)
        q = torch.randn(n, HQ, D, generator=gen)
        for p in range(cached):  # earlier context already in the cache
            kv[0, pages[p // page_size], p % page_size] = k[p]
            kv[1, pages[p // page_size], p % page_size] = v[p]
        q_all.append(q)
        k_all.append(k[cached:])
        v_all.append(v[cached:])
        slots += [pages[p // page_size] * page_size + p % page_size for p in range(cached, total)]
        qsl.append(qsl[-1] + n)
        seq_lens.append(total)
        tables.append(pages)
        refs.append(_reference(q, k, v, scale))
    width = max(len(t) for t in tables) + 2  # wider than needed, as an engine may pass
    t = qsl[-1]
    batch = ForwardBatch(
        input_ids=torch.zeros(t, dtype=torch.long),
        positions=torch.cat([torch.arange(s - n, s) for (_, n), s in zip(shapes, seq_lens)]),
        slot_mapping=torch.tensor(slots), query_start_loc=torch.tensor(qsl), seq_lens=torch.tensor(seq_lens),
        block_tables=torch.tensor([p + [0] * (width - len(p)) for p in tables]),
        logits_indices=torch.tensor([x - 1 for x in qsl[1:]]), page_size=page_size)
    backend = select_attention_backend(KVCacheSpec.dense(1, HKV, D), "cpu", torch.float32, backend_name)
    assert backend.name == backend_name
    meta = backend.build_metadata(batch)
    if backend_name == "torch":
        assert meta.num_decode == 3 and len(meta.prefill) == 3
    out = backend.forward(torch.cat(q_all), torch.cat(k_all), torch.cat(v_all), kv, meta, scale)
    expected = torch.cat(refs).float()
    assert out.shape == (t, HQ * D)
    assert (out - expected).abs().max().item() < 1e-5
    # the step's K/V landed in their slots
    flat_k = kv[0].reshape(-1, HKV, D)
    assert torch.equal(flat_k[torch.tensor(slots)], torch.cat(k_all))


def test_too_narrow_block_table_is_rejected():
    batch = ForwardBatch(torch.zeros(1, dtype=torch.long), torch.tensor([20]), torch.tensor([4]),
                         torch.tensor([0, 1]), torch.tensor([21]), torch.tensor([[1, 2]]), torch.tensor([0]), 4)
    with pytest.raises(ValueError, match="too few for a context of 21 tokens"):
        TorchPagedAttention(KVCacheSpec.dense(1, 1, 4), torch.device("cpu"), torch.float32).build_metadata(batch)
