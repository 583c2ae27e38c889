"""The engine loop: one model replica, single-threaded.

``Engine.step()`` = schedule -> forward + sample (ModelRunner) -> count computed tokens ->
append each sampled token, check stop conditions, detokenize -> RequestOutputs; with
speculative decoding, a step may append several tokens per request (accepted drafts, then one
more), stopping at the first that ends the request, and then
:class:`~tokenmill.engine.spec.SpeculativeDecoder` rolls back rejected drafts and proposes
the next ones.
:class:`~tokenmill.engine.async_engine.AsyncEngine` drives it from a background thread; the
offline :class:`~tokenmill.engine.llm.LLM` drives it in a loop.

Constructor steps (in order): load the model, size the KV pool, build the page pool and prefix
cache, the scheduler, the model runner, and the speculative decoder (when configured).
"""
from __future__ import annotations

import logging
import operator
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from tokenmill.cache.page_pool import PagePool
from tokenmill.cache.state_slots import StateSlotPool
from tokenmill.engine import admission
from tokenmill.engine.config import (DEFAULT_SNAPSHOT_MEMORY_CAP_GIB, DEFAULT_SNAPSHOTS_PER_REQUEST, EngineConfig,
                                     default_kv_cache_tokens, resolve_kv_dtype)
from tokenmill.engine.detokenizer import IncrementalDetokenizer
from tokenmill.engine.kv_manager import KVManager
from tokenmill.engine.model_runner import (ModelRunner, SampledTokens, step_kind_rows, step_row_group,
                                           step_single_row_kind)
from tokenmill.engine.parallel import ParallelRunner, WorkerSpec, check_tensor_parallel_devices, new_init_method
from tokenmill.engine.request import ListView, Request, RequestOutput, RequestStatus
from tokenmill.contracts.kv import KVCacheSpec, PagedKV
from tokenmill.contracts.sampling import SamplingParams
from tokenmill.engine.scheduler import Scheduler, SchedulerOutput
from tokenmill.engine.step_cost import PACKED_HOLD_BELOW, PACKED_LONE_SLOWDOWN, StepCost, StepTimes, step_kind
from tokenmill.engine.structured import GrammarCompiler, GrammarWaitRoom

if TYPE_CHECKING:
    from tokenmill.engine.spec.base import SpecStats
    from tokenmill.loader import LoadedModel

log = logging.getLogger(__name__)

# Chained greedy decode steps (EngineConfig.num_continuous_decode_steps) run for at most about this
# long, at the decode step time measured for the batch size (a caller that queues new work, as
# AsyncEngine does, ends a chain after its current step: interrupt_chain).
CHAIN_BUDGET_S = 0.03


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    kv_pages_total: int
    kv_pages_free: int
    kv_cache_usage: float          # share of pages pinned by requests (evictable cache = free)
    prompt_tokens_total: int
    cached_tokens_total: int
    generation_tokens_total: int
    num_preemptions: int = 0
    kv_pages_cached: int = 0
    spec: SpecStats | None = None     # speculative decoding counters (None: off)
    kv_pages_in_use: int = 0       # pages owned by requests alone (not in the prefix cache)
    kv_cache_dtype: str = ""         # storage dtype of the pool (float32, bfloat16, float8_e4m3fn, ...)
    kv_bytes_per_token: int = 0      # KVCacheSpec.bytes_per_token(), per-token fp8 scales included
    kv_cache_fp8_scales: str = ""    # fp8 pools: "static" or "token" (KVCacheSpec.fp8_scales); else ""
    kv_capacity_tokens: int = 0      # pages x page size (per rank with tensor parallelism: each rank
                                     # holds its KV heads' share of every token)
    tiers: Any = None               # cache.tiers.TierStats when lower tiers are configured
    tensor_parallel_size: int = 1
    # hybrid models' state pool (all 0 for attention-only models): request slots, those free,
    # the share held by running requests, snapshot slots, and the bytes of one slot
    state_slots_total: int = 0
    state_slots_free: int = 0
    state_pool_usage: float = 0.0
    state_snapshot_slots: int = 0
    state_snapshots_cached: int = 0    # snapshot slots holding a snapshot of the prefix cache
    state_bytes_per_request: int = 0
    predicted_wait_s: float = 0.0    # how long a request queued now would wait to start (admission.py)
    # step wall time by kind: kind -> (cumulative counts per STEP_SECONDS_BUCKETS bound, sum, count)
    step_seconds: dict[str, tuple[list[int], float, int]] | None = None
    decode_chains_total: int = 0         # chains of decode steps (num_continuous_decode_steps) run
    decode_chain_steps_total: int = 0    # decode steps run inside them

    @property
    def cache_hit_rate(self) -> float:
        return self.cached_tokens_total / self.prompt_tokens_total if self.prompt_tokens_total else 0.0


class Engine:
    def __init__(self, config: EngineConfig, *, loaded: LoadedModel | None = None) -> None:
        """Build an engine for ``config``; pass ``loaded`` to reuse an already loaded model."""
        self.config = config
        if config.num_threads is not None:
            torch.set_num_threads(config.num_threads)
        self._init_device()
        self._init_model(loaded)
        self._init_kv()
        self.step_cost = (StepCost(config.decode_slowdown, finish_slowdown=config.prefill_finish_slowdown,
                                   lone_slowdown=config.decode_slowdown_lone or None,
                                   hold_below=config.prefill_hold_below or 0, hold_steps=config.prefill_hold_steps)
                          if config.decode_slowdown else None)
        self.step_times = StepTimes()   # wall time of steps by kind (decode, mixed, prefill)
        self._decode_step_s: dict[int, float] = {}   # decode-only step seconds by rows (chain lengths)
        self.decode_chains_total = 0
        self.decode_chain_steps_total = 0
        self.scheduler = Scheduler(self.kv, max_batch_tokens=config.max_batch_tokens,
                                   max_running_requests=config.max_running_requests,
                                   step_cost=self.step_cost)
        self.scheduler.prefill_stagger_tokens = config.prefill_stagger_tokens
        self.runner: ModelRunner | ParallelRunner
        if config.tensor_parallel_size > 1:
            self.runner = ParallelRunner(WorkerSpec(
                model=str(self.loaded.source) if loaded is not None else config.model, dtype=config.dtype,
                tp=config.tensor_parallel_size, num_pages=self.kv.num_pages, page_size=config.page_size,
                device=self.device.type, kv_dtype=self.kv_spec.dtype, attention_backend=config.attention_backend,
                num_threads=config.num_threads, pin_cores=config.tp_pin_cores, init_method=new_init_method(),
                moe_parallel=config.moe_parallel, kv_fp8_scales=self.kv_spec.fp8_scales,
                calibration_tokens=self._calibration_tokens(),
                linear_backend=config.linear_backend, compile=config.compile),
                self.loaded.model)
            try:
                self._init_tiers()
            except BaseException:
                self.runner.close()
                raise
        else:
            slots = self.kv.slots
            self.runner = ModelRunner(self.loaded.model, self.kv.num_pages, config.page_size,
                                      self.vocab_size, device=self.device, kv_spec=self.kv_spec,
                                      attention_backend=config.attention_backend,
                                      num_state_slots=slots.num_slots if slots is not None else 0,
                                      calibration_tokens=self._calibration_tokens(),
                                      linear_backend=config.linear_backend, compile=config.compile)
            if self.runner.states is not None:   # snapshots are taken by copying a request's slot
                self.kv.copy_state = self.runner.states.copy
            self._init_tiers()
        fused = config.fused_decode and config.tensor_parallel_size == 1
        if self.step_cost is not None:   # fused / packed steps: small steps are a cheaper kind
            self.step_cost.split_rows = step_kind_rows(self.loaded.model, fused=fused)
            self.step_cost.row_group = step_row_group(self.loaded.model)
            self.step_cost.single_row = step_single_row_kind(self.loaded.model)
            if self.step_cost.single_row:   # packed weights: rows past the first cost much of a step
                if config.decode_slowdown_lone is None:
                    self.step_cost.lone_slowdown = PACKED_LONE_SLOWDOWN
                if config.prefill_hold_below is None:
                    self.step_cost.hold_below = PACKED_HOLD_BELOW
        self.generation_tokens_total = 0
        self._arrivals = 0
        self._num_timed = 0   # requests added with a deadline (expiry is skipped while there are none)
        self.start_estimator = admission.StartEstimator()   # predicted queue wait (engine/admission.py)
        self._grammar_compiler: GrammarCompiler | None = None
        self._grammar_lock = threading.Lock()
        self._compiling = GrammarWaitRoom()
        self._init_speculative()

    # -- construction ----------------------------------------------------------------------------
    def _init_device(self) -> None:
        device = torch.device(self.config.device)
        if device.type == "cuda":
            if not torch.cuda.is_available():
                raise ValueError(f"device {self.config.device!r} was asked for, but this torch build "
                                 f"({torch.__version__}) sees no CUDA device")
            if device.index is not None and device.index >= torch.cuda.device_count():
                raise ValueError(f"device {self.config.device!r} does not exist: "
                                 f"{torch.cuda.device_count()} CUDA device(s) visible")
        self.device = device

    def _init_model(self, loaded: LoadedModel | None) -> None:
        dtype = getattr(torch, self.config.dtype)
        if loaded is None:
            from tokenmill.loader import load_model

            from tokenmill.layers.quant.methods import QuantConfig

            cfg = self.config
            loaded = load_model(cfg.model, dtype=dtype, quantization=QuantConfig(
                cfg.quantization, cfg.quant_group_size, cfg.quant_symmetric))
        self.loaded = loaded
        if hasattr(loaded.model, "set_fused_decode"):   # off: the stack is never built (no second
            loaded.model.set_fused_decode(self.config.fused_decode)   # copy of fp32 weights)
        self.tokenizer = loaded.tokenizer
        self.model_name = loaded.name
        self.eos_token_ids = frozenset(loaded.eos_token_ids)
        self.vocab_size = int(loaded.model.args.vocab_size)
        limit = self.config.max_model_len
        if limit is not None and limit > loaded.max_model_len:
            raise ValueError(f"max_model_len={limit} exceeds the model's context length "
                             f"{loaded.max_model_len}")
        self.max_model_len = limit or loaded.max_model_len

    def _rank_kv_spec(self) -> KVCacheSpec:
        """What one rank stores per token: the whole model's spec, or one tensor-parallel shard's."""
        model, tp = self.loaded.model, self.config.tensor_parallel_size
        if tp == 1:
            return model.kv_cache_spec()
        from tokenmill.models.tensor_parallel import rank_kv_cache_spec

        check_tensor_parallel_devices(tp, self.config.device)
        return rank_kv_cache_spec(model, tp, self.config.moe_parallel)

    def _check_hybrid(self) -> None:
        """Refuse, at start-up, the features a hybrid model's state pool does not support yet."""
        cfg = self.config
        if not self.loaded.model.kv_cache_spec().is_hybrid:
            return
        arch = type(self.loaded.model).__name__
        if cfg.tensor_parallel_size > 1:
            raise ValueError(f"--tensor-parallel-size {cfg.tensor_parallel_size} is not supported with the hybrid "
                             f"model {arch} (its linear-attention layers are not sharded); use "
                             f"--tensor-parallel-size 1")

    def _init_kv(self) -> None:
        cfg = self.config
        self._check_hybrid()
        spec = self._rank_kv_spec()
        from tokenmill.layers.quant.methods import packed_weights

        packed = (not spec.is_hybrid and all(isinstance(layer, PagedKV) for layer in spec.layers)
                  and packed_weights(self.loaded.model))
        spec = spec.with_dtype(resolve_kv_dtype(cfg.kv_cache_dtype, spec.dtype, packed)).with_fp8_scales(
            cfg.kv_cache_fp8_scales)
        self.kv_spec = spec
        self._kv_bytes_per_token = spec.bytes_per_token()   # stats() runs every step: a sum over layers
        bytes_per_token = spec.bytes_per_token()
        ps = cfg.page_size
        if cfg.kv_cache_tokens is not None:
            tokens = cfg.kv_cache_tokens // ps * ps
        elif cfg.kv_cache_memory_gib is not None:
            tokens = spec.capacity_tokens(cfg.kv_cache_memory_gib * 2**30, ps)
            if tokens < ps:
                raise ValueError(
                    f"--kv-cache-memory {cfg.kv_cache_memory_gib:g} GiB is too small for one request: at "
                    f"{bytes_per_token} B/token ({spec.dtype}) it holds {tokens} tokens, less than one page of "
                    f"{ps}; give at least {ps * bytes_per_token / 2**30:.6f} GiB")
        else:
            import psutil

            tokens = default_kv_cache_tokens(self.max_model_len, bytes_per_token,
                                             psutil.virtual_memory().available) // ps * ps
        num_pages = tokens // ps
        if num_pages < 1:
            raise ValueError(f"the KV cache holds {tokens} tokens, less than one page of {ps}: too small for "
                             f"one request")
        pool = PagePool(num_pages)
        slots = self._state_slots(spec)
        cache = None
        if cfg.enable_prefix_cache:
            from tokenmill.cache.radix import RadixCache

            # A hybrid model's cache keeps state snapshots in the snapshot slots (matches end there).
            cache = RadixCache(pool, cfg.page_size, session_retention_s=cfg.session_retention_s,
                               snapshot_slots=slots)
        interval = -(-cfg.state_snapshot_interval // ps) * ps
        self.kv = KVManager(pool, cfg.page_size, cache, slots=slots, snapshot_interval=interval)
        self.kv_capacity_tokens = num_pages * ps
        fp32 = spec.with_dtype("float32").bytes_per_token()
        tp = cfg.tensor_parallel_size
        scales = f" ({spec.fp8_scales} scales)" if spec.is_fp8 else ""
        log.info("KV cache%s: %s%s, %d B/token (%.2fx the tokens of fp32 at equal memory), %d pages of %d tokens "
                 "= %d tokens (%.4f GiB)", f" per rank (tp={tp})" if tp > 1 else "", spec.dtype, scales,
                 bytes_per_token, fp32 / bytes_per_token, num_pages, ps,
                 self.kv_capacity_tokens, self.kv_capacity_tokens * bytes_per_token / 2**30)

    def _calibration_tokens(self) -> list[int] | None:
        """The prompt the runner calibrates static fp8 KV scales with (None: nothing to calibrate)."""
        if not (self.kv_spec.is_fp8 and not self.kv_spec.per_token_scales):
            return None
        from tokenmill.engine.kv_calibration import calibration_tokens

        return calibration_tokens(self.tokenizer, self.vocab_size, min(self.max_model_len, 512))

    def _state_slots(self, spec: KVCacheSpec) -> StateSlotPool | None:
        """A hybrid model's state-slot allocator: one request slot per running request, plus the
        snapshot slots of the prefix cache (``state_snapshot_slots``, or as many as
        ``state_snapshot_memory_gib`` buys; by default a few per request slot, capped in memory)."""
        if not spec.is_hybrid:
            return None
        cfg = self.config
        per = spec.bytes_per_request()
        if not cfg.enable_prefix_cache:
            snapshots = 0
        elif cfg.state_snapshot_slots is not None:
            snapshots = cfg.state_snapshot_slots
        elif cfg.state_snapshot_memory_gib is not None:
            snapshots = int(cfg.state_snapshot_memory_gib * 2**30 // per)
        else:
            snapshots = min(DEFAULT_SNAPSHOTS_PER_REQUEST * cfg.max_running_requests,
                            int(DEFAULT_SNAPSHOT_MEMORY_CAP_GIB * 2**30 // per))
        slots = StateSlotPool(cfg.max_running_requests, snapshots)
        log.info("state pool: %d linear-attention layers, %d B/request (fp32 recurrent + conv state), "
                 "%d request slots (--max-running-requests) + %d snapshot slots = %d slots (%.4f GiB; "
                 "snapshots %.4f GiB, every %d prefill tokens)",
                 len(spec.linear_layer_ids()), per, slots.num_request_slots, snapshots, slots.num_slots,
                 slots.num_slots * per / 2**30, snapshots * per / 2**30,
                 -(-cfg.state_snapshot_interval // cfg.page_size) * cfg.page_size)
        return slots

    def _init_tiers(self) -> None:
        from tokenmill.engine.kv_tiers import build_tiers

        self.tiers = build_tiers(self.config, self.runner, self.kv, self.model_name, self.kv_spec,
                                 self.loaded.model)
        self.kv.tiers = self.tiers

    def _init_speculative(self) -> None:
        cfg = self.config
        self.spec = None
        if cfg.speculative_method is None:
            return
        from tokenmill.engine.spec import SpeculativeDecoder, make_proposer

        proposer = make_proposer(cfg, self.loaded.model)
        special = getattr(self.tokenizer, "all_special_ids", None) or ()
        proposer.control_token_ids = frozenset(self.eos_token_ids) | frozenset(int(t) for t in special)
        self.spec = SpeculativeDecoder(proposer, self.scheduler,
                                       num_speculative_tokens=cfg.num_speculative_tokens,
                                       max_model_len=self.max_model_len,
                                       adaptive=cfg.speculative_adaptive,
                                       gate=cfg.speculative_gate,
                                       max_draft_tokens=cfg.speculative_max_draft_tokens,
                                       # with tensor parallelism rank 0 gets one grammar-mask row per
                                       # request (engine/parallel.py), so constrained requests do not draft
                                       constrained=cfg.tensor_parallel_size == 1)
        if cfg.speculative_adaptive and isinstance(self.runner, ModelRunner) and self.runner.states is None:
            # adaptive k weighs rows by measured step times: measure verify steps once now, so
            # the first requests do not pay for learning them
            self.spec.calibrate(self.runner.time_rows)
        log.info("speculative decoding: %s, up to %d draft tokens per step", proposer.name,
                 cfg.num_speculative_tokens)

    # -- requests --------------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    session_id: str | None = None, *, deadline: float | None = None,
                    queue_deadline: float | None = None, streamed: bool = True) -> None:
        """Queue a request; raise ValueError if it is malformed or can never fit, and
        :class:`~tokenmill.engine.admission.QueueFullError` when the waiting queue is full.

        ``deadline`` / ``queue_deadline``: ``time.monotonic()`` times by which the request must
        finish / be first admitted (see engine/admission.py). ``streamed``: the client sees
        tokens as they come, so the request's decodes keep the prefill bound (``decode_slowdown``);
        False for a response delivered whole (the step is then left to throughput)."""
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be SamplingParams, got {type(params).__name__}")
        try:
            ids = [operator.index(t) for t in prompt_token_ids]
        except TypeError as e:
            raise ValueError(f"prompt token ids must be integers: {e}") from None
        if not ids:
            raise ValueError("the prompt is empty: give at least one token")
        if min(ids) < 0 or max(ids) >= self.vocab_size:
            bad = next(t for t in ids if not 0 <= t < self.vocab_size)
            raise ValueError(f"prompt token id {bad} is not in the vocabulary [0, {self.vocab_size})")
        total = len(ids) + params.max_tokens
        if total > self.max_model_len:
            raise ValueError(f"prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) = {total} "
                             f"exceeds the maximum context length {self.max_model_len}")
        if total > self.kv.capacity_tokens:
            raise ValueError(f"prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) = {total} "
                             f"exceeds the KV cache capacity of {self.kv.capacity_tokens} tokens")
        if self.scheduler.get(request_id) is not None or request_id in self._compiling:
            raise ValueError(f"request id {request_id!r} is already in use")
        admission.check_queue(self.scheduler, self.config.max_waiting_requests)
        admission.check_predicted_wait(self.scheduler, self.start_estimator, time.monotonic(), queue_deadline)
        req = Request(request_id, ids, params, session_id=session_id, arrival_index=self._arrivals,
                      deadline=deadline, queue_deadline=queue_deadline, streamed=bool(streamed))
        if deadline is not None or queue_deadline is not None:
            self._num_timed += 1
        self._arrivals += 1
        req.generator = self.runner.make_generator(params.seed)
        req.detokenizer = IncrementalDetokenizer(self.tokenizer, ids, params.stop)
        if params.structured is not None:
            future = self.grammar_compiler.compile(params.structured)
            if not future.done():  # compiles off this thread; the request waits outside the batch
                self._compiling.add(req, future)
                return
            if future.exception() is not None:
                raise ValueError(str(future.exception()))
            req.grammar = self.grammar_compiler.matcher(future.result())
        self.scheduler.add_request(req)
        if self.tiers is not None:
            self.tiers.on_arrival(req)

    @property
    def grammar_compiler(self) -> GrammarCompiler:
        """The structured-output grammar compiler (created on first use; thread-safe)."""
        with self._grammar_lock:
            if self._grammar_compiler is None:
                self._grammar_compiler = GrammarCompiler(self.tokenizer, self.vocab_size, sorted(self.eos_token_ids))
            return self._grammar_compiler

    def abort_request(self, request_id: str) -> None:
        """Stop a request and free its pages; unknown or finished ids are ignored."""
        self._compiling.remove(request_id)
        req = self.scheduler.abort(request_id)
        if req is not None and self.spec is not None:
            self.spec.request_finished(req)
        self._maybe_check_idle()

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or len(self._compiling) > 0

    # -- the loop --------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one scheduling step; return outputs of the requests that produced a token."""
        expired: list[RequestOutput] = []
        if self._num_timed:
            expired = [self._output(r, num_new=0) for r in admission.expire(self.scheduler, time.monotonic())]
            if not any(r.deadline is not None or r.queue_deadline is not None
                       for r in self.scheduler.requests.values()):
                self._num_timed = 0
        failed = self._take_compiled() if len(self._compiling) else []
        out = self.scheduler.schedule()
        if out.is_empty:
            if len(self._compiling) and not failed:
                self._compiling.wait(0.05)
            self._maybe_check_idle()
            return expired + failed
        if self.spec is not None:   # a learned drafter's hidden states, for the requests that may draft soon
            self.runner.capture_layers = self.spec.plan_capture(out)
        steps = self._decode_steps(out) if self.config.num_continuous_decode_steps > 1 else 1
        t0 = time.perf_counter()
        result = self.runner.execute(out) if steps == 1 else self.runner.execute(out, decode_steps=steps)
        if steps > 1 and result.sampled:   # the steps that ran (interrupt_chain may end a chain early)
            steps = len(result.sampled[0].token_ids)
            self.decode_chains_total += 1
            self.decode_chain_steps_total += steps
        seconds = (time.perf_counter() - t0) / steps   # the step-time models learn one step's time
        kind = step_kind(out.scheduled)
        self.step_times.observe(kind, seconds)
        if kind == "decode" and self.config.num_continuous_decode_steps > 1:
            rows = len(out.scheduled)
            last = self._decode_step_s.get(rows)
            self._decode_step_s[rows] = seconds if last is None else last + 0.3 * (seconds - last)
        if self.step_cost is not None:
            self.step_cost.observe_step(out.scheduled, seconds)
        if self.spec is not None:
            self.spec.observe_step(out, seconds)
        self.scheduler.post_step(out)
        outputs = failed + [self._process_sampled(s) for s in result.sampled]
        if self.spec is not None:
            self.spec.after_step(out, result)
        if self.tiers is not None:
            self.tiers.end_step()
        self._maybe_check_idle()
        return expired + outputs

    def _decode_steps(self, out: SchedulerOutput) -> int:
        """How many greedy decode steps to chain in this step: up to ``num_continuous_decode_steps``
        and as many as fit in ``CHAIN_BUDGET_S`` at the decode step time measured for this many
        rows (1: none; ``interrupt_chain`` ends one early). Only when the
        step is every running request's decode without drafts and nothing waits, every request
        decodes greedily from plain logits (no penalties, logprobs or grammar) with room for the
        tokens, and the runner can (a learned drafter's captures rule it out). The chain's pages
        are allocated here (none found: no chain)."""
        sched = self.scheduler
        if self.spec is not None and any(s.num_draft for s in out.scheduled):
            return 1   # a verify step (a step without drafts may chain; the proposer drafts again after it)
        if sched.waiting or len(self._compiling) or len(out.scheduled) != len(sched.running):
            return 1
        step_s = self._decode_step_s.get(len(out.scheduled))
        if step_s is None:   # a batch size not timed yet: this step times it
            return 1
        n = min(self.config.num_continuous_decode_steps, int(CHAIN_BUDGET_S / max(step_s, 1e-6)))
        for s in out.scheduled:
            req, p = s.request, s.request.params
            if (s.num_tokens != 1 or s.num_draft or not s.samples or not p.greedy or p.uses_penalties
                    or p.logprobs is not None or req.grammar is not None):
                return 1
            n = min(n, p.max_tokens - req.num_output_tokens, self.max_model_len - req.num_tokens)
        chains = getattr(self.runner, "chains_decode_steps", None)
        if n < 2 or chains is None or not chains(len(out.scheduled)):
            return 1
        for s in out.scheduled:
            if not sched.kv.allocate(s.request, s.request.num_tokens + n - 1):
                return 1
        return n

    def interrupt_chain(self, on: bool = True) -> None:
        """From any thread: a chain of decode steps running now ends after its current step, and
        later ones after their first (``on``), so that new work (a request, an abort) waits at most
        a step; ``on=False`` lets chains run whole again (the caller's loop, before it hands the
        engine its new work)."""
        stop = getattr(self.runner, "chain_stop", None)
        if stop is not None:
            stop[0] = 1 if on else 0

    def _take_compiled(self) -> list[RequestOutput]:
        """Queue the requests whose grammar is ready; finish those whose grammar failed."""
        ready, failed = self._compiling.pop_done(self.grammar_compiler)
        for req in ready:
            self.scheduler.add_request(req)
        outputs = []
        for req, error in failed:
            req.status = RequestStatus.FINISHED
            req.finish_reason, req.stop_reason = "abort", error
            outputs.append(self._output(req, num_new=0))
        return outputs

    def _process_sampled(self, s: SampledTokens) -> RequestOutput:
        """Append a request's tokens of this step, in order, until one ends the request."""
        req = s.request
        n = 0
        for j, token in enumerate(s.token_ids):
            n += 1
            accepted_draft = j < s.num_accepted
            if accepted_draft:   # its K/V was written by this step
                req.num_accepted_draft_tokens += 1
            computed = accepted_draft or j < s.num_chained   # (a chained step's K/V too)
            if self._append(req, token, s.logprobs[j] if s.logprobs is not None else None, computed):
                break
        return self._output(req, num_new=n)

    def _append(self, req: Request, token: int, logprob: Any, computed: bool = False) -> bool:
        """Append one token and check the stop conditions; True when the request finished."""
        req.append_token(token)
        if computed:
            req.num_computed_tokens += 1
        grammar_ok = req.grammar is None or req.grammar.accept(token)
        self.generation_tokens_total += 1
        if req.logprobs is not None and logprob is not None:
            req.logprobs.append(logprob)
        params = req.params
        reason: str | None = None
        stop_reason: str | int | None = None
        if not params.ignore_eos and token in self.eos_token_ids:
            reason = "stop"
        elif token in params.stop_token_ids:
            reason, stop_reason = "stop", token
        else:
            hit = req.detokenizer.add_token(token)
            if hit is not None:
                reason, stop_reason = "stop", hit
        if reason is None and req.grammar is not None and (req.grammar.is_terminated or not grammar_ok):
            if not grammar_ok:
                log.error("request %s: sampled token %d is outside its grammar", req.request_id, token)
            reason = "stop" if grammar_ok else "abort"
        if reason is None and (req.num_output_tokens >= params.max_tokens
                               or req.num_tokens >= self.max_model_len):
            reason = "length"
        if reason is not None:
            if not isinstance(stop_reason, str):
                req.detokenizer.flush()
            self.scheduler.finish(req, reason, stop_reason)
            self.start_estimator.finished(time.monotonic())
            if self.spec is not None:
                self.spec.request_finished(req)
            return True
        return False

    def _output(self, req: Request, num_new: int) -> RequestOutput:
        """The request's output after this step: O(num_new) work, whatever its length."""
        finished = req.is_finished
        detok = req.detokenizer
        new_text = detok.take_new_text(finished)
        ids, lps, p = req.all_token_ids, req.logprobs, req.num_prompt_tokens
        if finished:   # nothing changes any more: one copy of the ids, the rest as they are
            token_ids, logprobs, text = ids[p:], lps, detok.emitted_text
        else:
            token_ids = ListView(ids, p, len(ids))
            logprobs = ListView(lps, 0, len(lps)) if lps is not None else None
            text = detok.emitted_view()
        return RequestOutput(
            request_id=req.request_id,
            prompt_token_ids=req.prompt_token_ids,
            cached_tokens=req.num_cached_tokens or 0,
            token_ids=token_ids,
            text_view=text,
            new_token_ids=ids[-num_new:] if num_new else [],
            new_text=new_text,
            logprobs=logprobs,
            finished=finished,
            finish_reason=req.finish_reason,
            stop_reason=req.stop_reason,
            cached_tokens_by_tier=req.cached_tokens_by_tier,
            new_logprobs=lps[-num_new:] if (lps is not None and num_new) else ([] if lps is not None else None),
            prompt_logprobs=req.prompt_logprobs,   # complete once the prompt is computed
            num_accepted_draft_tokens=req.num_accepted_draft_tokens,
        )

    # -- cache and stats -------------------------------------------------------------------------
    def flush_cache(self) -> bool:
        """Drop the prefix cache; refused (False) while requests are queued or running."""
        if self.scheduler.has_unfinished():
            return False
        self.kv.flush()
        return True

    def flush_storage_cache(self) -> int:
        """Delete what this model wrote to the L3 storage tier; returns pages deleted."""
        return self.tiers.flush_storage() if self.tiers is not None else 0

    def close(self) -> None:
        """Finish queued L3 writes and stop the storage worker (the engine stays usable
        for L1/L2 only); with tensor parallelism, stop the worker ranks (the engine cannot step
        after that)."""
        if self.tiers is not None:
            self.tiers.close()
        close_runner = getattr(self.runner, "close", None)
        if close_runner is not None:
            close_runner()

    def check_pages(self) -> None:
        """Assert page accounting (free + cached + request-only == total)."""
        self.scheduler.check_pages()

    def _maybe_check_idle(self) -> None:
        if self.config.debug_checks and not self.scheduler.has_unfinished():
            self.check_pages()

    @property
    def num_preemptions(self) -> int:
        return self.scheduler.num_preemptions

    def stats(self) -> EngineStats:
        s = self.scheduler
        pool = self.kv.pool
        return EngineStats(
            num_running=len(s.running),
            num_waiting=len(s.waiting) + len(self._compiling),   # incl. grammars still compiling
            kv_pages_total=pool.num_pages,
            kv_pages_free=pool.num_free(),
            kv_cache_usage=self.kv.usage(),
            prompt_tokens_total=s.prompt_tokens_total,
            cached_tokens_total=s.cached_tokens_total,
            generation_tokens_total=self.generation_tokens_total,
            num_preemptions=s.num_preemptions,
            kv_pages_cached=self.kv.cache.num_cached_pages if self.kv.cache is not None else 0,
            spec=self.spec.stats.snapshot() if self.spec is not None else None,
            kv_pages_in_use=sum(len(r.page_table) - r.num_tree_pages for r in s.running),
            kv_cache_dtype=self.kv_spec.dtype,
            kv_bytes_per_token=self._kv_bytes_per_token,
            kv_cache_fp8_scales=self.kv_spec.fp8_scales if self.kv_spec.is_fp8 else "",
            kv_capacity_tokens=self.kv_capacity_tokens,
            tensor_parallel_size=self.config.tensor_parallel_size,
            tiers=self.tiers.snapshot_stats() if self.tiers is not None else None,
            predicted_wait_s=self.start_estimator.predicted_wait(s, time.monotonic()),
            step_seconds=self.step_times.snapshot(),
            decode_chains_total=self.decode_chains_total,
            decode_chain_steps_total=self.decode_chain_steps_total,
            **self._state_stats(),
        )

    def _state_stats(self) -> dict[str, Any]:
        slots = self.kv.slots
        if slots is None:
            return {}
        return dict(state_slots_total=slots.num_request_slots, state_slots_free=slots.num_free(),
                    state_pool_usage=self.kv.state_usage(), state_snapshot_slots=slots.num_snapshot_slots,
                    state_snapshots_cached=slots.num_snapshot_slots - slots.num_free_snapshots(),
                    state_bytes_per_request=self.kv_spec.bytes_per_request())
