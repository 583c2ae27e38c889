"""Tensor parallelism: one scheduler process drives ``tp`` worker ranks (torch.distributed).

The engine process keeps the scheduler, the KV manager and the prefix cache (all torch-free) and
talks to the ranks through :class:`ParallelRunner`, which has the :class:`ModelRunner` interface.
Each worker rank is a process started with ``torch.multiprocessing`` (spawn). It joins a gloo
(CPU) or NCCL (CUDA) process group, loads the checkpoint, keeps only its shard
(:mod:`tokenmill.models.tensor_parallel`) and allocates its share of the KV pool: the same number
of pages as the scheduler's page pool, so page ids mean the same on every rank.

Per step the scheduler pickles one small step description and sends the same bytes to every
rank over its pipe: for each scheduled request its id, first position, token count, whether it
samples, the token ids the ranks have not seen yet (the whole prompt on first sight, then one
token per decode), its page table, (first sight only) its sampling parameters, for a constrained
request the next-token bitmask its grammar allows (grammars advance in the scheduler process), and
for prompt logprobs how many it already holds; plus the ids of requests that have left. Every rank mirrors the requests (the same :class:`Request` objects
the single-process runner reads), builds the same batch and runs its shard; the all-reduces
inside the model keep the ranks in lockstep. Only rank 0 gets logits (vocabulary-parallel LM
head gathered to it), samples, and sends back the tokens (and logprobs) per sampling request, so
seeded sampling is the one-process code path with one random stream per request; prompt logprobs
computed by rank 0 come back with the tokens.

Speculative decoding: the proposer runs in the scheduler process (n-gram and suffix need only
the token ids; a DFlash drafter reads the target's hidden states, which rank 0 captures after the
all-reduces, where they are whole, and returns with the step). A request's drafts travel in the
step description as more tokens of the step; every rank computes their K/V, rank 0 verifies them
(:func:`~tokenmill.layers.speculative.verify`, the one-process code) and returns the accepted
tokens plus one. The scheduler's rollback frees the pages past the accepted end; the ranks keep no
page state of their own, so the next page tables are the whole rollback on every rank.

Failure: the scheduler waits for rank 0's answer *and* every rank's process sentinel. A rank that
dies (or reports an exception) makes :meth:`ParallelRunner.execute` raise
:class:`ReplicaFailedError` at once; the runner then terminates the other ranks (kill after a
short grace), so nothing waits on a collective that can never complete. A rank that fails to
start is reported the same way at construction, with the rank's own error message.
"""
from __future__ import annotations

import logging
import os
import pickle
import tempfile
import time
import traceback
import weakref
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import Any

from tokenmill.contracts.errors import ReplicaFailedError
from tokenmill.engine.model_runner import SampledTokens, StepResult
from tokenmill.engine.request import Request
from tokenmill.engine.scheduler import ScheduledRequest, SchedulerOutput

log = logging.getLogger(__name__)

START_TIMEOUT_S = 300.0      # loading a checkpoint on a crowded machine can be slow
DEATH_GRACE_S = 3.0          # after rank 0's error, how long to wait for another rank's exit to show
STOP_GRACE_S = 3.0


@dataclass(frozen=True)
class WorkerSpec:
    """What a worker rank needs to build its shard (picklable)."""

    model: str                 # name or path (for logs; the weights come from the scheduler process)
    dtype: str
    tp: int
    num_pages: int
    page_size: int
    device: str                # "cpu" or "cuda" (rank r uses cuda:r)
    kv_dtype: str              # storage dtype of the KV pool
    attention_backend: str
    num_threads: int | None
    pin_cores: bool            # CPU: pin rank r to core r % cpu_count
    init_method: str
    seed: int | None = None
    moe_parallel: str = "tp"   # MoE experts: "tp" (intermediate split) or "ep" (whole experts per rank)
    kv_fp8_scales: str = "static"           # fp8 KV scale scheme (KVCacheSpec.fp8_scales)
    calibration_tokens: list[int] | None = None   # prompt for static fp8 scales (every rank the same)
    linear_backend: str = "auto"
    compile: bool = False


def check_tensor_parallel_devices(tp: int, device: str) -> None:
    """Raise ValueError when ``tp`` ranks cannot each get a device of type ``device``."""
    import torch

    if device.startswith("cuda"):
        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if tp > n:
            raise ValueError(f"tensor_parallel_size={tp} needs {tp} CUDA devices, {n} visible")
        if device not in ("cuda", "cuda:0"):
            raise ValueError(f"with tensor_parallel_size > 1 give device 'cuda' (rank r uses cuda:r), "
                             f"not {device!r}")
    elif device != "cpu":
        raise ValueError(f"tensor parallelism runs on cpu (gloo) or cuda (NCCL), not {device!r}")


# ------------------------------------------------------------------------------------- scheduler side
class ParallelRunner:
    """The scheduler process's handle on ``tp`` worker ranks (same ``execute`` as ModelRunner)."""

    def __init__(self, spec: WorkerSpec, model: Any, *, start_timeout_s: float = START_TIMEOUT_S) -> None:
        import torch.multiprocessing as mp

        from tokenmill.models.tensor_parallel import shard_weights

        self.spec = spec
        self.tp = spec.tp
        self.vocab_size = int(model.args.vocab_size)
        ctx = mp.get_context("spawn")
        self._conns: list[Connection] = []
        self._procs: list[Any] = []
        self._sent: dict[str, tuple[Request, int]] = {}   # request id -> (request, tokens the ranks hold)
        self._closed = False
        self.rank_info: list[dict[str, Any]] = []
        # target layers whose hidden states rank 0 returns with each step (a learned drafter's;
        # after the all-reduces the hidden states are whole and the same on every rank)
        self.capture_layers: frozenset[int] = frozenset()
        self.page_ops: Any = None   # kv_tiers.RemotePages: the tier copies every rank replays
        self._tier_writers: list[int] = []
        for rank in range(spec.tp):
            parent, child = ctx.Pipe(duplex=True)
            p = ctx.Process(target=_worker_main, args=(rank, spec, child), name=f"tokenmill-tp{rank}", daemon=True)
            p.start()
            child.close()
            self._conns.append(parent)
            self._procs.append(p)
        self._finalizer = weakref.finalize(self, _stop_workers, self._conns, self._procs)
        try:
            # the sharded load: slice the HF-named weights here, hand each rank its part through
            # shared memory (torch.multiprocessing), so no rank reads or holds the whole checkpoint
            shards = []
            for rank in range(spec.tp):
                kind, full_args, part = shard_weights(model, rank, spec.tp, spec.moe_parallel)
                part = {k: _shared_copy(v) for k, v in part.items()}
                shards.append(part)
                try:
                    self._conns[rank].send(("weights", kind, full_args, part))
                except (BrokenPipeError, ConnectionResetError, EOFError, OSError):
                    self._fail(self._dead_ranks_message(starting=True)
                               or f"tensor-parallel rank {rank} failed to start: its pipe closed")
            for rank in range(spec.tp):
                msg = self._recv(rank, start_timeout_s, what="start")
                if msg[0] != "ready":
                    raise ReplicaFailedError(f"tensor-parallel rank {rank} failed to start: {msg[1]}")
                self.rank_info.append(msg[1])
            del shards
        except BaseException:
            self.close()
            raise
        log.info("tensor parallel: %d ranks ready (%s), KV per rank: %d pages x %d tokens, %d B/token",
                 spec.tp, "gloo" if spec.device == "cpu" else "nccl", spec.num_pages, spec.page_size,
                 self.rank_info[0]["kv_bytes_per_token"])
        if spec.moe_parallel == "ep" and self.rank_info[0].get("experts") is not None:
            log.info("expert parallel: %s", ", ".join(
                f"rank {i['rank']} experts {i['experts'][0]}..{i['experts'][1] - 1} "
                f"({i['expert_weight_bytes'] / 2**20:.1f} MiB)" for i in self.rank_info))

    # ---- the ModelRunner interface -------------------------------------------------------------
    def make_generator(self, seed: int | None) -> None:
        """Seeded streams live on rank 0 (made when it first sees the request)."""
        return None

    def execute(self, out: SchedulerOutput) -> StepResult:
        if self._closed:
            raise ReplicaFailedError("the tensor-parallel replica has shut down")
        desc, samplers = self._describe(out)
        ops, data = self.page_ops.take() if self.page_ops is not None else ([], None)
        desc["ops"] = ops
        self._send_all("step", desc, data)
        msg = self._recv(0, None, what="step")
        if msg[0] != "ok":
            # a rank's error is often another rank's death seen in a collective: name the dead too.
            # The dead rank's exit can reach us a little after rank 0's error (a loaded machine), so
            # poll the other ranks a while rather than pause for a fixed time. A sentinel alone is
            # not enough: a dying process closes its files (the sentinel fires) before it can be
            # reaped, so its exit code may still be unknown just after.
            dead = self._await_dead_ranks(skip=0, grace_s=DEATH_GRACE_S)   # rank 0 exits right after its error
            self._fail(f"{msg[1]}" + (f" ({dead})" if dead else ""))
        results, prompt_lps, captured, q_start = msg[1], msg[2], msg[3], msg[4]
        if len(results) != len(samplers):
            self._fail(f"rank 0 returned {len(results)} tokens for {len(samplers)} sampling requests")
        for s in out.scheduled:
            new = prompt_lps.get(s.request.request_id)
            if new and s.request.prompt_logprobs is not None:
                s.request.prompt_logprobs.extend(new)
        return StepResult([SampledTokens(req, toks, lps, nd, na) for req, (toks, lps, nd, na) in zip(samplers, results)],
                          captured, q_start)

    def _send_all(self, kind: str, body: Any, data: list[list[list[bytes]]] | None) -> None:
        """Send ``(kind, body, this rank's data)`` to every rank; one pickle when no rank data."""
        try:
            if data is None or not any(data):
                payload = pickle.dumps((kind, body, None), protocol=pickle.HIGHEST_PROTOCOL)
                for conn in self._conns:
                    conn.send_bytes(payload)
            else:
                for conn, part in zip(self._conns, data):
                    conn.send_bytes(pickle.dumps((kind, body, part), protocol=pickle.HIGHEST_PROTOCOL))
        except (BrokenPipeError, ConnectionResetError, EOFError, OSError):
            self._fail(self._dead_ranks_message() or f"a rank's pipe broke while sending the {kind}")

    # ---- KV tiers (engine/kv_tiers.py) ---------------------------------------------------------
    def init_tiers(self, host_pages: int, host_dtype: Any, storage: str, namespaces: list[bytes],
                   writers: list[bool], timeout_s: float) -> None:
        """Give every rank its L2 slots and, with L3, the ranks in ``writers`` a storage writer of
        their own under ``namespaces[r]`` (the others hold a copy of a writer's shard)."""
        self._tier_writers = [r for r, w in enumerate(writers) if w]
        for rank, conn in enumerate(self._conns):
            conn.send_bytes(pickle.dumps(("tiers_init", {"host_pages": host_pages, "host_dtype": host_dtype,
                                                         "storage": storage if writers[rank] else "none",
                                                         "namespace": namespaces[rank],
                                                         "timeout_s": timeout_s}, None)))
        for rank in range(self.tp):
            msg = self._recv(rank, 60.0, what="tiers_init")
            if msg[0] != "tiers_ready":
                self._fail(f"rank {rank} could not set up its KV tiers: {msg[1]}")

    def sync_tiers(self, timeout_s: float) -> tuple[bool, dict[str, tuple[int, int, int, int]]]:
        """Run the queued page ops on every rank now and wait for the ranks' L3 writes.
        Returns (all drained, L3 write counters: bytes summed over the writing ranks; pages, pages
        already present and dropped writes as the least-written of them counts them)."""
        if self._closed:
            return False, {}
        ops, data = self.page_ops.take() if self.page_ops is not None else ([], None)
        self._send_all("tiers_sync", {"ops": ops, "timeout_s": timeout_s}, data)
        replies = [self._recv(r, timeout_s + 30.0, what="tiers_sync") for r in range(self.tp)]
        for r, msg in enumerate(replies):
            if msg[0] != "synced":
                self._fail(f"rank {r}: {msg[1]}")
        counts = [replies[r][2] for r in self._tier_writers]
        merged = {"l3": (sum(c[0] for c in counts), min(c[1] for c in counts), min(c[2] for c in counts),
                         max(c[3] for c in counts))}
        return all(msg[1] for msg in replies), merged

    def stats(self) -> list[dict[str, Any]]:
        """Each rank's counters: all-reduce seconds, collective bytes, steps."""
        for conn in self._conns:
            conn.send_bytes(pickle.dumps(("stats", None, None)))
        return [self._recv(r, 60.0, what="stats")[1] for r in range(self.tp)]

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._finalizer()

    # ---- internals -----------------------------------------------------------------------------
    def _describe(self, out: SchedulerOutput) -> tuple[dict[str, Any], list[Request]]:
        drops = [rid for rid, (req, _) in self._sent.items() if req.is_finished]
        for rid in drops:
            del self._sent[rid]
        items = []
        samplers: list[Request] = []
        for s in out.scheduled:
            req = s.request
            end = s.start + s.num_tokens - s.num_draft   # drafts are not (yet) the request's tokens
            known = self._sent.get(req.request_id)
            if known is not None and known[0] is not req:  # an id reused after the old request left
                drops.append(req.request_id)
                known = None
            if known is None:
                new = (req.prompt_token_ids, req.params)
                have = 0
            else:
                new, have = None, known[1]
            delta = req.all_token_ids[have:end] if end > have else []
            self._sent[req.request_id] = (req, max(have, end))
            # a constrained request's allowed tokens: its grammar lives here, rank 0 applies the mask
            mask = self._grammar_mask(req) if s.samples and req.grammar is not None else None
            plp = len(req.prompt_logprobs) if req.prompt_logprobs is not None else None
            # speculative drafts (and their draft distribution, when the proposer has one): rank 0
            # verifies them; a rejected draft's K/V sits past the request's end on every rank and
            # is overwritten there (the scheduler's rollback frees those pages, the ranks follow
            # the page tables)
            probs = req.spec_probs[: s.num_draft] if s.num_draft and req.spec_probs is not None else None
            items.append((req.request_id, s.start, s.num_tokens, s.samples, delta, req.page_table, new, mask, plp,
                          s.draft_token_ids, probs))
            if s.samples:
                samplers.append(req)
        return {"drop": drops, "items": items, "capture": self.capture_layers}, samplers

    def _grammar_mask(self, req: Request) -> Any:
        import xgrammar as xgr

        bitmask = xgr.allocate_token_bitmask(1, self.vocab_size)
        req.grammar.fill_mask(bitmask, 0)
        return bitmask[0]

    def _recv(self, rank: int, timeout: float | None, *, what: str) -> tuple[Any, ...]:
        """Rank ``rank``'s next message; raise ReplicaFailedError as soon as any rank dies."""
        conn = self._conns[rank]
        deadline = None if timeout is None else time.monotonic() + timeout
        sentinels = {p.sentinel: r for r, p in enumerate(self._procs)}
        closed = False   # the rank's end of the pipe is gone: wait on the sentinels only
        while True:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready = wait([*([] if closed else [conn]), *sentinels], timeout=left)
            if conn in ready:
                try:
                    return pickle.loads(conn.recv_bytes())
                except (EOFError, OSError):
                    closed = True  # the rank is gone; its sentinel tells which
            dead = self._dead_ranks_message(starting=what == "start")
            if dead:
                self._fail(dead)
            if deadline is not None and time.monotonic() >= deadline:
                self._fail(f"tensor-parallel rank {rank} did not answer ({what}) within {timeout:.0f} s")
            if ready:   # a pipe or sentinel closed before the exit code can be reaped: poll, do not spin
                time.sleep(0.005)

    def _await_dead_ranks(self, skip: int, grace_s: float) -> str:
        """:meth:`_dead_ranks_message` once some rank (but ``skip``) has exited, or after
        ``grace_s`` seconds with none (then "")."""
        others = [p.sentinel for r, p in enumerate(self._procs) if r != skip]
        deadline = time.monotonic() + grace_s
        while True:
            dead = self._dead_ranks_message(skip=skip)
            left = deadline - time.monotonic()
            if dead or left <= 0 or not others:
                return dead
            if wait(others, timeout=min(left, 0.05)):   # exited but maybe not reapable yet
                time.sleep(min(left, 0.005))

    def _dead_ranks_message(self, skip: int | None = None, *, starting: bool = False) -> str:
        """Every rank (but ``skip``) that has exited, with its code and last error; ``starting``
        words each as "tensor-parallel rank N failed to start: ...", as a start error from the
        rank's own message is."""
        dead = []
        for r, p in enumerate(self._procs):
            if r == skip:
                continue
            p.join(timeout=0)
            if p.exitcode is not None:
                what = f"exited with code {p.exitcode}{self._last_words(r)}"
                dead.append(f"tensor-parallel rank {r} failed to start: {what}" if starting else f"rank {r} {what}")
        # a dead rank usually makes the others fail in their collective: report the first death
        return "; ".join(dead)

    def _last_words(self, rank: int) -> str:
        """The error a dead rank sent before it exited, if it is still in the pipe."""
        conn = self._conns[rank]
        try:
            while conn.poll(0):
                msg = pickle.loads(conn.recv_bytes())
                if msg and msg[0] == "error":
                    return f" ({msg[1]})"
        except (EOFError, OSError, pickle.UnpicklingError):
            pass
        return ""

    def _fail(self, why: str) -> None:
        log.error("tensor-parallel replica failed: %s; stopping all %d ranks", why, self.tp)
        self.close()
        raise ReplicaFailedError(f"tensor-parallel replica failed: {why}")


def _shared_copy(t: Any) -> Any:
    """A copy of ``t`` in shared memory, for a rank to map. Never ``t.share_memory_()`` on the
    model's own tensors: that moves the tensor's whole storage (a view's base too) into shared
    memory in place and frees the old bytes, and raw pointers into them (the fused decode
    stack's table of norm and weight addresses) would then read freed memory: the next
    single-process engine on the same loaded model crashed in the native decoder. The price is
    one copy of the weights held during start-up, until every rank has mapped its part."""
    import torch

    if t.device.type != "cpu":
        return t.contiguous()   # device tensors travel by IPC handle; share_memory_ moves nothing
    out = torch.empty(t.shape, dtype=t.dtype).share_memory_()   # a fresh storage moves, nothing else
    return out.copy_(t)


def _stop_workers(conns: list[Connection], procs: list[Any]) -> None:
    """Ask every rank to exit, then terminate, then kill whatever is left (never blocks long)."""
    for conn in conns:
        try:
            conn.send_bytes(pickle.dumps(("shutdown", None, None)))
        except (BrokenPipeError, ConnectionResetError, EOFError, OSError):
            pass
    deadline = time.monotonic() + STOP_GRACE_S
    for p in procs:
        p.join(timeout=max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.terminate()
    for p in procs:
        p.join(timeout=STOP_GRACE_S)
        if p.is_alive():
            p.kill()
            p.join(timeout=STOP_GRACE_S)
    for conn in conns:
        conn.close()


def new_init_method() -> str:
    """A file:// rendezvous for one replica's process group (the file is removed by the ranks)."""
    fd, path = tempfile.mkstemp(prefix="tokenmill-tp-")
    os.close(fd)
    os.unlink(path)
    return f"file://{path}"


# ----------------------------------------------------------------------------------------- worker side
def _worker_main(rank: int, spec: WorkerSpec, conn: Connection) -> None:
    try:
        runner, mirror = _worker_setup(rank, spec, conn)
    except BaseException as e:  # noqa: BLE001 - reported to the scheduler, then exit non-zero
        _send(conn, ("error", f"{type(e).__name__}: {e}"))
        logging.getLogger(__name__).error("rank %d failed to start:\n%s", rank, traceback.format_exc())
        os._exit(1)
    import torch
    import torch.distributed as dist

    from tokenmill.engine.kv_tiers import describe_pool

    m_args = runner.model.args
    _send(conn, ("ready", {"rank": rank, "kv_bytes_per_token": runner.kv_spec.bytes_per_token(),
                           "num_heads": m_args.num_heads,
                           "num_kv_heads": getattr(m_args, "num_kv_heads", None),
                           "experts": getattr(m_args, "local_experts", None),
                           "expert_weight_bytes": (runner.model.expert_weight_bytes()
                                                   if hasattr(runner.model, "expert_weight_bytes") else 0),
                           "kv_pool": describe_pool(runner.kv_caches, spec.num_pages)}))
    steps = 0
    tiers = _RankTiers()
    try:
        while True:
            try:
                kind, body, data = pickle.loads(conn.recv_bytes())
            except (EOFError, OSError):  # the scheduler is gone
                break
            if kind == "shutdown":
                break
            if kind == "tiers_init":
                tiers.setup(runner, spec.num_pages, body)
                _send(conn, ("tiers_ready",))
                continue
            if kind == "tiers_sync":
                tiers.run(body["ops"], data)
                ok = tiers.drain(body["timeout_s"])
                _send(conn, ("synced", ok, tiers.counts()))
                continue
            if kind == "stats":
                m = runner.model
                _send(conn, ("stats", {"rank": rank, "steps": steps, "allreduce_s": m.allreduce_s,
                                       "comm_bytes": m.comm_bytes}))
                continue
            if body["ops"]:   # the step's tier copies (demotions, reloads, L3 writes) come first
                tiers.run(body["ops"], data)
            out = mirror.apply(body)
            if rank == 0:
                runner.capture_layers = body["capture"]
            with torch.inference_mode():
                result = runner.execute(out)
            steps += 1
            if rank == 0:
                _send(conn, ("ok", [(s.token_ids, s.logprobs, s.num_draft, s.num_accepted) for s in result.sampled],
                                 mirror.new_prompt_logprobs(), result.captured, result.query_start))
    except BaseException as e:  # noqa: BLE001
        logging.getLogger(__name__).error("rank %d failed:\n%s", rank, traceback.format_exc())
        _send(conn, ("error", f"rank {rank}: {type(e).__name__}: {e}"))
        os._exit(1)
    tiers.close()
    try:
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - the group may already be broken at shutdown
        pass
    os._exit(0)


def _send(conn: Connection, msg: tuple[Any, ...]) -> None:
    try:
        conn.send_bytes(pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL))
    except (BrokenPipeError, ConnectionResetError, EOFError, OSError):
        pass


def _worker_setup(rank: int, spec: WorkerSpec, conn: Connection) -> tuple[Any, _Mirror]:
    import datetime

    import torch
    import torch.distributed as dist

    from tokenmill.engine.model_runner import ModelRunner
    from tokenmill.models.tensor_parallel import build_shard

    if spec.device == "cpu":
        if spec.pin_cores and hasattr(os, "sched_setaffinity"):
            cores = sorted(os.sched_getaffinity(0))
            os.sched_setaffinity(0, {cores[rank % len(cores)]})
        threads = spec.num_threads or max(1, (os.cpu_count() or 1) // spec.tp)
        torch.set_num_threads(threads)
        device = torch.device("cpu")
        backend = "gloo"
    else:
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
        backend = "nccl"
    dist.init_process_group(backend, init_method=spec.init_method, rank=rank, world_size=spec.tp,
                            timeout=datetime.timedelta(seconds=120))
    dtype = getattr(torch, spec.dtype)
    what, kind, full_args, weights = conn.recv()
    if what != "weights":
        raise RuntimeError(f"expected this rank's weights first, got {what!r}")
    shard = build_shard(kind, full_args, rank, spec.tp, dtype, weights, spec.moe_parallel)
    del weights
    kv_spec = shard.kv_cache_spec().with_dtype(spec.kv_dtype).with_fp8_scales(spec.kv_fp8_scales)
    runner = ModelRunner(shard, spec.num_pages, spec.page_size, shard.full_args.vocab_size, device=device,
                         seed=spec.seed, kv_spec=kv_spec, attention_backend=spec.attention_backend,
                         calibration_tokens=spec.calibration_tokens,
                         linear_backend=spec.linear_backend, compile=spec.compile)
    return runner, _Mirror(runner)


class _RankTiers:
    """One rank's side of the KV tiers: its L2 slots and L3 writer over its own shard."""

    def __init__(self) -> None:
        self.pages: Any = None
        self.writer: Any = None
        self._counts = [0, 0, 0]   # L3 bytes written, pages written, pages already present

    def setup(self, runner: Any, num_pages: int, cfg: dict[str, Any]) -> None:
        from tokenmill.cache.storage import StorageWorker, open_storage
        from tokenmill.engine.kv_tiers import LocalPages

        self.pages = LocalPages(runner.kv_caches, num_pages, cfg["host_pages"], cfg["host_dtype"])
        backend = open_storage(cfg["storage"], cfg["namespace"], timeout_s=cfg["timeout_s"])
        if backend is not None:
            self.writer = StorageWorker(backend, on_error=self._on_error, on_io=self._on_io)
            self.pages.attach_writer(self.writer)

    def _on_error(self, kind: str, message: str) -> None:
        log.warning("KV storage tier (this rank's shard): %s: %s", kind, message)

    def _on_io(self, op: str, nbytes: int, pages: int) -> None:
        if op == "write":
            self._counts[0] += nbytes
            self._counts[1] += pages
        elif op == "present":
            self._counts[2] += pages

    def run(self, ops: list[Any], data: Any) -> None:
        from tokenmill.engine.kv_tiers import run_page_ops

        if ops:
            if self.pages is None:
                raise RuntimeError("page ops arrived before the KV tiers were set up")
            run_page_ops(self.pages, ops, data or [])

    def drain(self, timeout: float) -> bool:
        return self.writer.drain(timeout) if self.writer is not None else True

    def counts(self) -> tuple[int, int, int, int]:
        dropped = self.writer.dropped_writes if self.writer is not None else 0
        return (self._counts[0], self._counts[1], self._counts[2], dropped)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None


class _Mirror:
    """A rank's copy of the requests it has seen: the fields the model runner reads."""

    def __init__(self, runner: Any) -> None:
        self.runner = runner
        self.requests: dict[str, Request] = {}
        self._plp_before: dict[str, int] = {}

    def new_prompt_logprobs(self) -> dict[str, list[Any]]:
        """Prompt logprobs recorded by the last step (rank 0), per request id."""
        out = {}
        for rid, n in self._plp_before.items():
            lps = self.requests[rid].prompt_logprobs
            if lps is not None and len(lps) > n:
                out[rid] = lps[n:]
        return out

    def apply(self, desc: dict[str, Any]) -> SchedulerOutput:
        for rid in desc["drop"]:
            self.requests.pop(rid, None)
        scheduled = []
        self._plp_before = {}
        for rid, start, n, samples, delta, page_table, new, mask, plp, drafts, probs in desc["items"]:
            if new is not None:
                prompt, params = new
                req = Request(rid, list(prompt), params)
                req.all_token_ids = []
                req.generator = self.runner.make_generator(params.seed)
                self.requests[rid] = req
            req = self.requests[rid]
            req.all_token_ids.extend(delta)
            req.page_table = page_table
            req.grammar = _ShippedMask(mask) if mask is not None else None
            if plp is not None:
                # the scheduler's count decides which prompt rows this step computes, on every
                # rank alike (ranks other than 0 keep placeholders: only rank 0 has logits)
                lps = req.prompt_logprobs if req.prompt_logprobs is not None else []
                req.prompt_logprobs = (lps + [None] * plp)[:plp]
                self._plp_before[rid] = plp
            req.spec_probs = probs
            scheduled.append(ScheduledRequest(req, start, n, samples, drafts))
        return SchedulerOutput(scheduled=scheduled)


class _ShippedMask:
    """The next-token bitmask of a constrained request, filled by its grammar in the scheduler
    process (where the grammar advances); rank 0 applies it like a local grammar's."""

    def __init__(self, row: Any) -> None:
        self.row = row

    def fill_mask(self, bitmask: Any, row: int) -> None:
        bitmask[row] = self.row
