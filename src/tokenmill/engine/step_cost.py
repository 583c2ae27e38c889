"""How long a step takes, learned online, and the prefill budget that keeps decodes moving.

Every prefill token in a step that also carries decodes delays those decodes' next token. The
scheduler therefore gives prefill chunks only as many tokens as keep the step within
``slowdown`` times the time of the decodes alone (see :class:`PrefillBound`).

A step is described by two numbers (:class:`StepShape`): its token rows, and the query-key pairs
its attention reads, ``sum over scheduled requests of n * start + n * (n + 1) / 2`` for ``n``
tokens from position ``start`` (a decode reads its whole context; a chunk of ``n`` after ``c``
cached tokens reads about ``n * (c + n / 2)``). The model is

    seconds = a + b * rows + c * pairs

fitted by exponentially weighted least squares over recent steps (older steps fade with
``decay``), with ``b`` and ``c`` kept non-negative (a slope the noise makes negative is dropped
and the fit redone without it). Rows carry the weight matmuls; pairs carry attention, which is
what makes a chunk after a long cached context cost more than the same chunk at the start of a
prompt.

Steps come in kinds with different lines. Packed int4/int8 weights run steps of at most
``split_rows`` rows through the integer decode kernels (one native call per step) and larger
steps through dequantize + GEMM, whose fixed cost (the dequantization) is several decode steps:
a line through both would be wrong for both. With ``split_rows`` set, each kind has its own fit,
and the bound picks the largest chunk that keeps the step within the bound in either kind (a
mixed step that fits in ``split_rows`` rows usually stays within it; one just past it does not).

Some kernels handle token rows in groups (``row_group``: the amx set's wide tile layout, 16 rows),
so the first rows of a new group cost what the whole group costs, a staircase the straight line
does not see. With ``row_group`` set, a chunk that would end a few rows into a new group (past the
first) is cut back to end on the last whole group (to nothing, when the step's rows so far end
there; a step's first chunk keeps ``min_tokens``).

Until a kind's fit is trustworthy (``min_samples`` effective observations with some spread),
the budget is ``warmup_tokens``, or with ``split_rows`` what keeps the step in the small kind
(while the decodes leave room in it; else ``warmup_tokens``). A kind whose fit is not known while
the other's is gets up to ``warmup_tokens`` of chunk into it, so that it is measured: with
decodes always running, a kind seen only in prefill-only steps would otherwise never be entered
again. Warm-up chunks alternate between all of their room and half of it, so that the fit sees
rows that vary. A fit that has had a spread in rows keeps its last slopes when the rows stop
varying (one decode beside a long prompt's small chunks: every step the same rows), and its
level follows the recent steps.

Pure Python and no I/O: the engine feeds it wall time; the simulator can feed it modelled time.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Iterable, NamedTuple, Protocol


# Defaults of the lone cap and the prefill hold where steps of one row are a kind of their own
# (packed int4/int8 weights: EngineConfig.decode_slowdown_lone / prefill_hold_below left unset).
# On the default int4 model they took the Mooncake replay's TPOT p50 at c = 4 from 2.3x-2.7x to
# 1.7x-2.0x TPOT alone at level throughput, with agent sessions level to better (two runs of three
# better); at fp32 the hold was level on TPOT p50 and cost some TTFT, so fp32 keeps both off
# (docs/benchmarks.md, thirty-sixth landing).
PACKED_LONE_SLOWDOWN = 2.0
PACKED_HOLD_BELOW = 16


class _Scheduled(Protocol):
    start: int
    num_tokens: int


class StepShape(NamedTuple):
    """What a step's time is modelled on: token rows and attention query-key pairs."""

    rows: int
    pairs: int

    @classmethod
    def of(cls, scheduled: Iterable[_Scheduled]) -> "StepShape":
        rows = pairs = 0
        for s in scheduled:
            rows += s.num_tokens
            pairs += chunk_pairs(s.start, s.num_tokens)
        return cls(rows, pairs)


def chunk_pairs(start: int, n: int) -> int:
    """Query-key pairs of ``n`` causal query rows from position ``start`` (row i sees start + i + 1)."""
    return n * start + n * (n + 1) // 2


class _Fit:
    """Exponentially weighted least squares of ``y`` on ``(1, x1, x2)`` with non-negative slopes.

    ``flat``: ``x1`` may never vary (a kind of steps that all have the same rows); the fit is then
    ``y`` on ``(1, x2)``, or the mean of ``y`` without spread in ``x2`` either."""

    __slots__ = ("decay", "flat", "w", "s1", "s2", "sy", "s11", "s12", "s22", "s1y", "s2y", "_coef", "_slopes")

    def __init__(self, decay: float, flat: bool = False) -> None:
        self.decay = decay
        self.flat = flat
        self.w = self.s1 = self.s2 = self.sy = 0.0
        self.s11 = self.s12 = self.s22 = self.s1y = self.s2y = 0.0
        self._coef: tuple[float, float, float] | None | bool = False   # False: not solved yet
        self._slopes: tuple[float, float] | None = None   # (b, c) of the last fit with a spread in x1

    def add(self, x1: float, x2: float, y: float) -> None:
        d = self.decay
        self.w = self.w * d + 1.0
        self.s1 = self.s1 * d + x1
        self.s2 = self.s2 * d + x2
        self.sy = self.sy * d + y
        self.s11 = self.s11 * d + x1 * x1
        self.s12 = self.s12 * d + x1 * x2
        self.s22 = self.s22 * d + x2 * x2
        self.s1y = self.s1y * d + x1 * y
        self.s2y = self.s2y * d + x2 * y
        self._coef = False

    def coef(self, min_samples: float) -> tuple[float, float, float] | None:
        """``(a, b, c)``, or None while the observations cannot define ``b`` (too few, no spread)."""
        if self._coef is False:
            self._coef = self._solve() if self.w >= min_samples else None
        return self._coef  # type: ignore[return-value]

    def _solve(self) -> tuple[float, float, float] | None:
        w = self.w
        m1, m2, my = self.s1 / w, self.s2 / w, self.sy / w
        v11 = self.s11 / w - m1 * m1
        v22 = self.s22 / w - m2 * m2
        v12 = self.s12 / w - m1 * m2
        c1 = self.s1y / w - m1 * my
        c2 = self.s2y / w - m2 * my
        ok1 = v11 > 1e-9 * max(1.0, m1 * m1)
        ok2 = v22 > 1e-9 * max(1.0, m2 * m2)
        if not ok1:
            if not self.flat:
                if self._slopes is None:
                    return None    # every step had the same rows: no line in rows yet
                # the rows stopped varying (their old spread faded below the threshold): the
                # slopes stay as last measured and the level follows the recent steps, rather
                # than the kind falling back to its warm-up (after about 430 steps of one decode
                # and a 2-token chunk, every step then filled the small kind again)
                b, c = self._slopes
                return my - b * m1 - c * m2, b, c
            c = c2 / v22 if ok2 and c2 > 0.0 else 0.0
            return my - c * m2, 0.0, c
        best: tuple[float, float] | None = None
        best_gain = -math.inf      # explained variance; the largest feasible one wins
        det = v11 * v22 - v12 * v12
        if ok2 and det > 1e-9 * v11 * v22:
            b = (c1 * v22 - c2 * v12) / det
            c = (c2 * v11 - c1 * v12) / det
            if b >= 0.0 and c >= 0.0:
                best, best_gain = (b, c), b * c1 + c * c2
        if best is None:
            for b, c, gain in ((c1 / v11, 0.0, c1 * c1 / v11),
                               ((0.0, c2 / v22, c2 * c2 / v22) if ok2 else (0.0, 0.0, -math.inf))):
                if b >= 0.0 and c >= 0.0 and gain > best_gain:
                    best, best_gain = (b, c), gain
        b, c = best if best is not None else (0.0, 0.0)
        self._slopes = (b, c)
        return my - b * m1 - c * m2, b, c


class TokenLine:
    """An exponentially weighted line ``seconds = a + b * tokens`` (the speculative decoder's cost
    of decode-only steps); ``fit`` gives ``(a, b)`` once ``min_samples`` steps of different sizes
    were seen."""

    def __init__(self, decay: float = 0.95, min_samples: float = 3.0) -> None:
        if not 0.0 < decay < 1.0:
            raise ValueError(f"decay must be in (0, 1), got {decay}")
        self.min_samples = min_samples
        self._fit = _Fit(decay)

    def observe(self, num_tokens: int, seconds: float) -> None:
        if num_tokens > 0 and seconds > 0.0:
            self._fit.add(float(num_tokens), 0.0, float(seconds))

    def fit(self) -> tuple[float, float] | None:
        f = self._fit.coef(self.min_samples)
        return None if f is None else (f[0], f[1])

    def predict(self, num_tokens: int) -> float | None:
        f = self.fit()
        return None if f is None else f[0] + f[1] * num_tokens


@dataclass
class StepCost:
    slowdown: float = 2.0          # a mixed step may take this many times the decodes-only step
    finish_slowdown: float | None = None   # ... or this many, when that completes a prefill
    lone_slowdown: float | None = None     # ... and at most this many times a lone decode step
    lone_min_prefill: int = 128    # ... for chunks of prefills with more uncached tokens than this
    hold_below: int = 0            # such a prefill waits rather than take a chunk below this (0: off)
    hold_steps: int = 32           # ... for at most this many steps in all (see Scheduler)
    min_tokens: int = 1            # the first prefill chunk of a step gets at least this many
    warmup_tokens: int = 64        # budget before the fit is trustworthy (no split_rows)
    decay: float = 0.95            # weight kept by each older observation (of the same kind)
    min_samples: float = 3.0       # effective observations needed before trusting a kind's fit
    split_rows: int | None = None  # steps of at most this many rows are a kind of their own
    single_row: bool = False       # ... and so are steps of one row (see StepCost.kind)
    row_group: int = 1             # rows the kernels handle together: chunks end on whole groups
    _fits: list[_Fit] = field(init=False, repr=False)
    _warm_half: bool = field(default=False, init=False, repr=False)   # alternates warm-up chunk sizes

    def __post_init__(self) -> None:
        if not self.slowdown > 1.0:
            raise ValueError(f"slowdown must be > 1, got {self.slowdown}")
        if self.finish_slowdown is not None and not self.finish_slowdown >= self.slowdown:
            raise ValueError(f"finish_slowdown must be >= slowdown ({self.slowdown}) or None, "
                             f"got {self.finish_slowdown}")
        if self.lone_slowdown is not None and not self.lone_slowdown > 1.0:
            raise ValueError(f"lone_slowdown must be > 1 or None, got {self.lone_slowdown}")
        if self.lone_min_prefill < 0:
            raise ValueError(f"lone_min_prefill must be >= 0, got {self.lone_min_prefill}")
        if self.hold_below < 0 or self.hold_steps < 0:
            raise ValueError(f"hold_below and hold_steps must be >= 0, got {self.hold_below}, {self.hold_steps}")
        if self.min_tokens < 1 or self.warmup_tokens < 1:
            raise ValueError("min_tokens and warmup_tokens must be >= 1")
        if not 0.0 < self.decay < 1.0:
            raise ValueError(f"decay must be in (0, 1), got {self.decay}")
        if self.split_rows is not None and self.split_rows < 1:
            raise ValueError(f"split_rows must be >= 1 (or None), got {self.split_rows}")
        if self.row_group < 1:
            raise ValueError(f"row_group must be >= 1, got {self.row_group}")
        self._fits = [_Fit(self.decay), _Fit(self.decay), _Fit(self.decay, flat=True)]

    # -- the model --------------------------------------------------------------------------------
    def kind(self, rows: int) -> int:
        """0 for steps of at most ``split_rows`` rows (all steps without a split), else 1; with
        ``single_row``, 2 for a step of one row.

        A lone decode step is the reference of the bound (a stream's TPOT alone), and where its
        one row runs on other kernels than a few rows do (the packed kernels' one-row paths; the
        amx set's tiles from four rows), a line through 1 to ``split_rows`` rows misses it: fitted
        mostly on mixed steps and prefill chunks, it put a lone int4 decode step at 13-15 ms where
        it took 7-8 (docs/benchmarks.md, "A lone decode step as a kind of its own"), and the bound
        of a step with one decode was twice as loose as asked. One-row steps then have their own
        fit (on context alone: their rows never vary)."""
        if self.single_row and rows == 1:
            return 2
        return 0 if self.split_rows is None or rows <= self.split_rows else 1

    def observe(self, num_tokens: int, seconds: float, pairs: int = 0) -> None:
        """One finished step of ``num_tokens`` rows reading ``pairs`` query-key pairs."""
        if num_tokens <= 0 or not seconds > 0.0:
            return
        self._fits[self.kind(num_tokens)].add(float(num_tokens), float(pairs), float(seconds))

    def observe_step(self, scheduled: Iterable[_Scheduled], seconds: float) -> None:
        """One finished step, from its scheduled ``(start, num_tokens)`` entries."""
        shape = StepShape.of(scheduled)
        self.observe(shape.rows, seconds, shape.pairs)

    def fit(self, rows: int = 1) -> tuple[float, float, float] | None:
        """``(a, b, c)`` of the kind of a ``rows``-row step, or None while it is not known."""
        return self._fits[self.kind(rows)].coef(self.min_samples)

    def predict(self, rows: int, pairs: int = 0) -> float | None:
        f = self.fit(rows)
        return None if f is None else f[0] + f[1] * rows + f[2] * pairs

    # -- the bound --------------------------------------------------------------------------------
    def bound(self, num_decode_tokens: int, decode_pairs: int = 0) -> "PrefillBound":
        """The prefill bound of a step that already carries these decodes (see PrefillBound)."""
        return PrefillBound(self, num_decode_tokens, decode_pairs)

    def prefill_budget(self, num_decode_tokens: int, limit: int, *, decode_pairs: int = 0,
                       context: int = 0) -> int:
        """Tokens of one prefill chunk after ``context`` cached tokens that a step with these
        decodes may take (at most ``limit``, at least ``min(min_tokens, limit)``)."""
        return self.bound(num_decode_tokens, decode_pairs).cap(context, limit, first=True)


class PrefillBound:
    """The prefill tokens one step may still take, chunk by chunk.

    The step's decodes take ``T(d)`` seconds alone; every chunk added must keep the predicted
    step time within ``slowdown * T(d)``. ``cap(context, limit)`` is the largest next chunk
    after ``context`` cached tokens; ``add(context, n)`` records the chunk that was scheduled.
    With ``StepCost.lone_slowdown`` and two or more decodes, the target is also at most that many
    times a lone decode step at the decodes' mean context (a stream's TPOT alone): several
    decodes' own step can already be 2x a lone one's, and the plain bound multiplies that. That
    cap holds the chunks of long prefills only (more than ``StepCost.lone_min_prefill`` uncached
    tokens, given to :meth:`cap` as ``prefill_tokens``): an agent turn after a cache hit keeps the
    plain bound, since cutting it finer only lengthens its time to first token.

    The finishing exception (``StepCost.finish_slowdown``): a short prefill (:meth:`short`: its
    whole uncached part, done beside the decodes alone, keeps the step within
    ``finish_slowdown * T(d)``) whose remainder still fits this step (:meth:`finishes`) takes the
    remainder at once. Cutting such a prefill into bounded chunks does not
    shorten the decodes' total wait (they wait for the same prefill work, spread over more steps,
    each of which also pays the decode's own cost again); it only multiplies the prefill's time to
    first token by the number of chunks. An agent turn after a cache hit (tens of new tokens) is
    such a prefill; a long prompt is not, and is cut to its end (giving the exception to its tail
    too stalled the decodes once per long prompt: Mooncake replay, TPOT p50 +27% at 6x). A short
    one keeps the exception after a bounded first chunk (another prefill took the step's room).
    """

    def __init__(self, cost: StepCost, num_decode_tokens: int, decode_pairs: int) -> None:
        self.cost = cost
        self.rows = num_decode_tokens
        self.pairs = decode_pairs
        self._decode_rows, self._decode_pairs = num_decode_tokens, decode_pairs
        self.added = 0
        alone = cost.predict(num_decode_tokens, decode_pairs)
        self.target = None if alone is None else cost.slowdown * max(alone, 0.0)
        self.lone_target = self.target   # the target of a long prefill's chunks (see lone_slowdown)
        if self.target is not None and cost.lone_slowdown is not None and num_decode_tokens > 1:
            # the lone cap: a stream's TPOT beside others is held to a multiple of its TPOT alone
            # (one decode step at these decodes' mean context), not of the several decodes' step
            lone = cost.predict(1, decode_pairs // num_decode_tokens)
            if lone is not None:
                self.lone_target = min(self.target, cost.lone_slowdown * max(lone, 0.0))
        self.finish_target = (None if alone is None or cost.finish_slowdown is None
                              else cost.finish_slowdown * max(alone, 0.0))
        # warm-up allowance: tokens the step may take while the fit is not known: what keeps the
        # step in the small kind, or, when the decodes alone already fill it (nothing would be
        # left, every step would carry a 1-token chunk and the fit would never see the spread it
        # needs), the plain warm-up budget
        if cost.split_rows is not None and cost.split_rows > num_decode_tokens:
            # alternately all of the room and half of it: steps that always fill the small kind
            # to exactly split_rows rows give its fit no spread in rows, and it would never be known
            self.warmup = cost.split_rows - num_decode_tokens
            if self.target is None:
                if cost._warm_half and self.warmup > 1:
                    self.warmup //= 2
                cost._warm_half = not cost._warm_half
        else:
            self.warmup = cost.warmup_tokens

    def _fits(self, k: int, context: int, target: float | None = None) -> bool:
        rows = self.rows + k
        t = self.cost.predict(rows, self.pairs + chunk_pairs(context, k))
        if t is None:
            return False
        return t <= (self.target if target is None else target)  # type: ignore[operator]

    def finishes(self, context: int, n: int) -> bool:
        """Whether a prefill's whole remainder of ``n`` tokens after ``context`` may go in this
        step under the finishing exception (known fits only: never during warm-up)."""
        return self.finish_target is not None and n > 0 and self._fits(n, context, self.finish_target)

    def short(self, context: int, n: int) -> bool:
        """Whether a prefill of ``n`` tokens after ``context`` is short enough for the finishing
        exception: done whole beside this step's decodes alone, it keeps the looser bound."""
        if self.finish_target is None or n <= 0:
            return False
        t = self.cost.predict(self._decode_rows + n, self._decode_pairs + chunk_pairs(context, n))
        return t is not None and t <= self.finish_target

    def cap(self, context: int, limit: int, first: bool | None = None, prefill_tokens: int | None = None) -> int:
        """The largest chunk (<= ``limit``) after ``context`` cached tokens that keeps the bound;
        the step's first chunk gets at least ``min_tokens``. ``prefill_tokens``: the prefill's
        whole uncached part, where known (a long one's chunks keep the lone cap as well)."""
        if limit <= 0:
            return 0
        target = (self.lone_target if prefill_tokens is None or prefill_tokens > self.cost.lone_min_prefill
                  else self.target)
        first = self.added == 0 if first is None else first
        floor = min(self.cost.min_tokens, limit) if first else 0
        if self.target is None:
            return max(min(self.warmup - self.added, limit), floor)
        best = 0
        half, warming = self.cost._warm_half, False
        split = self.cost.split_rows
        ranges = [(1, limit)]
        if split is not None and self.rows < split < self.rows + limit:
            ranges = [(1, split - self.rows), (split - self.rows + 1, limit)]
        for lo, hi in ranges:
            if self.cost.fit(self.rows + lo) is None:
                # a kind not measured yet (e.g. GEMM steps while decodes always run): a warm-up's
                # worth of tokens into it, so that it gets measured, rather than never entering it;
                # in turns all of it and half of it, as in the plain warm-up: a kind entered with
                # the same chunk every time (the small kind's whole room beside one decode, while
                # the lone decode's own kind is known) gives its fit no spread in rows, and it
                # stayed unknown, every step filled to its last row
                room = min(hi, lo - 1 + max(self.cost.warmup_tokens - self.added, 0))
                if half and room - lo >= 1:
                    room = lo + (room - lo) // 2
                warming = True
                best = max(best, room)
                continue
            if self._fits(hi, context, target):
                best = max(best, hi)
                continue
            if not self._fits(lo, context, target):
                continue
            while lo < hi:   # largest k in [lo, hi] that fits; predictions grow with k
                mid = (lo + hi + 1) // 2
                if self._fits(mid, context, target):
                    lo = mid
                else:
                    hi = mid - 1
            best = max(best, lo)
        if warming:   # the next warm-up chunk takes the other size
            self.cost._warm_half = not half
        return max(self._whole_groups(best), floor)

    def _whole_groups(self, k: int) -> int:
        """``k`` cut back so that the step ends on a whole group of ``StepCost.row_group`` rows,
        when the cut leaves some of the chunk: the first rows of a new group cost what the whole
        group costs, and the fitted line, straight through the rows, does not see that."""
        g = self.cost.row_group
        total = self.rows + k
        if g <= 1 or k <= 0 or total <= g or total % g == 0:
            return k
        whole = total // g * g
        # whole < rows: the step's rows so far already end inside the chunk's last group
        return whole - self.rows if whole >= self.rows else k

    def add(self, context: int, n: int) -> None:
        self.rows += n
        self.pairs += chunk_pairs(context, n)
        self.added += n


STEP_SECONDS_BUCKETS = (0.005, 0.01, 0.02, 0.035, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
STEP_KINDS = ("decode", "mixed", "prefill")


def step_kind(scheduled: Iterable[Any]) -> str:
    """``decode`` (every request one token behind, drafts allowed), ``prefill`` (chunks only) or
    ``mixed``, for scheduled entries with ``num_tokens``, ``num_draft`` and ``samples``."""
    dec = pre = False
    for s in scheduled:
        if s.num_tokens - s.num_draft > 1 or not s.samples:
            pre = True
        else:
            dec = True
    return "mixed" if dec and pre else ("prefill" if pre else "decode")


class StepTimes:
    """Histograms of step wall time by kind of step (``/metrics``: ``engine_step_seconds``), so a
    user can see what a decode step costs alone and how much the prefill beside it adds."""

    def __init__(self, buckets: tuple[float, ...] = STEP_SECONDS_BUCKETS) -> None:
        self.buckets = buckets
        self.counts = {k: [0] * len(buckets) for k in STEP_KINDS}   # per bucket, not cumulative
        self.sums = dict.fromkeys(STEP_KINDS, 0.0)
        self.totals = dict.fromkeys(STEP_KINDS, 0)

    def observe(self, kind: str, seconds: float) -> None:
        self.totals[kind] += 1
        self.sums[kind] += seconds
        for i, b in enumerate(self.buckets):
            if seconds <= b:
                self.counts[kind][i] += 1
                break

    def snapshot(self) -> dict[str, tuple[list[int], float, int]]:
        """kind -> (cumulative counts per bucket, sum of seconds, count)."""
        out = {}
        for k in STEP_KINDS:
            cum, run = [], 0
            for n in self.counts[k]:
                run += n
                cum.append(run)
            out[k] = (cum, self.sums[k], self.totals[k])
        return out
