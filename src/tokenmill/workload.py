"""Workloads: closed-loop agentic sessions and Mooncake trace replay (below bench and sim).

Pure and deterministic: no I/O except :func:`load_mooncake_trace`, no torch, no httpx. Shared by
``tokenmill bench`` (which sends the requests to a real server) and ``tokenmill sim`` (which
feeds them to simulated replicas). All randomness comes from ``seed`` through string-seeded
``random.Random`` instances, so a session, a turn or a trace block is the same whatever order
it is generated in.

The closed loop (turn T's prompt = turn T-1's prompt + the output really returned + turn T's
new tokens) is run by the caller, because only the caller knows the real output::

    prompt = first_prompt(config, script)
    for turn in script.turns:
        if turn.index > 0:
            wait(turn.think_time_s)
            prompt = next_prompt(prompt, output_ids, turn.new_token_ids)
        output_ids = send(prompt, max_tokens=turn.output_tokens)   # + turn.parallel_requests - 1 branches

Turn 0's new tokens are the session's own first block (after the shared system prompt).
"""
from __future__ import annotations

import json
import math
import random
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from functools import cached_property, lru_cache
from pathlib import Path
from typing import NamedTuple

# Token ids drawn by default: above the special/byte tokens of common 32k-50k vocabularies.
DEFAULT_VOCAB_LOW = 1000
DEFAULT_VOCAB_HIGH = 30000


def _rng(*key: object) -> random.Random:
    """A generator seeded from a tuple of ints/strings (stable across processes and versions)."""
    return random.Random(":".join(str(k) for k in key))


def random_token_ids(n: int, vocab_low: int, vocab_high: int, *key: object) -> tuple[int, ...]:
    """``n`` token ids in ``[vocab_low, vocab_high)``, fixed by ``key``."""
    rng = _rng(*key)
    return tuple(rng.randrange(vocab_low, vocab_high) for _ in range(n))


@dataclass(frozen=True)
class LogNormal:
    """A lognormal distribution given by its median (seconds) and the sigma of its log."""

    median_s: float
    sigma: float

    def __post_init__(self) -> None:
        if self.median_s < 0 or not math.isfinite(self.median_s):
            raise ValueError(f"median_s must be finite and >= 0, got {self.median_s}")
        if self.sigma < 0 or not math.isfinite(self.sigma):
            raise ValueError(f"sigma must be finite and >= 0, got {self.sigma}")

    def sample(self, rng: random.Random) -> float:
        if self.median_s == 0:
            return 0.0
        return self.median_s * math.exp(self.sigma * rng.gauss(0.0, 1.0))

    @property
    def mean_s(self) -> float:
        return self.median_s * math.exp(self.sigma**2 / 2)


@dataclass(frozen=True)
class AgenticWorkloadConfig:
    """Shape of a closed-loop agentic workload. Defaults are scaled to a 2-core CPU.

    - ``turns_per_session``: turns of every session, or the maximum when
      ``min_turns_per_session`` is set (then each session draws uniformly in [min, max]).
    - ``first_turn_tokens``: the session's own first block (after the shared system prompt).
    - ``new_tokens_per_turn``: tokens appended at each later turn (tool result or user message).
    - ``output_tokens_per_turn``: ``max_tokens`` of each request.
    - ``shared_prompt_tokens``: a system prompt identical across all sessions (0: none).
    - tool think time (between a response and the next tool-result turn) ~ lognormal
      (``tool_think_median_s``, ``tool_think_sigma``); with probability ``user_turn_probability``
      a later turn is a user turn instead, with think time ~ lognormal(``user_think_*``).
      Every think time is multiplied by ``think_time_scale`` and capped at ``max_think_s``.
    - ``thick_session_fraction`` of the sessions send ``thick_session_parallel`` concurrent
      requests per turn (same history, distinct ``branch_tokens``-long suffixes); the first one's
      output continues the history.
    """

    num_sessions: int = 16
    turns_per_session: int = 4
    min_turns_per_session: int | None = None
    first_turn_tokens: int = 256
    new_tokens_per_turn: int = 64
    output_tokens_per_turn: int = 16
    shared_prompt_tokens: int = 64
    tool_think_median_s: float = 0.1
    tool_think_sigma: float = 0.8
    user_turn_probability: float = 0.1
    user_think_median_s: float = 2.0
    user_think_sigma: float = 0.7
    think_time_scale: float = 1.0
    max_think_s: float = 30.0
    thick_session_fraction: float = 0.0
    thick_session_parallel: int = 2
    branch_tokens: int = 8
    seed: int = 0
    vocab_low: int = DEFAULT_VOCAB_LOW
    vocab_high: int = DEFAULT_VOCAB_HIGH

    def __post_init__(self) -> None:
        positive = ("num_sessions", "turns_per_session", "first_turn_tokens", "output_tokens_per_turn",
                    "thick_session_parallel")
        for name in positive:
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("new_tokens_per_turn", "shared_prompt_tokens", "branch_tokens", "vocab_low"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.min_turns_per_session is not None and not 1 <= self.min_turns_per_session <= self.turns_per_session:
            raise ValueError(f"min_turns_per_session must be in [1, turns_per_session={self.turns_per_session}], "
                             f"got {self.min_turns_per_session}")
        for name in ("user_turn_probability", "thick_session_fraction"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"{name} must be in [0, 1], got {getattr(self, name)}")
        for name in ("think_time_scale", "max_think_s"):
            if getattr(self, name) < 0 or not math.isfinite(getattr(self, name)):
                raise ValueError(f"{name} must be finite and >= 0, got {getattr(self, name)}")
        if self.vocab_high <= self.vocab_low:
            raise ValueError(f"vocab_high ({self.vocab_high}) must be > vocab_low ({self.vocab_low})")
        if self.thick_session_parallel > 1 and self.thick_session_fraction > 0 and self.branch_tokens < 1:
            raise ValueError("thick sessions need branch_tokens >= 1 so their parallel prompts differ")
        # validate the distributions now rather than at sampling time
        self.tool_think, self.user_think  # noqa: B018

    @property
    def tool_think(self) -> LogNormal:
        return LogNormal(self.tool_think_median_s, self.tool_think_sigma)

    @property
    def user_think(self) -> LogNormal:
        return LogNormal(self.user_think_median_s, self.user_think_sigma)

    @classmethod
    def production(cls, **overrides: object) -> AgenticWorkloadConfig:
        """Production shape: about 100k input and 500 output tokens at turn 30 (ratio ~200:1).

        Turn t (0-based) has 5000 + 10000 + t * (500 + 2430) planned input tokens: 99,970 at t=29.
        Tool calls take ~0.5 s (lognormal tail to minutes), 10% of turns wait for a user (~30 s).
        """
        base: dict[str, object] = dict(
            num_sessions=64, turns_per_session=30, first_turn_tokens=10000, new_tokens_per_turn=2430,
            output_tokens_per_turn=500, shared_prompt_tokens=5000, tool_think_median_s=0.5,
            tool_think_sigma=1.2, user_turn_probability=0.1, user_think_median_s=30.0,
            user_think_sigma=1.5, max_think_s=3600.0, vocab_high=100000,
        )
        base.update(overrides)
        return cls(**base)  # type: ignore[arg-type]

    def planned_input_tokens(self, turn_index: int) -> int:
        """Prompt length of turn ``turn_index`` when every output has its planned length."""
        if turn_index < 0:
            raise ValueError("turn_index must be >= 0")
        step = self.output_tokens_per_turn + self.new_tokens_per_turn
        return self.shared_prompt_tokens + self.first_turn_tokens + turn_index * step

    def describe(self) -> dict[str, object]:
        """A JSON-able description (for results files)."""
        from dataclasses import asdict

        return {"kind": "agentic", **asdict(self)}


@dataclass(frozen=True)
class Turn:
    """One turn of a session script.

    ``think_time_s`` is the pause between the end of the previous turn's response and this
    turn's request (0 for turn 0). ``is_user_turn``: the new tokens are a user message (turn 0
    always is) rather than a tool result. ``parallel_requests`` > 1 for thick sessions.
    Token ids are generated lazily (``new_token_ids``, ``branch_suffix``) so that the
    simulator can use the lengths alone.
    """

    session_index: int
    index: int
    num_new_tokens: int
    output_tokens: int
    think_time_s: float
    is_user_turn: bool
    parallel_requests: int
    seed: int
    vocab_low: int
    vocab_high: int
    branch_tokens: int = 0

    @cached_property
    def new_token_ids(self) -> tuple[int, ...]:
        return random_token_ids(self.num_new_tokens, self.vocab_low, self.vocab_high,
                                "turn", self.seed, self.session_index, self.index)

    def branch_suffix(self, branch: int) -> tuple[int, ...]:
        """Extra tokens that make parallel request ``branch`` (1..parallel_requests-1) distinct."""
        if not 1 <= branch < self.parallel_requests:
            raise ValueError(f"branch must be in [1, {self.parallel_requests}), got {branch}")
        return random_token_ids(self.branch_tokens, self.vocab_low, self.vocab_high,
                                "branch", self.seed, self.session_index, self.index, branch)


@dataclass(frozen=True)
class SessionScript:
    """A session: its id (sent as ``X-Session-ID``), shared system prompt and turns."""

    index: int
    session_id: str
    shared_prompt_ids: tuple[int, ...]
    turns: tuple[Turn, ...]

    @property
    def num_turns(self) -> int:
        return len(self.turns)

    @property
    def is_thick(self) -> bool:
        return any(t.parallel_requests > 1 for t in self.turns)


@lru_cache(maxsize=32)  # configs are frozen; the simulator builds thousands of sessions per config
def shared_prompt_ids(config: AgenticWorkloadConfig) -> tuple[int, ...]:
    """The system prompt shared by every session of this seed."""
    return random_token_ids(config.shared_prompt_tokens, config.vocab_low, config.vocab_high,
                            "shared", config.seed)


def make_session(config: AgenticWorkloadConfig, index: int) -> SessionScript:
    """Session number ``index`` (any int >= 0; not bounded by ``num_sessions``), fixed by seed."""
    if index < 0:
        raise ValueError(f"session index must be >= 0, got {index}")
    rng = _rng("session", config.seed, index)
    if config.min_turns_per_session is None:
        n_turns = config.turns_per_session
    else:
        n_turns = rng.randint(config.min_turns_per_session, config.turns_per_session)
    thick = config.thick_session_parallel > 1 and rng.random() < config.thick_session_fraction
    parallel = config.thick_session_parallel if thick else 1
    turns = []
    for t in range(n_turns):
        if t == 0:
            is_user, think = True, 0.0
        else:
            is_user = rng.random() < config.user_turn_probability
            dist = config.user_think if is_user else config.tool_think
            think = min(dist.sample(rng) * config.think_time_scale, config.max_think_s)
        turns.append(Turn(
            session_index=index, index=t,
            num_new_tokens=config.first_turn_tokens if t == 0 else config.new_tokens_per_turn,
            output_tokens=config.output_tokens_per_turn, think_time_s=think, is_user_turn=is_user,
            parallel_requests=parallel, seed=config.seed, vocab_low=config.vocab_low,
            vocab_high=config.vocab_high, branch_tokens=config.branch_tokens if parallel > 1 else 0,
        ))
    return SessionScript(index=index, session_id=f"bench-{config.seed}-{index}",
                         shared_prompt_ids=shared_prompt_ids(config), turns=tuple(turns))


def make_sessions(config: AgenticWorkloadConfig, start: int = 0, count: int | None = None) -> list[SessionScript]:
    """Sessions ``start .. start+count-1`` (``count`` defaults to ``config.num_sessions``)."""
    count = config.num_sessions if count is None else count
    return [make_session(config, i) for i in range(start, start + count)]


def first_prompt(script: SessionScript) -> list[int]:
    """Turn 0's prompt: the shared system prompt then the session's first block."""
    return [*script.shared_prompt_ids, *script.turns[0].new_token_ids]


def next_prompt(previous_prompt: Sequence[int], output_token_ids: Sequence[int],
                new_token_ids: Sequence[int]) -> list[int]:
    """Closed loop: the next turn's prompt is the whole history plus the new tokens."""
    return [*previous_prompt, *output_token_ids, *new_token_ids]


def branch_prompt(prompt: Sequence[int], turn: Turn, branch: int) -> list[int]:
    """Prompt of parallel request ``branch`` (>= 1) of a thick turn: shared history + suffix."""
    return [*prompt, *turn.branch_suffix(branch)]


# ----------------------------------------------------------------------------- Mooncake traces

MOONCAKE_BLOCK_TOKENS = 512


class TraceRecord(NamedTuple):
    """One line of a Mooncake-format trace (lengths in the trace's own 512-token blocks)."""

    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


def parse_mooncake_line(line: str, lineno: int = 0) -> TraceRecord:
    try:
        obj = json.loads(line)
        rec = TraceRecord(float(obj["timestamp"]), int(obj["input_length"]), int(obj["output_length"]),
                          tuple(int(h) for h in obj["hash_ids"]))
    except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
        raise ValueError(f"line {lineno}: not a Mooncake trace record ({e}): {line[:120]!r}") from None
    if rec.input_length < 1 or rec.output_length < 0 or not rec.hash_ids:
        raise ValueError(f"line {lineno}: bad lengths or empty hash_ids: {line[:120]!r}")
    return rec


def load_mooncake_trace(path: str | Path, limit: int | None = None) -> list[TraceRecord]:
    """Read a Mooncake JSONL trace (``timestamp`` ms, ``input_length``, ``output_length``,
    ``hash_ids``). Raises ValueError naming the first bad line."""
    records: list[TraceRecord] = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            records.append(parse_mooncake_line(line, lineno))
            if limit is not None and len(records) >= limit:
                break
    if not records:
        raise ValueError(f"{path}: no trace records")
    return records


@dataclass(frozen=True)
class TraceReplayConfig:
    """How a trace is replayed.

    - ``block_tokens``: each 512-token block becomes this many tokens (the tail block is scaled
      in proportion, at least 1 token).
    - ``time_scale``: arrival times are multiplied by it (2.0 = twice as slow).
    - ``output_scale``: output lengths are multiplied by it (None: block_tokens / 512), then
      clamped to [``min_output_tokens``, ``max_output_tokens``].
    """

    block_tokens: int = 16
    time_scale: float = 1.0
    output_scale: float | None = None
    min_output_tokens: int = 1
    max_output_tokens: int | None = 64
    seed: int = 0
    vocab_low: int = DEFAULT_VOCAB_LOW
    vocab_high: int = DEFAULT_VOCAB_HIGH

    def __post_init__(self) -> None:
        if self.block_tokens < 1:
            raise ValueError(f"block_tokens must be >= 1, got {self.block_tokens}")
        if not (self.time_scale >= 0 and math.isfinite(self.time_scale)):
            raise ValueError(f"time_scale must be finite and >= 0, got {self.time_scale}")
        if self.output_scale is not None and not (self.output_scale >= 0 and math.isfinite(self.output_scale)):
            raise ValueError(f"output_scale must be finite and >= 0, got {self.output_scale}")
        if self.min_output_tokens < 1:
            raise ValueError("min_output_tokens must be >= 1")
        if self.max_output_tokens is not None and self.max_output_tokens < self.min_output_tokens:
            raise ValueError("max_output_tokens must be >= min_output_tokens")
        if self.vocab_high <= self.vocab_low or self.vocab_low < 0:
            raise ValueError(f"need 0 <= vocab_low < vocab_high, got [{self.vocab_low}, {self.vocab_high})")

    def describe(self) -> dict[str, object]:
        from dataclasses import asdict

        return {"kind": "trace", **asdict(self)}


@dataclass(frozen=True)
class TraceRequest:
    """A trace record made concrete: arrival time (s), prompt token ids and output length.

    ``session_id`` groups a request with the earlier request whose whole prompt (all its full
    blocks) it extends: the trace has no session ids, so this is inferred from prefixes.
    """

    index: int
    arrival_s: float
    prompt_token_ids: tuple[int, ...]
    output_tokens: int
    hash_ids: tuple[int, ...]
    session_id: str


class BlockTokens:
    """Maps a hash id to its deterministic block of ``block_tokens`` token ids (memoised)."""

    def __init__(self, block_tokens: int, seed: int = 0, vocab_low: int = DEFAULT_VOCAB_LOW,
                 vocab_high: int = DEFAULT_VOCAB_HIGH) -> None:
        self.block_tokens, self.seed = block_tokens, seed
        self.vocab_low, self.vocab_high = vocab_low, vocab_high
        self._memo: dict[int, tuple[int, ...]] = {}

    def __call__(self, hash_id: int) -> tuple[int, ...]:
        block = self._memo.get(hash_id)
        if block is None:
            block = random_token_ids(self.block_tokens, self.vocab_low, self.vocab_high, "block", self.seed, hash_id)
            self._memo[hash_id] = block
        return block


def scaled_prompt_length(record: TraceRecord, block_tokens: int) -> int:
    """Prompt length after rescaling 512-token blocks to ``block_tokens`` (tail in proportion)."""
    n = len(record.hash_ids)
    tail = record.input_length - MOONCAKE_BLOCK_TOKENS * (n - 1)
    tail = min(max(tail, 1), MOONCAKE_BLOCK_TOKENS)
    tail_scaled = min(block_tokens, max(1, round(tail * block_tokens / MOONCAKE_BLOCK_TOKENS)))
    return (n - 1) * block_tokens + tail_scaled


def chain_hashes(keys: Iterable[object]) -> list[int]:
    """Prefix hashes: element i identifies keys[0..i] (Python's tuple hash of ints is stable)."""
    out: list[int] = []
    h = 0
    for k in keys:
        h = hash((h, k))
        out.append(h)
    return out


def trace_requests(records: Sequence[TraceRecord], config: TraceReplayConfig) -> list[TraceRequest]:
    """Turn trace records into concrete requests. Shared hash ids give identical token blocks,
    so requests sharing their first k ids share exactly their first k*block_tokens tokens."""
    blocks = BlockTokens(config.block_tokens, config.seed, config.vocab_low, config.vocab_high)
    out_scale = config.block_tokens / MOONCAKE_BLOCK_TOKENS if config.output_scale is None else config.output_scale
    t0 = min(r.timestamp_ms for r in records)
    full_prefix_session: dict[int, str] = {}   # chain hash of a request's full blocks -> session
    requests = []
    for i, rec in enumerate(records):
        length = scaled_prompt_length(rec, config.block_tokens)
        tokens: list[int] = []
        for h in rec.hash_ids:
            tokens.extend(blocks(h))
        tokens = tokens[:length]
        chain = chain_hashes(rec.hash_ids)
        session = None
        for k in range(len(chain), 1, -1):   # longest earlier full prompt (>= 2 blocks) extended
            session = full_prefix_session.get(chain[k - 1])
            if session is not None:
                break
        if session is None:
            session = f"trace-{config.seed}-{i}"
        full = len(chain) if rec.input_length >= MOONCAKE_BLOCK_TOKENS * len(chain) else len(chain) - 1
        if full >= 2:
            full_prefix_session[chain[full - 1]] = session
        out = max(config.min_output_tokens, round(rec.output_length * out_scale))
        if config.max_output_tokens is not None:
            out = min(out, config.max_output_tokens)
        requests.append(TraceRequest(i, (rec.timestamp_ms - t0) / 1000.0 * config.time_scale, tuple(tokens),
                                     out, rec.hash_ids, session))
    return requests


def poisson_arrivals(n: int, rate_per_s: float, seed: int = 0) -> list[float]:
    """``n`` open-loop arrival times (s, first at 0) with exponential gaps of mean 1/rate."""
    if rate_per_s <= 0 or not math.isfinite(rate_per_s):
        raise ValueError(f"request rate must be finite and > 0, got {rate_per_s}")
    rng = _rng("poisson", seed)
    t, out = 0.0, []
    for i in range(n):
        if i:
            t += rng.expovariate(rate_per_s)
        out.append(t)
    return out


# ----------------------------------------------------------------------------- theoretical CHR

class CacheHitStats(NamedTuple):
    cached_tokens: int
    prompt_tokens: int

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


@dataclass
class InfinitePrefixCache:
    """An infinite prefix cache over token ids, matched in whole blocks of ``block_size`` tokens
    (1 = token level). ``observe`` looks a prompt up, then inserts prompt + output, like a
    server that caches the full sequence when a request finishes."""

    block_size: int = 1
    _seen: set[int] = field(default_factory=set)

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")

    def _block_chain(self, tokens: Sequence[int]) -> list[int]:
        b = self.block_size
        return chain_hashes(tuple(tokens[i:i + b]) for i in range(0, len(tokens) - len(tokens) % b, b))

    def lookup(self, tokens: Sequence[int]) -> int:
        """Cached prefix length in tokens (a multiple of block_size)."""
        n = 0
        for h in self._block_chain(tokens):
            if h not in self._seen:
                break
            n += 1
        return n * self.block_size

    def insert(self, tokens: Sequence[int]) -> None:
        self._seen.update(self._block_chain(tokens))

    def observe(self, prompt: Sequence[int], output: Sequence[int] = ()) -> int:
        hit = self.lookup(prompt)
        self.insert([*prompt, *output] if output else prompt)
        return hit

    def clear(self) -> None:
        self._seen.clear()


def theoretical_hit_rate(prompts: Iterable[Sequence[int]], block_size: int = 1,
                         outputs: Iterable[Sequence[int]] | None = None) -> CacheHitStats:
    """Best cache hit rate of an infinite cache over prompts served in order (token lists)."""
    cache = InfinitePrefixCache(block_size)
    outs = iter(outputs) if outputs is not None else None
    cached = total = 0
    for p in prompts:
        cached += cache.observe(p, next(outs) if outs is not None else ())
        total += len(p)
    return CacheHitStats(cached, total)


class HashIdHitStats(NamedTuple):
    cached_blocks: int
    total_blocks: int
    cached_tokens: int
    prompt_tokens: int

    @property
    def block_hit_rate(self) -> float:
        return self.cached_blocks / self.total_blocks if self.total_blocks else 0.0

    @property
    def token_hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


def theoretical_hit_rate_hash_ids(records: Iterable[TraceRecord],
                                  block_tokens: int = MOONCAKE_BLOCK_TOKENS) -> HashIdHitStats:
    """Infinite-cache hit rate of a trace at block level and token level.

    A block hits when the request's chain of hash ids up to and including it was seen before.
    Token level counts ``block_tokens`` per hit block, except the tail block which counts its
    (rescaled) partial length; prompt tokens are the rescaled prompt lengths.
    """
    seen: set[int] = set()
    cb = tb = ct = pt = 0
    for rec in records:
        chain = chain_hashes(rec.hash_ids)
        length = scaled_prompt_length(rec, block_tokens)
        hits = 0
        for h in chain:
            if h not in seen:
                break
            hits += 1
        cb += hits
        tb += len(chain)
        ct += min(hits * block_tokens, length)
        pt += length
        seen.update(chain)
    return HashIdHitStats(cb, tb, ct, pt)
