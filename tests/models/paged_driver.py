"""Test helper: drive a model over paged KV the way an engine would (no scheduler)."""
from __future__ import annotations

import random
from typing import Any, Sequence

import torch

from tokenmill.contracts.batch import ForwardBatch
from tokenmill.layers.attention import ForwardContext, select_attention_backend
from tokenmill.layers.state_pool import StatePool
from tokenmill.models.base import CausalLM


def chunks_batch(shapes: Sequence[tuple[int, int]], tables: Sequence[list[int]], page_size: int) -> ForwardBatch:
    """One step's batch for sequences given as ``(cached, new)`` token counts over page tables."""
    qsl, seq_lens, slots, pos = [0], [], [], []
    for (cached, n), table in zip(shapes, tables):
        qsl.append(qsl[-1] + n)
        seq_lens.append(cached + n)
        for p in range(cached, cached + n):
            slots.append(table[p // page_size] * page_size + p % page_size)
            pos.append(p)
    width = max(len(t) for t in tables)
    return ForwardBatch(torch.zeros(qsl[-1], dtype=torch.long), torch.tensor(pos), torch.tensor(slots),
                        torch.tensor(qsl), torch.tensor(seq_lens),
                        torch.tensor([t + [0] * (width - len(t)) for t in tables]),
                        torch.tensor([x - 1 for x in qsl[1:]]), page_size, max(seq_lens))


class PagedDriver:
    """Keeps page tables for named sequences and runs steps of mixed chunks through a model.

    Pages are handed out in a shuffled order so that a sequence's pages are never contiguous.
    A hybrid model (LinearState layers in its spec) also gets a state pool; each sequence takes
    a slot (in a shuffled order too) on its first chunk.
    """

    def __init__(self, model: CausalLM, num_pages: int = 96, page_size: int = 4, seed: int = 0,
                 backend: str = "auto", num_state_slots: int = 8) -> None:
        self.model = model
        self.page_size = page_size
        self.attn = select_attention_backend(model.kv_cache_spec(), "cpu", model.dtype, backend)
        self.kv = self.attn.allocate(num_pages, page_size)
        self.free = list(range(num_pages))
        random.Random(seed).shuffle(self.free)
        self.pages: dict[str, list[int]] = {}
        self.lens: dict[str, int] = {}
        spec = model.kv_cache_spec()
        self.states = StatePool(spec, num_state_slots) if spec.is_hybrid else None
        self.free_slots = list(range(num_state_slots))
        random.Random(seed + 1).shuffle(self.free_slots)
        self.slots: dict[str, int] = {}

    def step(self, chunks: Sequence[tuple[str, Sequence[int]]], all_rows: bool = False,
             capture_layers: frozenset[int] = frozenset(), sample: bool = True,
             decode_steps: int = 1) -> torch.Tensor:
        """Append each ``(seq, tokens)`` chunk to its sequence and run one forward.

        Returns logits of each chunk's last token (``all_rows``: of every token; ``sample=False``:
        of none, as for prefill chunks that do not finish their prompts), in order. The step's
        context (with the hidden states of ``capture_layers``) is kept in ``last_ctx``.
        ``decode_steps > 1``: one token per sequence, chained greedy steps
        (``ForwardContext.decode_steps``): pages for the chain are allocated first, each sequence
        grows by ``decode_steps`` tokens, and the tokens are in ``last_ctx.step_tokens``.
        """
        ps = self.page_size
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        qsl = [0]
        seq_lens: list[int] = []
        tables: list[list[int]] = []
        for seq, toks in chunks:
            start = self.lens.get(seq, 0)
            end = start + len(toks)
            table = self.pages.setdefault(seq, [])
            while len(table) * ps < end + decode_steps - 1:
                table.append(self.free.pop())
            self.lens[seq] = end + decode_steps - 1
            ids.extend(toks)
            for p in range(start, end):
                pos.append(p)
                slots.append(table[p // ps] * ps + p % ps)
            qsl.append(qsl[-1] + len(toks))
            seq_lens.append(end)
            tables.append(list(table))
            if self.states is not None and seq not in self.slots:
                self.slots[seq] = self.free_slots.pop()
        width = max(len(t) for t in tables)
        bt = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.long)
        rows = [] if not sample else list(range(qsl[-1])) if all_rows else [q - 1 for q in qsl[1:]]
        batch = ForwardBatch(
            input_ids=torch.tensor(ids, dtype=torch.long), positions=torch.tensor(pos, dtype=torch.long),
            slot_mapping=torch.tensor(slots, dtype=torch.long), query_start_loc=torch.tensor(qsl, dtype=torch.long),
            seq_lens=torch.tensor(seq_lens, dtype=torch.long), block_tables=bt,
            logits_indices=torch.tensor(rows, dtype=torch.long), page_size=ps, max_seq_len=max(seq_lens),
            state_slots=(torch.tensor([self.slots[seq] for seq, _ in chunks], dtype=torch.long)
                         if self.states is not None else None))
        self.last_ctx = ForwardContext.prepare(self.attn, batch, self.kv, capture_layers, states=self.states)
        self.last_ctx.decode_steps = decode_steps
        return self.model(self.last_ctx)

    def seq_kv(self, seq: str) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each layer's (K, V) rows of ``seq``'s tokens, in position order, read through its pages
        as float32 (fp8 pages as their stored bytes)."""
        ps, n = self.page_size, self.lens[seq]
        slots = torch.tensor([self.pages[seq][p // ps] * ps + p % ps for p in range(n)])
        out = []
        for c in self.kv:
            data = c.data if hasattr(c, "per_token") else c
            flat = data.reshape(2, -1, *data.shape[3:])
            k, v = flat[0][slots], flat[1][slots]
            out.append((k.float() if k.is_floating_point() else k, v.float() if v.is_floating_point() else v))
        return out


def hf_logits(ref: Any, tokens: Sequence[int]) -> torch.Tensor:
    """HF reference logits ``[len(tokens), vocab]`` of one sequence, fp32."""
    with torch.no_grad():
        return ref(torch.tensor([list(tokens)], dtype=torch.long)).logits[0].float()
