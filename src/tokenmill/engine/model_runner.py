"""The only engine module that touches torch: it owns the device, the weights, the KV pool and
the attention backend.

Construction (in order): move the model to the device, choose the attention backend for the
model's KV spec (:func:`~tokenmill.layers.attention.select_attention_backend`), let the backend
allocate the KV pool (``None`` for a hybrid model's linear-attention layers), allocate a hybrid
model's :class:`~tokenmill.layers.state_pool.StatePool` (``num_state_slots`` slots, the engine's
state-slot ids index it; ``ForwardBatch.state_slots`` names each sequence's slot), and make the
sampler's random stream on the device.

A hybrid model's verify rows keep their linear layers' state after every position; after
verification the slot is set to the state after the last accepted token (``StatePool.commit_verify``).

:meth:`ModelRunner.execute` turns a :class:`~tokenmill.engine.scheduler.SchedulerOutput` into a
:class:`~tokenmill.contracts.batch.ForwardBatch` (sequences concatenated in scheduling order),
builds the backend's per-step metadata once (:class:`~tokenmill.layers.attention.ForwardContext`),
runs the model, and samples one token for each request whose step reaches the end of its
tokens. Logits are computed only for those rows, except that a request carrying speculative
drafts gets logits for its last token and every draft (``k + 1`` rows), which
:func:`~tokenmill.layers.speculative.verify` checks; it then emits 1 to ``k + 1`` tokens.
When the engine sets ``capture_layers`` (a learned drafter's, on the steps where some request
may draft soon: ``SpeculativeDecoder.plan_capture``), the target's hidden states after those
layers come back with the step (:class:`StepResult`), at no extra pass. Requests that
ask for prompt logprobs also get their prompt rows (engine/prompt_logprobs.py). Rows of
constrained requests are masked by their grammar before sampling or verification; a draft row
with the grammar advanced through the drafts before it (engine/structured.py).
"""
from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any, Callable, NamedTuple

import torch

from tokenmill.engine.prompt_logprobs import PromptRows, plan_prompt_rows, record_prompt_logprobs
from tokenmill.engine.request import Request, TokenLogprob, TopLogprob
from tokenmill.engine.scheduler import SchedulerOutput
from tokenmill.contracts.batch import ForwardBatch
from tokenmill.contracts.kv import KVCacheSpec
from tokenmill.layers.attention import ForwardContext, select_attention_backend
from tokenmill.layers import fused
from tokenmill.layers.linear import select_linear_backend, use_linear_backend
from tokenmill.layers.quant import packed
from tokenmill.layers.quant.methods import packed_weights
from tokenmill.engine.structured import apply_grammar_masks
from tokenmill.layers.sampling import PenaltyState, Sampler, SamplingInputs
from tokenmill.layers.speculative import VerifyInputs, verify
from tokenmill.layers.state_pool import StatePool

if TYPE_CHECKING:
    from tokenmill.models.base import CausalLM


class SampledTokens(NamedTuple):
    """What one request got this step: 1 token, or accepted drafts plus one more."""

    request: Request
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None
    num_draft: int = 0       # drafts verified
    num_accepted: int = 0    # drafts accepted (the first ``num_accepted`` of ``token_ids``)
    num_chained: int = 0     # chained decode steps: the first ``num_chained`` tokens' K/V is written


class StepResult(NamedTuple):
    sampled: list[SampledTokens]
    # hidden states of ``capture_layers`` for every token of the step, [T, hidden] per layer
    captured: dict[int, torch.Tensor]
    query_start: list[int]   # row of each scheduled request's first token (scheduling order)


log = logging.getLogger(__name__)


def _token_logprob(tok: int, lp: Any) -> TokenLogprob:
    return TokenLogprob(tok, lp[0], [TopLogprob(t, v) for t, v in lp[1]])


def step_kind_rows(model: torch.nn.Module, fused: bool = True) -> int | None:
    """Rows up to which a step of ``model`` is a cheaper kind of step than the GEMM path above it
    (the step-cost model fits the two apart): the fused decode stack's row limit where the model
    has one, else the packed-weight integer kernels' (dequantize + GEMM above); None when
    neither applies. ``fused=False``: the model's forward never takes the fused stack (tensor
    parallel ranks run their own layer loop)."""
    stack_of = getattr(model, "fused_decode_stack", None) if fused and getattr(model, "fused_decode_enabled", True) else None
    stack = stack_of() if callable(stack_of) else None
    if stack is not None:
        return stack.max_rows()
    if packed_weights(model):
        return packed.gemv_max_rows()
    return None


def step_single_row_kind(model: torch.nn.Module) -> bool:
    """Whether a one-row step of ``model`` is a kind of its own for the step-cost model: packed
    int4/int8 weights, whose kernels run one row on paths of their own (``StepCost.single_row``)."""
    return packed_weights(model)


def step_row_group(model: torch.nn.Module) -> int:
    """Token rows per group of the integer kernels that run the packed matmuls of ``model`` (a
    step's cost rises in steps of them; ``packed.gemv_row_group``), 1 where it has none."""
    if packed_weights(model):
        return packed.gemv_row_group()
    return 1


class ModelRunner:
    def __init__(self, model: CausalLM, num_pages: int, page_size: int, vocab_size: int,
                 device: torch.device | str = "cpu", seed: int | None = None, *,
                 kv_spec: KVCacheSpec | None = None, attention_backend: str = "auto",
                 num_state_slots: int = 0, calibration_tokens: list[int] | None = None,
                 linear_backend: str = "auto", compile: bool = False) -> None:
        self.device = torch.device(device)
        self.model = model.to(self.device)
        # fp32 on CPU: weights reordered once for oneDNN (layers/linear.py); "torch" undoes it
        self.linear_backend = select_linear_backend(linear_backend, self.device, model.dtype)
        t0 = time.perf_counter()
        changed = use_linear_backend(self.model, self.linear_backend)
        if changed:
            log.info("linear backend %s: %d weight matrices repacked in %.2f s", self.linear_backend, changed,
                     time.perf_counter() - t0)
        # elementwise fusion (process-wide): the start-up compile is timed and logged
        args = model.args
        self.compile_seconds = fused.enable(compile, hidden_size=int(args.hidden_size),
                                            head_dim=int(getattr(args, "head_dim", 0) or 16), dtype=model.dtype)
        self.page_size = page_size
        self.vocab_size = vocab_size
        self.kv_spec = kv_spec or model.kv_cache_spec()
        self.attn = select_attention_backend(self.kv_spec, self.device, model.dtype, attention_backend)
        self.kv_caches = self.attn.allocate(num_pages, page_size)
        # Hybrid models: the linear layers' state, one slot per id of the engine's StateSlotPool.
        self.states: StatePool | None = None
        if self.kv_spec.is_hybrid:
            if num_state_slots <= 0:
                raise ValueError("a hybrid model needs num_state_slots > 0 (the engine's state-slot pool size)")
            self.states = StatePool(self.kv_spec, num_state_slots, self.device)
        if self.kv_spec.is_fp8 and not self.kv_spec.per_token_scales:
            self.calibrate_fp8_scales(calibration_tokens or [1])
        self.sampler = Sampler(seed, device=self.device)
        self.capture_layers: frozenset[int] = frozenset()   # set by a learned drafter
        self.compute_hook: Callable[[], None] | None = None   # set by a server (AsyncEngine)
        # int32 [1]: set from another thread, it ends a chain of decode steps after its current step
        self.chain_stop = torch.zeros(1, dtype=torch.int32)
        self.prompt_rows: list[PromptRows] = []

    def calibrate_fp8_scales(self, tokens: list[int]) -> None:
        """Static fp8 KV scales from one prefill of ``tokens`` into a scratch pool of the same
        layout (so the scales do not depend on the pool's size), copied into the pool's scales.
        Every tensor-parallel rank runs the same prefill, so the collectives line up and each
        rank calibrates its own KV heads."""
        from tokenmill.layers.attention.fp8 import calibrate_static_scales, static_scale_tensors

        batch = self.calibration_batch(tokens)
        scratch = self.attn.allocate(batch.block_tables.shape[1], self.page_size)
        attn = self.attn.calibration_backend()   # the torch reference's rule for a fresh prefill
        calibrate_static_scales(scratch, lambda: self.model(ForwardContext.prepare(attn, batch, scratch,
                                                                                   states=self.states)),
                                self.attn.fp8_scale_segments)
        if self.states is not None:   # the calibration prefill ran in state slot 0
            self.states.zero(0)
        for dst, src in zip(static_scale_tensors(self.kv_caches), static_scale_tensors(scratch)):
            dst.copy_(src)

    def calibration_batch(self, tokens: list[int]) -> ForwardBatch:
        """One fresh prefill of ``tokens`` on pages 0, 1, ..."""
        n = len(tokens)
        dev = self.device
        pos = torch.arange(n, dtype=torch.long, device=dev)
        pages = (n + self.page_size - 1) // self.page_size
        return ForwardBatch(input_ids=torch.tensor(tokens, dtype=torch.long, device=dev), positions=pos,
                            slot_mapping=pos, query_start_loc=torch.tensor([0, n], dtype=torch.long, device=dev),
                            seq_lens=torch.tensor([n], dtype=torch.long, device=dev),
                            block_tables=torch.arange(pages, dtype=torch.long, device=dev)[None, :],
                            logits_indices=torch.tensor([n - 1], dtype=torch.long, device=dev),
                            page_size=self.page_size, max_seq_len=n,
                            state_slots=None if self.states is None else torch.zeros(1, dtype=torch.long, device=dev))

    @torch.inference_mode()
    def time_rows(self, num_rows: int, context: int = 128, repeats: int = 2) -> float:
        """Seconds of one forward of a single sequence with ``num_rows`` new tokens after
        ``context`` cached ones, logits for every row (a verify step's shape), on a scratch KV
        pool: the best of ``repeats`` after one unmeasured run. Not for hybrid models (their
        state slots would advance)."""
        n = num_rows
        dev = self.device
        pages = (context + n + self.page_size - 1) // self.page_size
        scratch = self.attn.allocate(pages, self.page_size)
        pos = torch.arange(context, context + n, dtype=torch.long, device=dev)
        batch = ForwardBatch(input_ids=torch.ones(n, dtype=torch.long, device=dev), positions=pos,
                             slot_mapping=pos, query_start_loc=torch.tensor([0, n], dtype=torch.long, device=dev),
                             seq_lens=torch.tensor([context + n], dtype=torch.long, device=dev),
                             block_tables=torch.arange(pages, dtype=torch.long, device=dev)[None, :],
                             logits_indices=torch.arange(n, dtype=torch.long, device=dev),
                             page_size=self.page_size, max_seq_len=context + n)
        best = float("inf")
        sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
        for i in range(repeats + 1):
            sync()
            t0 = time.perf_counter()
            self.model(ForwardContext.prepare(self.attn, batch, scratch))
            sync()
            if i:
                best = min(best, time.perf_counter() - t0)
        return best

    def make_generator(self, seed: int | None) -> torch.Generator | None:
        """A request's own random stream (seeded requests only; others share the sampler's)."""
        if seed is None:
            return None
        g = torch.Generator(device=self.device)
        g.manual_seed(seed)
        return g

    def _penalty_state(self, req: Request) -> PenaltyState | None:
        """The request's incremental penalty counts (made on first use; O(1) per token after)."""
        if not req.params.uses_penalties:
            return None
        st = req.penalty_state
        if st is None or st.num_output != req.num_output_tokens:
            st = req.penalty_state = PenaltyState(self.vocab_size, req.prompt_token_ids, req.output_token_ids,
                                                  self.device)
        return st

    def build_batch(self, out: SchedulerOutput) -> tuple[ForwardBatch, list[Request]]:
        """The step's ForwardBatch, and the requests that sample (in logits-row order).

        A request with drafts contributes its uncomputed token then the drafts, and ``k + 1``
        logits rows. Logit rows: those of the sampling requests first, then the prompt-logprob rows of
        ``self.prompt_rows`` (set here for :meth:`execute`).
        """
        ps = self.page_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        q_start = [0]
        seq_lens: list[int] = []
        tables: list[list[int]] = []
        logit_rows: list[int] = []
        samplers: list[Request] = []
        for s in out.scheduled:
            req, start, n = s.request, s.start, s.num_tokens
            end = start + n
            table = req.page_table
            if n == 1:
                input_ids.append(req.all_token_ids[start])
                positions.append(start)
                slots.append(table[start // ps] * ps + start % ps)
            else:
                input_ids.extend(req.all_token_ids[start:end - s.num_draft])
                if s.num_draft:
                    input_ids.extend(s.draft_token_ids)
                positions.extend(range(start, end))
                slots.extend([table[p // ps] * ps + p % ps for p in range(start, end)])
            q_start.append(q_start[-1] + n)
            seq_lens.append(end)
            tables.append(table)
            if s.samples:
                logit_rows.extend(range(q_start[-1] - 1 - s.num_draft, q_start[-1]))
                samplers.append(req)
        extra_rows, self.prompt_rows = plan_prompt_rows(out.scheduled, q_start)
        logit_rows.extend(extra_rows)
        # The step's integers go into one tensor and each field is a view of it: one allocation
        # (and, on a device, one copy) instead of seven tensors, and no indexing ops for the
        # slots. A decode step was spending a quarter of a millisecond here with those.
        width = max(len(t) for t in tables)
        flat = input_ids + positions + slots + q_start + seq_lens + logit_rows
        for t in tables:
            flat.extend(t)
            flat.extend([0] * (width - len(t)))
        ints = torch.tensor(flat, dtype=torch.long)
        if self.device.type != "cpu":
            ints = ints.to(self.device)
        t_rows, n_seq = len(input_ids), len(seq_lens)
        ids_t, pos_t, slots_t, q_start_t, seq_lens_t, logits_t, tables_t = ints.split(
            [t_rows, t_rows, t_rows, n_seq + 1, n_seq, len(logit_rows), n_seq * width])   # one op, seven views
        block_tables = tables_t.view(n_seq, width)
        state_slots = None
        if self.states is not None:
            state_slots = torch.tensor([s.request.state_slot for s in out.scheduled], dtype=torch.long,
                                       device=self.device)
        batch = ForwardBatch(
            input_ids=ids_t,
            positions=pos_t,
            slot_mapping=slots_t,
            query_start_loc=q_start_t,
            seq_lens=seq_lens_t,
            block_tables=block_tables,
            logits_indices=logits_t,
            page_size=ps,
            max_seq_len=max(seq_lens),
            state_slots=state_slots,
        )
        return batch, samplers

    def chains_decode_steps(self, rows: int) -> bool:
        """Whether :meth:`execute` can chain greedy decode steps for a decode batch of ``rows``
        sequences (``decode_steps``): the model's native path can, and nothing this runner
        does per step (hidden-state capture, recurrent states) would be skipped by it."""
        return (self.states is None and not self.capture_layers
                and self.model.chains_decode_steps(rows, self.attn, self.kv_caches))

    def forward(self, batch: ForwardBatch, capture_layers: frozenset[int] = frozenset(),
                decode_steps: int = 1) -> ForwardContext:
        """Run the model over ``batch``; the context holds the logits' inputs and any captures.
        ``compute_hook`` (when set) runs once as the computation starts: inside the model where
        it calls ``ForwardContext.compute_starts`` (``calls_compute_hook``), else before it."""
        ctx = ForwardContext.prepare(self.attn, batch, self.kv_caches, capture_layers, self.states)
        ctx.decode_steps = decode_steps
        ctx.chain_stop = self.chain_stop
        ctx.on_compute = self.compute_hook
        if not getattr(self.model, "calls_compute_hook", False):
            ctx.compute_starts()
        ctx.logits = self.model(ctx)
        ctx.compute_starts()   # a model path that did not reach it
        return ctx

    def restore_states(self, out: SchedulerOutput) -> None:
        """Hybrid models: copy each prefix hit's state snapshot into its request's slot, before
        the request's first step (``req.snapshot_restore``; the KV manager unlocks it after)."""
        if self.states is None:
            return
        for s in out.scheduled:
            snap = s.request.snapshot_restore
            if snap is not None:
                self.states.copy(snap, s.request.state_slot)

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput, decode_steps: int = 1) -> StepResult:
        """Run the step. ``decode_steps > 1`` (only where :meth:`chains_decode_steps` allowed
        it, for a batch of greedy decodes whose pages reach ``decode_steps - 1`` tokens past
        their ends): that many greedy steps in one forward; each request gets ``decode_steps``
        tokens, the first ``decode_steps - 1`` with their K/V written (``num_chained``); fewer
        when ``chain_stop`` (an int32 ``[1]`` flag, set by the engine from another thread when
        work arrives) ends the chain early."""
        if decode_steps > 1:
            return self._execute_chained(out, decode_steps)
        self.restore_states(out)
        batch, samplers = self.build_batch(out)
        if self.states is not None:   # linear layers keep per-position states for verify rows
            rows = [i for i, s in enumerate(out.scheduled) if s.num_draft]
            self.states.begin_verify(rows, [out.scheduled[i].request.state_slot for i in rows],
                                     [out.scheduled[i].num_tokens for i in rows])
        ctx = self.forward(batch, self.capture_layers)
        logits = ctx.logits
        q_start = batch.query_start_loc.tolist() if ctx.captured else []
        if logits is None:  # a tensor-parallel rank other than 0: rank 0 samples
            return StepResult([], ctx.captured, q_start)
        n_rows = sum(1 + s.num_draft for s in out.scheduled if s.samples)   # sampling rows first
        argmax = ctx.logits_argmax
        if self.prompt_rows:
            record_prompt_logprobs(logits[n_rows:], self.prompt_rows)
            logits = logits[:n_rows]
            argmax = argmax[:n_rows] if argmax is not None else None
        if not samplers:
            return StepResult([], ctx.captured, q_start)
        if any(r.grammar is not None for r in samplers):   # masks change the logits: argmax no longer holds
            argmax = None
        drafts = {s.request: s for s in out.scheduled if s.num_draft}
        if drafts:
            sampled = self._verify(logits, samplers, drafts, argmax)
            self._commit_states(out, sampled)
            return StepResult(sampled, ctx.captured, q_start)
        logits = apply_grammar_masks(logits, samplers)
        states = [self._penalty_state(r) for r in samplers]
        inputs = SamplingInputs(
            params=[r.params for r in samplers],
            prompt_token_ids=[r.prompt_token_ids for r in samplers],
            output_token_ids=[r.output_token_ids if r.params.uses_penalties else () for r in samplers],
            generators=[r.generator for r in samplers],
            penalty_states=states,
        )
        result = self.sampler(logits, inputs, argmax)
        for st, tok in zip(states, result.token_ids):
            if st is not None:
                st.add(tok)
        sampled = []
        for req, tok, lp in zip(samplers, result.token_ids, result.logprobs):
            logprobs = [_token_logprob(tok, lp)] if lp is not None else None
            sampled.append(SampledTokens(req, [tok], logprobs))
        return StepResult(sampled, ctx.captured, q_start)

    def _execute_chained(self, out: SchedulerOutput, steps: int) -> StepResult:
        batch, samplers = self.build_batch(out)
        ps = self.page_size
        for s in out.scheduled:   # the engine allocated the chain's pages; a gap would write into page 0
            if len(s.request.page_table) * ps < s.start + steps:
                raise RuntimeError(f"request {s.request.request_id}: {len(s.request.page_table)} pages for a chain "
                                   f"of {steps} steps from position {s.start}")
        ctx = self.forward(batch, frozenset(), steps)
        if ctx.step_tokens is None:
            raise RuntimeError(f"the model did not chain the {steps} decode steps it said it could")
        columns = ctx.step_tokens.t().tolist()
        sampled = [SampledTokens(req, col, None, num_chained=len(col) - 1) for req, col in zip(samplers, columns)]
        return StepResult(sampled, {}, [])

    def _commit_states(self, out: SchedulerOutput, sampled: list[SampledTokens]) -> None:
        """Hybrid models: roll each verified request's state slot back to its last accepted
        token (its step's real tokens plus the accepted drafts; rejected drafts leave no trace)."""
        if self.states is None or self.states.verify_rows is None:
            return
        accepted = {s.request: s.num_accepted for s in sampled}
        self.states.commit_verify([s.num_tokens - s.num_draft + accepted[s.request]
                                   for s in out.scheduled if s.num_draft])

    def _verify(self, logits: torch.Tensor, samplers: list[Request], drafts: dict,
                argmax: torch.Tensor | None = None) -> list[SampledTokens]:
        draft_ids = [drafts[r].draft_token_ids if r in drafts else () for r in samplers]
        # row j of a constrained request: the mask of its grammar advanced through drafts[:j]
        logits = apply_grammar_masks(logits, samplers, draft_ids)
        probs = []
        for r, d in zip(samplers, draft_ids):
            q = r.spec_probs if d else None
            probs.append(q[: len(d)] if q is not None else None)
        inputs = VerifyInputs(
            params=[r.params for r in samplers],
            prompt_token_ids=[r.prompt_token_ids for r in samplers],
            output_token_ids=[r.output_token_ids if r.params.uses_penalties else () for r in samplers],
            generators=[r.generator for r in samplers],
            draft_token_ids=draft_ids,
            draft_probs=probs,
        )
        sampled = []
        for req, d, res in zip(samplers, draft_ids, verify(self.sampler, logits, inputs, argmax)):
            st = self._penalty_state(req)
            if st is not None:
                for tok in res.token_ids:
                    st.add(tok)
            lps = None
            if res.logprobs is not None:
                lps = [_token_logprob(t, lp) for t, lp in zip(res.token_ids, res.logprobs)]
            sampled.append(SampledTokens(req, res.token_ids, lps, len(d), res.num_accepted))
        return sampled
