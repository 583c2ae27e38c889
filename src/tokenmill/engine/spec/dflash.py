"""The DFlash proposer: runs :class:`~tokenmill.models.dflash.DFlashDrafter` for every
decoding request in one batched pass per step.

Per request it keeps the fused target hidden states of its last ``context_window`` computed
tokens (fed by :meth:`DFlashProposer.observe` from the target forward's captures, so no extra
target pass). A request whose context does not reach its last computed token (just admitted
after a preemption, for instance) gets no draft until it does. Drafts are the drafter's argmax
per block position, verified as point masses (lossless for greedy and sampled requests alike).

Capture while the drafter is off: the engine captures a request's hidden states only while its
next possible draft is at most :attr:`DFlashProposer.resume_context` steps away (engine/spec,
*Hidden-state capture*); on other steps the target forward runs unsplit and nothing is handed
over. The positions captured then resume after a gap, and the context restarts there: it holds
only contiguous positions ending right before the token being drafted from, and a restarted
context drafts once it holds ``resume_context`` positions (or reaches back to position 0). On
the shipped SmolLM2-135M drafter (context window 64) the held-out acceptance length is 1.243
with the full window, 1.210 with the 8 or 16 most recent positions and 1.173 with one, so a
probe from an 8-position context measures nearly what the drafter does with its whole window,
and the window refills while the drafter stays on.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from tokenmill.engine.spec.base import Draft, Proposer
from tokenmill.layers.sampling import row_argmax
from tokenmill.models.dflash import DFlashDrafter, load_drafter

if TYPE_CHECKING:
    from tokenmill.engine.request import Request


class _Context:
    """Features of positions ``[end - len(feats) - rows(raw), end)`` of one request: ``feats``
    fused, then ``raw`` (captured target hidden states not fused yet; they are fused when the
    request next drafts, so a step on which it does not draft costs only a list append)."""

    __slots__ = ("feats", "raw", "raw_rows", "end")

    def __init__(self, hidden: int, dtype: torch.dtype) -> None:
        self.feats = torch.empty(0, hidden, dtype=dtype)
        self.raw: list[torch.Tensor] = []
        self.raw_rows = 0
        self.end = 0


class DFlashProposer(Proposer):
    name = "dflash"
    resume_context = 8   # recent positions a restarted context needs before it drafts (module doc)

    def __init__(self, drafter: DFlashDrafter, embed_tokens: Any, lm_head: Any) -> None:
        """``embed_tokens`` / ``lm_head``: the target's (tensors, or its linear methods)."""
        self.drafter = drafter
        self.config = drafter.config
        self.capture_layers = frozenset(self.config.target_layers)
        self.layer_order = sorted(self.config.target_layers)
        self.embed_tokens = embed_tokens
        self.lm_head = lm_head
        self.dtype = next(drafter.parameters()).dtype
        self._ctx: dict[str, _Context] = {}
        # the held-out acceptance length L its training measured (block drafts, greedy) gives
        # adaptive k its starting estimate: L - 1 accepted drafts per step at a continuation rate
        # c of about 0.7 means a first-draft rate f of about (L - 1) * (1 - c)
        held_out = self.config.training.get("heldout_acceptance_after") if self.config.training else None
        if isinstance(held_out, (int, float)) and held_out >= 1.0:
            self.first_rate_prior = min(1.0, (float(held_out) - 1.0) * 0.3)

    @classmethod
    def load(cls, path: str, target: Any) -> DFlashProposer:
        args = target.args
        drafter = load_drafter(path, target_hidden_size=args.hidden_size, vocab_size=args.vocab_size,
                               target_num_layers=args.num_layers)
        if drafter.config.target_layers != sorted(drafter.config.target_layers):
            drafter.config.target_layers = sorted(drafter.config.target_layers)
        return cls(drafter, target.embed_tokens, target.lm_head)

    @torch.inference_mode()
    def observe(self, request: Request, start: int, hidden: torch.Tensor) -> None:
        st = self._ctx.get(request.request_id)
        if st is None:
            st = self._ctx[request.request_id] = _Context(self.config.hidden_size, self.dtype)
        window = self.config.context_window
        n = hidden.shape[0]
        if start != st.end:
            if st.end - st.feats.shape[0] - st.raw_rows <= start < st.end:
                # recomputed from a position inside the context (preemption): keep what precedes it
                self._fuse(st)
                begin = st.end - st.feats.shape[0]
                st.feats = st.feats[: start - begin] if begin <= start else st.feats[:0]
            else:   # a gap (capture was off) or before the context: start afresh
                st.feats, st.raw, st.raw_rows = st.feats[:0], [], 0
        if n > window:
            hidden = hidden[-window:]
        if hidden.untyped_storage().nbytes() > 4 * hidden.nbytes:   # a slice of a big step: keep a copy
            hidden = hidden.clone()
        st.raw.append(hidden)
        st.raw_rows += hidden.shape[0]
        while st.raw_rows - st.raw[0].shape[0] >= window:   # older raw rows fall out of the window
            st.raw_rows -= st.raw.pop(0).shape[0]
        if st.raw_rows >= window:
            st.feats = st.feats[:0]
        st.end = start + n

    def _fuse(self, st: _Context) -> None:
        if st.raw:
            fused = self.drafter.fuse(torch.cat(st.raw).to(self.dtype))
            st.feats = torch.cat([st.feats, fused])[-self.config.context_window:]
            st.raw, st.raw_rows = [], 0

    @torch.inference_mode()
    def propose(self, requests: Sequence[Request], num_tokens: Sequence[int]) -> list[Draft]:
        c = self.config
        rows: list[int] = []
        for i, req in enumerate(requests):
            st = self._ctx.get(req.request_id)
            # the context must end right before the last (verified, uncomputed) token, and hold
            # resume_context positions (fewer only when it reaches back to the first position)
            if num_tokens[i] > 0 and st is not None and st.end == req.num_tokens - 1:
                have = st.feats.shape[0] + st.raw_rows
                if have and have >= min(self.resume_context, st.end):
                    rows.append(i)
        drafts = [Draft([]) for _ in requests]
        if not rows:
            return drafts
        for i in rows:
            self._fuse(self._ctx[requests[i].request_id])
        w = max(self._ctx[requests[i].request_id].feats.shape[0] for i in rows)
        ctx = torch.zeros(len(rows), w, c.hidden_size, dtype=self.dtype)
        valid = torch.zeros(len(rows), w, dtype=torch.bool)
        for j, i in enumerate(rows):
            f = self._ctx[requests[i].request_id].feats
            ctx[j, w - f.shape[0]:] = f
            valid[j, w - f.shape[0]:] = True
        last = torch.tensor([requests[i].all_token_ids[-1] for i in rows])
        start = torch.tensor([requests[i].num_tokens - 1 for i in rows])
        emb = self.embed_tokens
        first = (emb[last] if isinstance(emb, torch.Tensor) else emb.embedding(last, self.dtype)).to(self.dtype)
        kmax = max(num_tokens[i] for i in rows)
        h = self.drafter(ctx, valid, first, start)[:, 1:1 + kmax]          # [R, k, hidden]
        head = self.lm_head
        if isinstance(head, torch.Tensor):
            logits = torch.matmul(h.to(head.dtype), head.t())
        else:   # the target's linear method (quantized or dense): its own matmul
            dt = getattr(head, "dtype", torch.float32)   # dense: its weight dtype; packed kernels: fp32 in
            logits = head(h.reshape(-1, h.shape[-1]).to(dt)).reshape(*h.shape[:-1], -1)
        best = row_argmax(logits).tolist()
        for j, i in enumerate(rows):
            drafts[i] = Draft(best[j][: num_tokens[i]])
        return drafts

    def request_finished(self, request: Request) -> None:
        self._ctx.pop(request.request_id, None)
