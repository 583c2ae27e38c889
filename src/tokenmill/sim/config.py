"""Configuration of one simulation run (validated dataclasses) and the scale-event syntax."""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from tokenmill.workload import AgenticWorkloadConfig, TraceRecord
from tokenmill.sim.profiles import ReplicaProfile


class ScaleEvent(NamedTuple):
    """At ``time_s``, add (``delta`` > 0) or drain and remove (``delta`` < 0) replicas."""

    time_s: float
    delta: int


class PopulationChange(NamedTuple):
    """From ``time_s`` on, keep ``sessions`` agent sessions running."""

    time_s: float
    sessions: int


_DURATION = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*(ms|s|m|min|h)?\s*$")


def parse_duration(text: str) -> float:
    """``"90"``, ``"90s"``, ``"15m"``, ``"1h"``, ``"250ms"`` -> seconds."""
    m = _DURATION.match(str(text))
    if not m:
        raise ValueError(f"not a duration: {text!r} (use e.g. 90, 90s, 15m, 1h)")
    value = float(m.group(1))
    unit = m.group(2) or "s"
    return value * {"ms": 1e-3, "s": 1.0, "m": 60.0, "min": 60.0, "h": 3600.0}[unit]


def parse_scale_event(text: str) -> ScaleEvent:
    """``"600:+5"`` or ``"10m:-3"`` -> ScaleEvent(600.0, 5)."""
    if ":" not in text:
        raise ValueError(f"scale event {text!r} must look like TIME:+K or TIME:-K (e.g. 600:+5)")
    when, delta = text.rsplit(":", 1)
    delta = delta.strip()
    if not re.fullmatch(r"[+-][0-9]+", delta):
        raise ValueError(f"scale event {text!r}: the change must be signed, like +5 or -3")
    k = int(delta)
    if k == 0:
        raise ValueError(f"scale event {text!r} changes nothing")
    return ScaleEvent(parse_duration(when), k)


def parse_population_change(text: str) -> PopulationChange:
    """``"600:300"`` -> from t=600 s keep 300 sessions running."""
    if ":" not in text:
        raise ValueError(f"session change {text!r} must look like TIME:SESSIONS (e.g. 600:300)")
    when, count = text.rsplit(":", 1)
    if not count.strip().isdigit():
        raise ValueError(f"session change {text!r}: SESSIONS must be a non-negative integer")
    return PopulationChange(parse_duration(when), int(count))


@dataclass(frozen=True)
class AutoscaleRule:
    """Target-concurrency autoscaling: every ``interval_s`` the fleet is resized to
    ``ceil(in-flight requests / target)`` replicas (clamped to [min, max]); new replicas take
    ``startup_s`` to come up, removed ones drain first. Scale-down waits until the wanted size
    has stayed below the current one for ``scale_down_delay_s``."""

    target: float
    interval_s: float = 30.0
    min_replicas: int = 1
    max_replicas: int = 1000
    startup_s: float = 60.0
    scale_down_delay_s: float = 300.0

    def __post_init__(self) -> None:
        if not self.target > 0:
            raise ValueError(f"autoscale target must be > 0, got {self.target}")
        if not self.interval_s > 0:
            raise ValueError("autoscale interval must be > 0")
        if not 1 <= self.min_replicas <= self.max_replicas:
            raise ValueError(f"need 1 <= min_replicas <= max_replicas, got {self.min_replicas}, {self.max_replicas}")
        if self.startup_s < 0 or self.scale_down_delay_s < 0:
            raise ValueError("startup_s and scale_down_delay_s must be >= 0")


@dataclass(frozen=True)
class SimConfig:
    """One run of the fleet simulator.

    - Workload: ``workload`` (closed-loop agent sessions, ``sessions`` of them running at once,
      changed by ``population_changes``) or ``trace`` (Mooncake records replayed open loop).
    - ``block_tokens``: cache resolution in tokens (None: a multiple of the profile's page size
      that keeps the longest planned prompt near 256 blocks; 512 for traces).
    - ``report_interval_s``: how stale the replicas' reported load is when the policy reads it
      (0: always fresh). The router's own in-flight counts are always exact.
    - ``warmup_s``: samples and requests before it are left out of the summary.
    - ``stationary_start``: the first sessions start at a random turn of their script (as if
      the fleet had been running), spread over the first ``start_spread_s``.
    """

    replicas: int
    profile: ReplicaProfile
    policy: str = "agentic"
    duration_s: float = 600.0
    sessions: int = 0
    workload: AgenticWorkloadConfig | None = None
    trace: tuple[TraceRecord, ...] | None = None
    trace_time_scale: float = 1.0
    policy_options: dict[str, Any] = field(default_factory=dict)
    scale_events: tuple[ScaleEvent, ...] = ()
    population_changes: tuple[PopulationChange, ...] = ()
    autoscale: AutoscaleRule | None = None
    sample_interval_s: float = 1.0
    warmup_s: float = 60.0
    report_interval_s: float = 0.0
    block_tokens: int | None = None
    session_retention_s: float = 60.0
    stationary_start: bool = True
    start_spread_s: float = 10.0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.replicas < 1:
            raise ValueError(f"need at least one replica, got {self.replicas}")
        if not (self.duration_s > 0 and math.isfinite(self.duration_s)):
            raise ValueError(f"duration must be finite and > 0, got {self.duration_s}")
        if (self.workload is None) == (self.trace is None):
            raise ValueError("give exactly one of workload (agent sessions) and trace")
        if self.workload is not None and self.sessions < 1:
            raise ValueError(f"agent sessions need sessions >= 1, got {self.sessions}")
        if self.trace is not None and not self.trace:
            raise ValueError("the trace is empty")
        if not self.sample_interval_s > 0:
            raise ValueError("sample_interval_s must be > 0")
        for name in ("warmup_s", "report_interval_s", "session_retention_s", "start_spread_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0")
        if self.warmup_s >= self.duration_s:
            raise ValueError(f"warmup ({self.warmup_s}s) must be shorter than the duration ({self.duration_s}s)")
        if self.block_tokens is not None and self.block_tokens < 1:
            raise ValueError("block_tokens must be >= 1")
        if self.trace is not None and self.block_tokens not in (None, 512):
            raise ValueError("a Mooncake trace names 512-token blocks: block_tokens must be 512 for traces")
        if not self.trace_time_scale > 0:
            raise ValueError("trace_time_scale must be > 0")
        if self.autoscale is not None and not self.autoscale.min_replicas <= self.replicas <= self.autoscale.max_replicas:
            raise ValueError("the initial replica count is outside the autoscaler's [min, max]")
        for ev in self.scale_events:
            if not 0 <= ev.time_s < self.duration_s:
                raise ValueError(f"scale event at {ev.time_s}s is outside the run [0, {self.duration_s})")
        for pc in self.population_changes:
            if pc.time_s < 0:
                raise ValueError("population changes need a time >= 0")

    def resolved_block_tokens(self) -> int:
        if self.block_tokens is not None:
            return self.block_tokens
        if self.trace is not None:
            return 512
        assert self.workload is not None
        page = self.profile.page_size
        longest = self.workload.planned_input_tokens(self.workload.turns_per_session - 1)
        longest += self.workload.output_tokens_per_turn
        return page * max(1, round(longest / 256 / page))
