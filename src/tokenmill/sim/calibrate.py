"""``tokenmill sim calibrate``: measure a running replica and fit a profile to it.

Procedure (all requests are ``/v1/completions`` with token-id prompts of fresh random tokens,
so nothing is served from the prefix cache):

1. **Capacity**: ``GET /v1/loads`` gives ``kv_pages_total``; times the page size (flag, the
   engine's default 16) that is the KV capacity in tokens.
2. **Prefill sweep**: one request at a time, prompt of ``n`` tokens, ``max_tokens=1``,
   streamed; the time to the first token is the prefill time of ``n`` uncached tokens plus the
   HTTP round trip (which the fitted ``fixed_s`` absorbs). Each ``n`` is measured ``repeats``
   times and the median kept.
3. **Decode sweep**: ``B`` concurrent streamed requests with a prompt of ``L`` tokens and
   ``max_tokens=M`` (``ignore_eos``). They start together and have the same length, so each
   decodes at batch ``B`` nearly all along: its time from first to last chunk over its tokens
   after the first (counted by the final usage chunk, since a chunk may carry several tokens)
   is one decode step at batch ``B`` and total context about ``B * (L + M/2)``; the median
   over the batch and ``repeats`` repetitions is kept.
4. **Fit**: non-negative least squares of the profile's two formulas (see ``profiles.py``) on
   those points. The prefill features follow the server's chunking (``max_prefill_tokens``).

The fit is pure (``fit_prefill``, ``fit_decode``); only ``measure`` does I/O.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from typing import Any, NamedTuple

import numpy as np

from tokenmill.utils.sse import iter_sse_json
from tokenmill.sim.profiles import DecodeModel, PrefillModel, ReplicaProfile


class PrefillPoint(NamedTuple):
    tokens: int
    seconds: float


class DecodePoint(NamedTuple):
    batch: int
    context_tokens: float
    step_s: float


def _nnls(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Least squares with x >= 0 (active-set: drop negative coefficients and refit)."""
    active = list(range(a.shape[1]))
    x = np.zeros(a.shape[1])
    while active:
        sol, *_ = np.linalg.lstsq(a[:, active], b, rcond=None)
        if (sol >= 0).all():
            x[:] = 0
            x[active] = sol
            return x
        active.pop(int(np.argmin(sol)))
    return x


def prefill_features(tokens: int, chunk: int) -> tuple[float, float, float]:
    """(number of chunks, tokens, sum over chunks of n*(x + n/2)) for a cold prefill."""
    k, x, ctx_term, left = 0, 0, 0.0, tokens
    while left > 0:
        n = min(chunk, left)
        ctx_term += n * (x + n / 2)
        x += n
        left -= n
        k += 1
    return float(k), float(tokens), ctx_term


def fit_prefill(points: list[PrefillPoint], chunk: int) -> PrefillModel:
    if len(points) < 3:
        raise ValueError(f"need at least 3 prefill points to fit, got {len(points)}")
    a = np.array([prefill_features(p.tokens, chunk) for p in points])
    b = np.array([p.seconds for p in points])
    x = _nnls(a, b)
    if not x.any():
        raise ValueError("prefill fit is all zeros: the measurements do not grow with the prompt")
    return PrefillModel(fixed_s=float(x[0]), per_token_s=float(x[1]), per_token_context_s=float(x[2]))


def fit_decode(points: list[DecodePoint]) -> DecodeModel:
    if len(points) < 3:
        raise ValueError(f"need at least 3 decode points to fit, got {len(points)}")
    a = np.array([(1.0, p.batch, p.context_tokens) for p in points])
    b = np.array([p.step_s for p in points])
    x = _nnls(a, b)
    if x[0] == 0 and x[1] == 0:
        raise ValueError("decode fit has no per-step cost: the measurements are inconsistent")
    return DecodeModel(fixed_s=float(x[0]), per_request_s=float(x[1]), per_context_token_s=float(x[2]))


def relative_errors(profile: ReplicaProfile, prefill: list[PrefillPoint], decode: list[DecodePoint]) -> dict[str, float]:
    """Median relative error of the fitted formulas on the measured points."""
    pe = [abs(profile.prefill.total_s(p.tokens, 0, profile.max_prefill_tokens) - p.seconds) / p.seconds
          for p in prefill if p.seconds > 0]
    de = [abs(profile.decode.step_s(p.batch, p.context_tokens) - p.step_s) / p.step_s for p in decode if p.step_s > 0]
    return {"prefill_median_rel_error": float(np.median(pe)) if pe else float("nan"),
            "decode_median_rel_error": float(np.median(de)) if de else float("nan")}


# ------------------------------------------------------------------------------ measuring

class Stream(NamedTuple):
    start: float
    chunk_times: list[float]
    tokens: int


class _Client:
    def __init__(self, base_url: str, model: str | None, api_key: str | None, timeout: float) -> None:
        import httpx

        self.base = base_url.rstrip("/")
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.http = httpx.AsyncClient(base_url=self.base, headers=headers, timeout=timeout)
        self.model = model

    async def get_json(self, path: str) -> Any:
        r = await self.http.get(path)
        if r.status_code != 200:
            raise RuntimeError(f"GET {self.base}{path} answered {r.status_code}: {r.text[:300]}")
        return r.json()

    async def stream_times(self, prompt: list[int], max_tokens: int) -> Stream:
        """Send a streamed completion; returns when it started, when each text chunk arrived and
        how many tokens it generated (from the final usage chunk: a chunk may carry several
        tokens, e.g. when a token ends inside a UTF-8 character)."""
        body = {"model": self.model, "prompt": prompt, "max_tokens": max_tokens, "stream": True,
                "stream_options": {"include_usage": True}, "temperature": 0.0, "ignore_eos": True}
        t0 = time.perf_counter()
        times: list[float] = []
        tokens = 0
        async with self.http.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code != 200:
                text = (await r.aread()).decode(errors="replace")
                raise RuntimeError(f"POST /v1/completions answered {r.status_code}: {text[:300]}")
            async for chunk in iter_sse_json(r):
                if chunk.get("choices") and chunk["choices"][0].get("text") is not None:
                    times.append(time.perf_counter())
                usage = chunk.get("usage")
                if usage:
                    tokens = int(usage.get("completion_tokens") or 0)
        return Stream(t0, times, tokens or len(times))

    async def close(self) -> None:
        await self.http.aclose()


class Measurements(NamedTuple):
    kv_pages_total: int
    model: str
    prefill: list[PrefillPoint]
    decode: list[DecodePoint]


async def measure(base_url: str, *, prefill_sizes: list[int], batch_sizes: list[int], decode_contexts: list[int],
                  decode_tokens: int, repeats: int = 2, model: str | None = None, api_key: str | None = None,
                  vocab: tuple[int, int] = (1000, 30000), seed: int = 0, timeout: float = 600.0,
                  log: Any = None) -> Measurements:
    """Run the sweeps of the module docstring against ``base_url``."""
    rng = random.Random(f"calibrate:{seed}")

    def fresh(n: int) -> list[int]:
        return [rng.randrange(*vocab) for _ in range(n)]

    client = _Client(base_url, model, api_key, timeout)
    try:
        models = await client.get_json("/v1/models")
        if client.model is None:
            client.model = models["data"][0]["id"]
        loads = await client.get_json("/v1/loads")
        if "kv_pages_total" not in loads:
            raise RuntimeError(f"{base_url}/v1/loads has no kv_pages_total: {loads}")
        await client.stream_times(fresh(8), 2)          # warm-up (first-call overheads)
        prefill: list[PrefillPoint] = []
        for n in prefill_sizes:
            samples = []
            for _ in range(repeats):
                st = await client.stream_times(fresh(n), 1)
                if not st.chunk_times:
                    raise RuntimeError(f"no token streamed back for a {n}-token prompt")
                samples.append(st.chunk_times[0] - st.start)
            prefill.append(PrefillPoint(n, statistics.median(samples)))
            if log:
                log(f"prefill {n:6d} tokens: {prefill[-1].seconds * 1e3:8.1f} ms")
        decode: list[DecodePoint] = []
        for ctx in decode_contexts:
            for b in batch_sizes:
                steps: list[float] = []
                for _ in range(repeats):
                    results = await asyncio.gather(*(client.stream_times(fresh(ctx), decode_tokens)
                                                     for _ in range(b)))
                    # the requests start together and have the same length, so each one decodes
                    # at batch b for nearly all of its stream: its mean time per token after the first
                    steps += [(st.chunk_times[-1] - st.chunk_times[0]) / (st.tokens - 1)
                              for st in results if len(st.chunk_times) >= 2 and st.tokens >= 2]
                if not steps:
                    raise RuntimeError(f"too few tokens streamed at batch {b}, context {ctx}")
                decode.append(DecodePoint(b, b * (ctx + decode_tokens / 2), statistics.median(steps)))
                if log:
                    log(f"decode batch {b:3d} context {ctx:6d}: {decode[-1].step_s * 1e3:8.2f} ms/step")
        return Measurements(int(loads["kv_pages_total"]), str(client.model), prefill, decode)
    finally:
        await client.close()


def build_profile(m: Measurements, *, name: str, page_size: int, max_running: int, max_prefill_tokens: int,
                  base_url: str, decode_slowdown: float | None = None,
                  prefill_finish_slowdown: float | None = None) -> ReplicaProfile:
    prefill = fit_prefill(m.prefill, max_prefill_tokens)
    decode = fit_decode(m.decode)
    profile = ReplicaProfile(
        name=name, prefill=prefill, decode=decode, kv_capacity_tokens=m.kv_pages_total * page_size,
        max_running_requests=max_running, page_size=page_size, max_prefill_tokens=max_prefill_tokens,
        decode_slowdown=decode_slowdown,
        prefill_finish_slowdown=prefill_finish_slowdown if decode_slowdown is not None else None,
        description=f"calibrated against {base_url} (model {m.model})", source="calibrated",
        assumptions=(
            "Prefill times are client-side time to first token of one request alone (HTTP included).",
            "Decode steps are the mean gap between streamed tokens while the whole batch decodes.",
            f"KV capacity = kv_pages_total ({m.kv_pages_total}) x page size ({page_size}) from /v1/loads.",
        ),
        measurements={"prefill": [p._asdict() for p in m.prefill], "decode": [p._asdict() for p in m.decode]},
    )
    errors = relative_errors(profile, m.prefill, m.decode)
    return ReplicaProfile.from_dict({**profile.to_dict(), "measurements": {**profile.measurements, **errors}})


def add_calibrate_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-url", required=True, help="a running tokenmill server, e.g. http://127.0.0.1:8000")
    p.add_argument("--out", required=True, help="profile JSON to write")
    p.add_argument("--name", default=None, help="profile name (default: calibrated-<model>)")
    p.add_argument("--model", default=None, help="model name to send (default: the first of /v1/models)")
    p.add_argument("--api-key", default=None)
    p.add_argument("--page-size", type=int, default=16, help="the server's KV page size (default 16)")
    p.add_argument("--max-running", type=int, default=64, help="the server's max running requests (default 64)")
    p.add_argument("--max-prefill-tokens", type=int, default=512,
                   help="the server's prefill chunk, i.e. max batch tokens (default 512)")
    p.add_argument("--decode-slowdown", type=float, default=None,
                   help="the server's bound on prefill while decodes run (tokenmill serve's "
                        "--decode-slowdown, 1.75 by default there); unset: no bound")
    p.add_argument("--prefill-finish-slowdown", type=float, default=None,
                   help="the server's --prefill-finish-slowdown (12 by default there) when --decode-slowdown "
                        "is set; unset: every chunk keeps the bound")
    p.add_argument("--prefill-sizes", default="32,128,256,512,1024,1536", help="comma-separated prompt lengths")
    p.add_argument("--batch-sizes", default="1,2,4,8", help="comma-separated decode batch sizes")
    p.add_argument("--decode-contexts", default="32,512", help="comma-separated prompt lengths for the decode sweep")
    p.add_argument("--decode-tokens", type=int, default=32, help="max_tokens of each decode request")
    p.add_argument("--repeats", type=int, default=3, help="repetitions of every measurement (median kept)")


def _int_list(text: str, what: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--{what} must be comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise ValueError(f"--{what} needs positive integers, got {text!r}")
    return values


def run_calibrate(args: argparse.Namespace) -> int:
    try:
        sizes = _int_list(args.prefill_sizes, "prefill-sizes")
        batches = _int_list(args.batch_sizes, "batch-sizes")
        contexts = _int_list(args.decode_contexts, "decode-contexts")
        if args.decode_tokens < 4:
            raise ValueError("--decode-tokens must be >= 4")
        if args.repeats < 1 or args.page_size < 1 or args.max_running < 1 or args.max_prefill_tokens < 1:
            raise ValueError("--repeats, --page-size, --max-running and --max-prefill-tokens must be >= 1")
        if args.decode_slowdown is not None and not args.decode_slowdown > 1.0:
            raise ValueError(f"--decode-slowdown must be > 1, got {args.decode_slowdown}")
        if args.prefill_finish_slowdown is not None and not args.prefill_finish_slowdown >= (args.decode_slowdown or 1.0):
            raise ValueError(f"--prefill-finish-slowdown must be >= --decode-slowdown, got {args.prefill_finish_slowdown}")
        m = asyncio.run(measure(args.base_url, prefill_sizes=sizes, batch_sizes=batches, decode_contexts=contexts,
                                decode_tokens=args.decode_tokens, repeats=args.repeats, model=args.model,
                                api_key=args.api_key, log=lambda s: print(s, file=sys.stderr)))
        profile = build_profile(m, name=args.name or f"calibrated-{m.model}", page_size=args.page_size,
                                max_running=args.max_running, max_prefill_tokens=args.max_prefill_tokens,
                                base_url=args.base_url, decode_slowdown=args.decode_slowdown,
                                prefill_finish_slowdown=args.prefill_finish_slowdown)
    except (ValueError, RuntimeError, OSError) as e:
        print(f"tokenmill sim calibrate: {e}", file=sys.stderr)
        return 2
    except Exception as e:  # httpx errors: connection refused, timeouts
        print(f"tokenmill sim calibrate: cannot measure {args.base_url}: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    profile.save(args.out)
    print(json.dumps({"out": args.out, "prefill": profile.prefill.__dict__, "decode": profile.decode.__dict__,
                      "kv_capacity_tokens": profile.kv_capacity_tokens,
                      **{k: v for k, v in profile.measurements.items() if k.endswith("error")}}, indent=2))
    return 0
