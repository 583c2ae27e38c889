"""Runs a benchmark: a sweep of concurrency levels, each a closed-loop agentic run or a trace
replay, against one endpoint. Returns per-level records and metrics; writes nothing.

Per level:
- ``--flush-cache``: ``POST /flush_cache`` first; the theoretical cache is cleared only when the
  server really flushed (so ``cache_hit_rate_theoretical`` stays an upper bound of what the
  server could have cached).
- agentic: ``concurrency`` workers each run sessions one after another (closed loop: a turn is
  sent when the previous response ended plus its think time). Each level uses fresh session
  indices, so a later level does not hit the KV of an earlier level's sessions.
- trace: requests are sent at their (scaled) trace times, or Poisson times with
  ``request_rate``, with at most ``concurrency`` in flight.
- bound: ``sessions`` (agentic) / ``num_requests`` (trace) and/or ``duration_s``; no request is
  sent after the deadline, in-flight ones finish.
- warm-up: requests sent during the first ``warmup_s`` seconds are excluded from the metrics and
  the measurement window starts after it.
"""
from __future__ import annotations

import asyncio
import math
import time
from dataclasses import dataclass, field
from typing import Any

from tokenmill.bench.client import BenchClient, RequestResult
from tokenmill.bench.metrics import RequestRecord, compute_run_metrics
from tokenmill.bench.prompts import PROMPT_FORMATS, RequestPayload, SessionPrompt, TextCodec, single_prompt
from tokenmill.workload import (AgenticWorkloadConfig, InfinitePrefixCache, SessionScript, TraceRequest,
                                      make_session, poisson_arrivals, random_token_ids)


@dataclass(frozen=True)
class RunConfig:
    """Load control of a benchmark run (see module doc)."""

    concurrency: tuple[int, ...] = (1, 2, 4)
    sessions: int | None = None          # agentic: sessions per level (None: 2 x concurrency, >= 4)
    num_requests: int | None = None      # trace: requests per level (None: all, unless duration)
    duration_s: float | None = None
    warmup_s: float = 0.0
    flush_cache: bool = False
    devices: int = 1
    request_rate: float | None = None
    progress: bool = True
    prompt_format: str = "tokens"
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.concurrency or any(c < 1 for c in self.concurrency):
            raise ValueError(f"concurrency levels must be >= 1, got {self.concurrency}")
        if self.sessions is not None and self.sessions < 1:
            raise ValueError("sessions must be >= 1")
        if self.num_requests is not None and self.num_requests < 1:
            raise ValueError("num_requests must be >= 1")
        if self.duration_s is not None and not (self.duration_s > 0 and math.isfinite(self.duration_s)):
            raise ValueError("duration must be > 0")
        if self.warmup_s < 0:
            raise ValueError("warm-up must be >= 0")
        if self.duration_s is not None and self.warmup_s >= self.duration_s:
            raise ValueError(f"warm-up ({self.warmup_s}s) must be shorter than the duration ({self.duration_s}s)")
        if self.devices < 1:
            raise ValueError("devices must be >= 1")
        if self.request_rate is not None and not self.request_rate > 0:
            raise ValueError("request rate must be > 0")
        if self.prompt_format not in PROMPT_FORMATS:
            raise ValueError(f"prompt format must be one of {PROMPT_FORMATS}")

    def sessions_for(self, concurrency: int) -> int | None:
        if self.sessions is not None:
            return self.sessions
        return None if self.duration_s is not None else max(4, 2 * concurrency)


@dataclass
class LevelResult:
    concurrency: int
    records: list[RequestRecord]
    metrics: dict[str, Any]
    flushed: bool | None = None


@dataclass
class BenchRun:
    levels: list[LevelResult] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    model: str | None = None


class _Level:
    """Mutable state of one level in progress."""

    def __init__(self, start: float, warmup_s: float, duration_s: float | None, bar: Any) -> None:
        self.start = start
        self.warm_until = start + warmup_s
        self.deadline = start + duration_s if duration_s is not None else math.inf
        self.records: list[RequestRecord] = []
        self.theoretical_hit = 0
        self.theoretical_total = 0
        self.bar = bar

    def expired(self) -> bool:
        return time.perf_counter() >= self.deadline


class BenchRunner:
    """Drives one endpoint through all levels of a run."""

    def __init__(self, client: BenchClient, run: RunConfig, *, codec: TextCodec | None,
                 agentic: AgenticWorkloadConfig | None = None, trace: list[TraceRequest] | None = None) -> None:
        if (agentic is None) == (trace is None):
            raise ValueError("give exactly one workload: agentic or trace")
        if run.prompt_format in ("text", "chat") and codec is None:
            raise ValueError(f"prompt format {run.prompt_format!r} needs a tokenizer")
        self.client, self.run_cfg, self.codec = client, run, codec
        self.agentic, self.trace = agentic, trace
        self.cache = InfinitePrefixCache(block_size=1)
        self._next_session = 0

    async def run(self) -> BenchRun:
        out = BenchRun()
        out.model = await self.client.discover_model()
        warm_ids = list(random_token_ids(32, 1000, 20000, "warmup", self.run_cfg.seed))
        warm = single_prompt(self.run_cfg.prompt_format, self.codec, warm_ids)
        out.warnings += await self.client.probe(warm)
        self._observe_send(warm, None)
        flush_missing = False
        for c in self.run_cfg.concurrency:
            flushed = None
            if self.run_cfg.flush_cache:
                flushed = await self.client.flush_cache()
                if flushed:
                    self.cache.clear()
                elif flushed is None and not flush_missing:
                    flush_missing = True
                    out.warnings.append("server has no POST /flush_cache or /reset_prefix_cache; caches carry over "
                                        "between levels")
                elif flushed is False:
                    out.warnings.append(f"flush_cache refused before concurrency {c}")
            out.levels.append(await self._level(c, flushed))
        return out

    # ------------------------------------------------------------------ bookkeeping
    def _observe_send(self, payload: RequestPayload, lvl: _Level | None, warmup: bool = True) -> None:
        """Infinite-cache model: a prompt is looked up and inserted when it is sent (an upper
        bound even for servers that share prefixes of requests still in flight)."""
        if payload.local_ids is None:
            return
        hit = self.cache.observe(payload.local_ids)
        if lvl is not None and not warmup:
            lvl.theoretical_hit += hit
            lvl.theoretical_total += len(payload.local_ids)

    def _observe_finish(self, payload: RequestPayload, res: RequestResult) -> None:
        if payload.local_ids is None or not res.record.ok:
            return
        out_ids = res.token_ids
        if out_ids is None and self.codec is not None:
            out_ids = self.codec.encode(res.text)
        if out_ids:
            self.cache.insert([*payload.local_ids, *out_ids])

    async def _send(self, lvl: _Level, payload: RequestPayload, max_tokens: int, session_id: str | None,
                    turn: int, branch: int) -> RequestResult:
        warmup = time.perf_counter() < lvl.warm_until
        self._observe_send(payload, lvl, warmup)
        res = await self.client.send(payload, max_tokens=max_tokens, session_id=session_id, turn=turn,
                                     branch=branch, warmup=warmup)
        self._observe_finish(payload, res)
        lvl.records.append(res.record)
        if lvl.bar is not None:
            lvl.bar.update(1)
        return res

    def _bar(self, concurrency: int, total: int | None) -> Any:
        if not self.run_cfg.progress:
            return None
        from tqdm import tqdm

        return tqdm(total=total, desc=f"concurrency {concurrency}", unit="req", leave=True)

    # ------------------------------------------------------------------ levels
    async def _level(self, concurrency: int, flushed: bool | None) -> LevelResult:
        if self.agentic is not None:
            n = self.run_cfg.sessions_for(concurrency)
            total = None if n is None else sum(
                t.parallel_requests for s in range(n) for t in make_session(self.agentic, self._next_session + s).turns)
            lvl = _Level(time.perf_counter(), self.run_cfg.warmup_s, self.run_cfg.duration_s,
                         self._bar(concurrency, total))
            await self._agentic_level(lvl, concurrency, n)
        else:
            lvl = _Level(time.perf_counter(), self.run_cfg.warmup_s, self.run_cfg.duration_s, None)
            reqs = self._trace_slice()
            lvl.bar = self._bar(concurrency, len(reqs))
            await self._trace_level(lvl, concurrency, reqs)
        if lvl.bar is not None:
            lvl.bar.close()
        theo = lvl.theoretical_hit / lvl.theoretical_total if lvl.theoretical_total else None
        window_start = lvl.warm_until if self.run_cfg.warmup_s > 0 else None
        metrics = compute_run_metrics(lvl.records, concurrency=concurrency, devices=self.run_cfg.devices,
                                      window_start=window_start, theoretical_hit_rate=theo)
        metrics["flushed_before"] = flushed
        return LevelResult(concurrency, lvl.records, metrics, flushed)

    async def _agentic_level(self, lvl: _Level, concurrency: int, n_sessions: int | None) -> None:
        assert self.agentic is not None
        base = self._next_session
        started = 0

        async def worker() -> None:
            nonlocal started
            while not lvl.expired() and (n_sessions is None or started < n_sessions):
                script = make_session(self.agentic, base + started)  # type: ignore[arg-type]
                started += 1
                await self._session(lvl, script)

        await asyncio.gather(*(worker() for _ in range(concurrency)))
        self._next_session = base + started

    async def _session(self, lvl: _Level, script: SessionScript) -> None:
        sp = SessionPrompt(self.run_cfg.prompt_format, self.codec)
        sp.start(script.shared_prompt_ids, script.turns[0].new_token_ids)
        last: RequestResult | None = None
        for turn in script.turns:
            if turn.index > 0:
                assert last is not None
                if time.perf_counter() + turn.think_time_s >= lvl.deadline:
                    return
                await asyncio.sleep(turn.think_time_s)
                sp.extend(last.token_ids, last.text, turn.new_token_ids)
            sends = [self._send(lvl, sp.payload(), turn.output_tokens, script.session_id, turn.index, 0)]
            for b in range(1, turn.parallel_requests):
                sends.append(self._send(lvl, sp.payload(turn.branch_suffix(b)), turn.output_tokens,
                                        script.session_id, turn.index, b))
            results = await asyncio.gather(*sends)
            last = results[0]
            if not last.record.ok:   # the closed loop cannot go on without the output
                return

    def _trace_slice(self) -> list[TraceRequest]:
        assert self.trace is not None
        n = self.run_cfg.num_requests
        return self.trace[:n] if n is not None else list(self.trace)

    async def _trace_level(self, lvl: _Level, concurrency: int, reqs: list[TraceRequest]) -> None:
        if self.run_cfg.request_rate is not None:
            arrivals = poisson_arrivals(len(reqs), self.run_cfg.request_rate, self.run_cfg.seed)
        else:
            arrivals = [r.arrival_s for r in reqs]
        sem = asyncio.Semaphore(concurrency)

        async def one(req: TraceRequest) -> None:
            async with sem:
                if lvl.expired():
                    return
                payload = single_prompt(self.run_cfg.prompt_format, self.codec, req.prompt_token_ids)
                await self._send(lvl, payload, req.output_tokens, req.session_id, 0, 0)

        tasks = []
        for req, at in zip(reqs, arrivals):
            delay = lvl.start + at - time.perf_counter()
            if lvl.start + at >= lvl.deadline:
                break
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(req)))
        await asyncio.gather(*tasks)
