"""Replica performance profiles: what one simulated replica costs per step, and what it holds.

A profile is a small JSON document. The simulator reads four things from it:

- **prefill**: the time of one prefill chunk of ``n`` uncached tokens that starts at context
  position ``x`` (tokens already in the KV cache for that request)::

      prefill_chunk_s(n, x) = fixed_s + per_token_s * n + per_token_context_s * n * (x + n / 2)

  The last term is attention over the context: it makes a cold 100k-token prefill quadratic and
  a warm one (most of the prompt cached) nearly linear in the few new tokens.
- **decode**: the time of one decode step of a batch of ``B`` running requests whose contexts
  sum to ``C`` tokens, and how many tokens each request gains per step (1, or the mean accepted
  length with speculative decoding)::

      decode_step_s(B, C) = fixed_s + per_request_s * B + per_context_token_s * C

  A step that also carries prefill chunks costs ``decode_step_s`` plus the chunks (the prefill
  ``fixed_s`` once): this is how the batch enters the prefill time, and how prefill slows down
  the decodes beside it (``sim.replica.step_seconds``).
- **kv_capacity_tokens**: the KV pool, in tokens; ``page_size`` its page.
- **max_running_requests** and **max_prefill_tokens** (the engine's per-step token budget: the
  chunk size of chunked prefill, shared with the decodes of the step).
- **host_cache_tokens**, **storage_tokens**, **kv_bytes_per_token**, **host_bandwidth_gb_s**,
  **storage_bandwidth_gb_s**, **storage_latency_s** (optional, default off): the L2 host tier of
  each replica and the L3 storage tier shared by the whole fleet (``sim/tiers.py``); a page
  loaded from them costs its bytes over the tier's bandwidth (plus the storage latency once per
  admission) in the step that admits the request.
- **decode_slowdown** (optional): the engine's bound on prefill in steps that carry decodes
  (``EngineConfig.decode_slowdown``, learned from the modelled step times); None leaves it off.
  **prefill_finish_slowdown** (optional): its finishing exception
  (``EngineConfig.prefill_finish_slowdown``); None keeps every chunk within the bound.
  **decode_slowdown_lone** (optional): its cap relative to a lone decode step
  (``EngineConfig.decode_slowdown_lone``); None leaves it off.
  **prefill_hold_below** / **prefill_hold_steps** (optional): a long prompt waits for the
  decodes rather than take a smaller chunk, for at most that many steps
  (``EngineConfig.prefill_hold_below``, ``prefill_hold_steps``); 0 leaves it off.

The replica runs the engine's own scheduler (``sim/replica.py``), so what a step holds is the
engine's choice; the profile only says how long it takes.

Presets describe larger systems from published figures; each lists its assumptions in the
profile itself (``assumptions``), so a JSON dump of a preset documents where its numbers came
from. ``tokenmill sim calibrate`` measures a real server and writes a profile of the same shape.
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, NamedTuple


def _check_nonneg(owner: str, **values: float) -> None:
    for name, value in values.items():
        if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
            raise ValueError(f"{owner}.{name} must be a finite number >= 0, got {value!r}")


@dataclass(frozen=True)
class PrefillModel:
    """Time of one prefill chunk: ``fixed_s + per_token_s*n + per_token_context_s*n*(x + n/2)``."""

    fixed_s: float = 0.0
    per_token_s: float = 0.0
    per_token_context_s: float = 0.0

    def __post_init__(self) -> None:
        _check_nonneg("prefill", fixed_s=self.fixed_s, per_token_s=self.per_token_s,
                      per_token_context_s=self.per_token_context_s)
        if self.fixed_s == 0 and self.per_token_s == 0 and self.per_token_context_s == 0:
            raise ValueError("prefill model is all zeros: prefill would take no time")

    def chunk_s(self, n: float, context: float) -> float:
        """Seconds to prefill ``n`` tokens that start at position ``context``."""
        return self.fixed_s + n * (self.per_token_s + self.per_token_context_s * (context + n / 2))

    def total_s(self, uncached: int, cached: int, chunk: int) -> float:
        """Seconds to prefill ``uncached`` tokens after ``cached`` ones, alone, in chunks of ``chunk``."""
        t, x, left = 0.0, cached, uncached
        while left > 0:
            n = min(chunk, left)
            t += self.chunk_s(n, x)
            x += n
            left -= n
        return t


@dataclass(frozen=True)
class DecodeModel:
    """Time of one decode step: ``fixed_s + per_request_s*B + per_context_token_s*C``.

    ``tokens_per_step`` is the output tokens each request gains per step (mean accepted length
    under speculative decoding; 1 without it).
    """

    fixed_s: float = 0.0
    per_request_s: float = 0.0
    per_context_token_s: float = 0.0
    tokens_per_step: float = 1.0

    def __post_init__(self) -> None:
        _check_nonneg("decode", fixed_s=self.fixed_s, per_request_s=self.per_request_s,
                      per_context_token_s=self.per_context_token_s)
        if not (math.isfinite(self.tokens_per_step) and self.tokens_per_step >= 1.0):
            raise ValueError(f"decode.tokens_per_step must be >= 1, got {self.tokens_per_step!r}")
        if self.fixed_s == 0 and self.per_request_s == 0:
            raise ValueError("decode model needs fixed_s or per_request_s > 0: a step must take time")

    def step_s(self, batch: int, context_tokens: float) -> float:
        return self.fixed_s + self.per_request_s * batch + self.per_context_token_s * context_tokens

    def tokens_per_s_per_request(self, batch: int, context_tokens: float) -> float:
        """Interactivity: output tokens/s seen by each of ``batch`` requests."""
        return self.tokens_per_step / self.step_s(batch, context_tokens)


@dataclass(frozen=True)
class ReplicaProfile:
    """Everything the simulator needs to know about one replica (see the module docstring)."""

    name: str
    prefill: PrefillModel
    decode: DecodeModel
    kv_capacity_tokens: int
    max_running_requests: int
    page_size: int = 16
    max_prefill_tokens: int = 8192
    decode_slowdown: float | None = None
    prefill_finish_slowdown: float | None = None
    decode_slowdown_lone: float | None = None
    prefill_hold_below: int = 0
    prefill_hold_steps: int = 32
    # Lower cache tiers (sim/tiers.py): L2 host memory per replica, L3 storage shared by the fleet.
    host_cache_tokens: int = 0
    storage_tokens: int = 0
    kv_bytes_per_token: int = 0
    host_bandwidth_gb_s: float = 20.0
    storage_bandwidth_gb_s: float = 2.0
    storage_latency_s: float = 0.002
    interactivity_target_tok_s: float | None = None
    description: str = ""
    assumptions: tuple[str, ...] = ()
    source: str = "preset"
    measurements: dict[str, Any] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("profile needs a name")
        for attr in ("kv_capacity_tokens", "max_running_requests", "page_size", "max_prefill_tokens"):
            value = getattr(self, attr)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"profile.{attr} must be a positive integer, got {value!r}")
        if self.decode_slowdown is not None and not (
                isinstance(self.decode_slowdown, (int, float)) and math.isfinite(self.decode_slowdown)
                and self.decode_slowdown > 1.0):
            raise ValueError(f"profile.decode_slowdown must be > 1 (or null), got {self.decode_slowdown!r}")
        if self.prefill_finish_slowdown is not None and not (
                isinstance(self.prefill_finish_slowdown, (int, float)) and math.isfinite(self.prefill_finish_slowdown)
                and self.prefill_finish_slowdown >= (self.decode_slowdown or 1.0)):
            raise ValueError("profile.prefill_finish_slowdown must be >= decode_slowdown (or null), "
                             f"got {self.prefill_finish_slowdown!r}")
        if self.decode_slowdown_lone is not None and not (
                isinstance(self.decode_slowdown_lone, (int, float)) and math.isfinite(self.decode_slowdown_lone)
                and self.decode_slowdown_lone > 1.0):
            raise ValueError(f"profile.decode_slowdown_lone must be > 1 (or null), got {self.decode_slowdown_lone!r}")
        for name in ("prefill_hold_below", "prefill_hold_steps"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"profile.{name} must be an integer >= 0, got {v!r}")
        self.tier_profile()   # validates the tier fields
        if self.kv_capacity_tokens < self.page_size:
            raise ValueError(f"kv_capacity_tokens ({self.kv_capacity_tokens}) is below one page ({self.page_size})")
        if self.interactivity_target_tok_s is not None:
            _check_nonneg("profile", interactivity_target_tok_s=self.interactivity_target_tok_s)

    def tier_profile(self) -> Any:
        from tokenmill.sim.tiers import TierProfile

        return TierProfile(self.host_cache_tokens, self.storage_tokens, self.kv_bytes_per_token,
                           self.host_bandwidth_gb_s, self.storage_bandwidth_gb_s, self.storage_latency_s)

    # ------------------------------------------------------------------ JSON
    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["assumptions"] = list(self.assumptions)
        return d

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n", encoding="utf-8")

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ReplicaProfile:
        if not isinstance(d, dict):
            raise ValueError(f"a profile is a JSON object, got {type(d).__name__}")
        known = {f for f in cls.__dataclass_fields__}
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"unknown profile fields: {sorted(unknown)}")
        for required in ("name", "prefill", "decode", "kv_capacity_tokens", "max_running_requests"):
            if required not in d:
                raise ValueError(f"profile is missing {required!r}")
        kw = dict(d)
        try:
            kw["prefill"] = PrefillModel(**d["prefill"])
            kw["decode"] = DecodeModel(**d["decode"])
        except TypeError as e:
            raise ValueError(f"bad prefill/decode section: {e}") from None
        kw["assumptions"] = tuple(d.get("assumptions", ()))
        kw["measurements"] = dict(d.get("measurements", {}))
        return cls(**kw)

    @classmethod
    def load(cls, path: str | Path) -> ReplicaProfile:
        try:
            data = json.loads(Path(path).read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(f"cannot read profile {path}: {e}") from None
        return cls.from_dict(data)

    # ------------------------------------------------------------------ analysis
    def concurrency_limits(self, context_tokens: int, new_tokens: int = 0) -> ConcurrencyLimits:
        """How many concurrent sessions of ``context_tokens`` each one replica sustains.

        - ``kv_sessions``: sessions whose whole context fits in the KV pool at once (beyond it,
          a session's prefix is evicted between turns and recomputed: CHR collapses).
        - ``interactivity_sessions``: the largest batch of such requests whose per-request decode
          speed stays at or above ``interactivity_target_tok_s`` (inf without a target).
        """
        if context_tokens < 1:
            raise ValueError("context_tokens must be >= 1")
        kv = self.kv_capacity_tokens / context_tokens
        if self.interactivity_target_tok_s is None or self.interactivity_target_tok_s == 0:
            inter = math.inf
        else:
            # tokens_per_step / (fixed + B * (per_request + per_ctx * ctx)) >= target
            budget = self.decode.tokens_per_step / self.interactivity_target_tok_s - self.decode.fixed_s
            per_b = self.decode.per_request_s + self.decode.per_context_token_s * context_tokens
            inter = max(0.0, budget / per_b) if per_b > 0 else math.inf
        cold = self.prefill.total_s(context_tokens, 0, self.max_prefill_tokens)
        warm = self.prefill.total_s(new_tokens, context_tokens - new_tokens, self.max_prefill_tokens) if new_tokens else 0.0
        return ConcurrencyLimits(kv, inter, min(kv, inter), cold, warm)


class ConcurrencyLimits(NamedTuple):
    kv_sessions: float
    interactivity_sessions: float
    sessions: float                # the smaller of the two
    cold_prefill_s: float          # the whole context prefilled from nothing, alone on the replica
    warm_prefill_s: float          # only the last new_tokens prefilled, the rest cached


# ---------------------------------------------------------------------------------- presets

_KIMI_COMMON = (
    "Model: Kimi K2.6 (1.04T params, 32B active, MLA, 61 layers) with NVFP4 weights: 595 GB of weights.",
    "Replica: 4x B200 (180 GB HBM, ~8 TB/s each) with tensor parallelism 4: 720 GB HBM, about 125 GB "
    "left for KV after weights, i.e. 31.3 GB per GPU (seed, TP table). MLA's latent KV is replicated on "
    "every TP rank, so each GPU holds every token's KV.",
    "Decode step = fixed 12 ms (non-expert weights, 122 all-reduces, the DFlash draft model) + 3 ms per "
    "request in the batch (the extra expert weights that each request's ~8 verified tokens touch, about "
    "10% of 125 GB of experts per GPU at ~5.6 TB/s achieved) + the KV read of every context token "
    "(bytes per token / 5.6 TB/s).",
    "Speculative decoding: DFlash fine-tuned on coding traces accepts 5.84 tokens per step (seed).",
    "Prefill: 64 GFLOP per token for the 32B active params at 4 x 9 PFLOP/s NVFP4 and 45% utilisation "
    "(4.4 us/token), plus MLA attention at ~2.5 MFLOP per token per context token in BF16 "
    "(4 x 2.25 PFLOP/s, 45%: 6.2e-10 s per token per context token). A cold 100k-token prefill "
    "takes ~3.5 s; a warm turn (2.9k new tokens on a 100k context) ~0.2 s.",
    "Interactivity target: 150 output tokens/s per user (assumed; the seed gives the ordering, not the "
    "number). With it, the decode limit is ~6 sessions of 100k tokens and the KV limit ~4.5: the seed's "
    "'about 4 users at ~100k-token inputs on TP4, performance collapses past ~6'.",
    "Page size 64 tokens; chunked prefill of 16k tokens; at most 32 running requests (KV binds first).",
)

_PRESETS: dict[str, dict[str, Any]] = {
    "kimi-k2.6-b200-tp4": dict(
        name="kimi-k2.6-b200-tp4",
        description="Kimi K2.6 NVFP4 on one 4x B200 TP4 replica with BF16 KV (seed, 'optimise one replica').",
        prefill=dict(fixed_s=0.005, per_token_s=4.4e-6, per_token_context_s=6.2e-10),
        decode=dict(fixed_s=0.012, per_request_s=0.003, per_context_token_s=72e3 / 5.6e12, tokens_per_step=5.84),
        kv_capacity_tokens=450_000, max_running_requests=32, page_size=64, max_prefill_tokens=16384,
        interactivity_target_tok_s=150.0, kv_bytes_per_token=72_000,
        assumptions=_KIMI_COMMON + (
            "KV in BF16: 576 elements x 2 bytes x 61 layers = 72 KB per token; 31.3 GB / 72 KB = 0.45M "
            "tokens per replica (seed, TP4 row).",
        ),
    ),
    "kimi-k2.6-b200-tp4-l3": dict(
        name="kimi-k2.6-b200-tp4-l3",
        description="As kimi-k2.6-b200-tp4 with a host-RAM tier per replica and a storage tier shared "
                    "by the fleet (the seed's HiCache set-up).",
        prefill=dict(fixed_s=0.005, per_token_s=4.4e-6, per_token_context_s=6.2e-10),
        decode=dict(fixed_s=0.012, per_request_s=0.003, per_context_token_s=72e3 / 5.6e12, tokens_per_step=5.84),
        kv_capacity_tokens=450_000, max_running_requests=32, page_size=64, max_prefill_tokens=16384,
        interactivity_target_tok_s=150.0, kv_bytes_per_token=72_000,
        host_cache_tokens=6_000_000, storage_tokens=500_000_000,
        host_bandwidth_gb_s=50.0, storage_bandwidth_gb_s=20.0, storage_latency_s=0.002,
        assumptions=_KIMI_COMMON + (
            "KV in BF16: 72 KB per token, 0.45M tokens in HBM per replica.",
            "L2: 432 GB of host RAM per replica (half of a B200 node's ~1 TB less the OS and weights' "
            "staging) = 6M tokens, loaded over PCIe Gen5 at ~50 GB/s per GPU (each TP rank loads the "
            "replicated latent in parallel).",
            "L3: a shared store (Redis / a distributed KV store over RDMA) of 36 TB = 500M tokens, read "
            "at ~20 GB/s per replica with 2 ms latency per admission.",
        ),
    ),
    "kimi-k2.6-b200-tp4-fp8kv": dict(
        name="kimi-k2.6-b200-tp4-fp8kv",
        description="As kimi-k2.6-b200-tp4 with FP8 KV (seed: 'doubles the cache capacity in tokens').",
        prefill=dict(fixed_s=0.005, per_token_s=4.4e-6, per_token_context_s=6.2e-10),
        decode=dict(fixed_s=0.012, per_request_s=0.003, per_context_token_s=36e3 / 5.6e12, tokens_per_step=5.84),
        kv_capacity_tokens=900_000, max_running_requests=32, page_size=64, max_prefill_tokens=16384,
        interactivity_target_tok_s=150.0, kv_bytes_per_token=36_000,
        assumptions=_KIMI_COMMON + (
            "KV in FP8: 36 KB per token, 0.9M tokens per replica; the KV read per step halves.",
        ),
    ),
    "smollm2-135m-cpu2": dict(
        name="smollm2-135m-cpu2",
        description="SmolLM2-135M-Instruct in fp32 on this 2-core CPU (tokenmill serve defaults).",
        prefill=dict(fixed_s=0.01, per_token_s=4.5e-3, per_token_context_s=1.0e-6),
        decode=dict(fixed_s=0.060, per_request_s=0.004, per_context_token_s=2.0e-6, tokens_per_step=1.0),
        kv_capacity_tokens=65_536, max_running_requests=64, page_size=16, max_prefill_tokens=512,
        decode_slowdown=2.0, interactivity_target_tok_s=5.0, kv_bytes_per_token=46_080,
        assumptions=(
            "Decode of fp32 weights (540 MB) at ~8.6 GB/s memory bandwidth: ~62 ms per step at batch 1, "
            "i.e. ~16 tokens/s (PEERS.md: vLLM CPU reaches this bound).",
            "Prefill ~200 tokens/s at 1k tokens (PEERS.md, vLLM CPU fp32): ~4.5 ms per token plus attention.",
            "KV: 30 layers x 3 KV heads x 64 x 2 x 4 bytes = 46 KB per token; 3 GiB of KV = 65k tokens.",
            "Page size 16, chunked prefill of 512 tokens, 64 running requests, prefill bounded to keep a "
            "decode step within 2x while decodes run (EngineConfig defaults).",
        ),
    ),
    "tiny-random-cpu": dict(
        name="tiny-random-cpu",
        description="The tests' tiny random-weight Llama (hidden 64, 2 layers, vocab 49152) served by "
                    "`tokenmill serve` on this 2-core CPU; measured with `tokenmill sim calibrate`.",
        prefill=dict(fixed_s=0.00445, per_token_s=1.8e-5, per_token_context_s=0.0),
        decode=dict(fixed_s=0.00158, per_request_s=0.00105, per_context_token_s=0.0, tokens_per_step=1.0),
        kv_capacity_tokens=16_384, max_running_requests=64, page_size=16, max_prefill_tokens=512,
        decode_slowdown=2.0, interactivity_target_tok_s=None,
        assumptions=(
            "Fitted by `tokenmill sim calibrate` (prompts 32..1536 tokens, batches 1..8, 3 repeats) on a "
            "replica sharing the machine with a second one being calibrated at the same time, under a load "
            "average of ~13 on 2 cores from other processes; median fit errors 23% (prefill), 19% (decode).",
            "Five calibrations on this shared machine gave decode steps of 1.5-6 ms at batch 1 and 7-24 ms "
            "at batch 8, and 1536-token prefills of 36-195 ms: treat these numbers as good to a factor 2-4.",
            "Valid for prompts up to ~1.5k tokens (the measured range); the context terms came out as 0.",
            "KV: `tokenmill serve` default pool for this model, 1024 pages x 16 tokens; 2 layers x 2 KV heads "
            "x 16 x 2 (K, V) x 4 bytes = 512 B per token.",
        ),
    ),
}


def preset_names() -> list[str]:
    return sorted(_PRESETS)


def get_preset(name: str) -> ReplicaProfile:
    try:
        return ReplicaProfile.from_dict(dict(_PRESETS[name], source="preset"))
    except KeyError:
        raise ValueError(f"unknown profile preset {name!r}; presets: {', '.join(preset_names())}") from None


def load_profile(name_or_path: str) -> ReplicaProfile:
    """A preset by name, or a profile JSON file by path."""
    if name_or_path in _PRESETS:
        return get_preset(name_or_path)
    path = Path(name_or_path)
    if path.suffix == ".json" or path.exists():
        if not path.exists():
            raise ValueError(f"profile file {path} does not exist")
        return ReplicaProfile.load(path)
    raise ValueError(f"{name_or_path!r} is neither a profile preset ({', '.join(preset_names())}) nor a JSON file")
