"""What a simulation run records, and how it is summarised, written and plotted.

Load dispersion is measured the way the seed does it: at each sample time, the load of every
replica (in-flight requests, sessions with a request in flight, sessions homed there); the
variance and mean across replicas are taken per snapshot and averaged over snapshots, so
``var_over_mean`` is the cross-replica dispersion (1 for a Poisson spread), not a mix of
spatial and temporal variation. The tail fractions (load <= 1, >= 12) pool every
(replica, snapshot) sample.
"""
from __future__ import annotations

import csv
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

LOAD_METRICS = ("inflight", "active_sessions", "assigned_sessions")


class LoadStats(NamedTuple):
    mean: float
    variance: float
    var_over_mean: float
    frac_le_1: float
    frac_ge_12: float
    max: int
    samples: int

    def to_dict(self) -> dict[str, float | int]:
        return self._asdict()


def dispersion(snapshots: list[np.ndarray]) -> LoadStats:
    """Stats of per-replica loads, one array per snapshot (see the module docstring)."""
    snaps = [s for s in snapshots if len(s)]
    if not snaps:
        return LoadStats(0.0, 0.0, 0.0, 0.0, 0.0, 0, 0)
    means = np.array([s.mean() for s in snaps])
    variances = np.array([s.var() for s in snaps])
    pooled = np.concatenate(snaps)
    mean = float(means.mean())
    var = float(variances.mean())
    return LoadStats(mean, var, var / mean if mean > 0 else 0.0, float((pooled <= 1).mean()),
                     float((pooled >= 12).mean()), int(pooled.max()), int(pooled.size))


def percentiles(values: list[float] | np.ndarray) -> dict[str, float]:
    a = np.asarray(values, dtype=float)
    if a.size == 0:
        return {"p50": float("nan"), "p90": float("nan"), "p99": float("nan"), "mean": float("nan")}
    p50, p90, p99 = np.percentile(a, [50, 90, 99])
    return {"p50": float(p50), "p90": float(p90), "p99": float(p99), "mean": float(a.mean())}


@dataclass
class ScaleRecord:
    """One change of the fleet size and how many live sessions it moved.

    ``live_sessions``: sessions that had sent a request and not ended at the event.
    ``observed``: those of them that sent another request before the run ended; ``moved``:
    those whose next request went to a replica other than their home (the replica of their
    last request that the policy did not split off: decision kinds ``split`` and ``retry``
    send one request away without re-homing the session).
    """

    time_s: float
    delta: int
    source: str
    replicas_before: int
    replicas_after: int
    live_sessions: int = 0
    observed: int = 0
    moved: int = 0
    pending: dict[str, str] = field(default_factory=dict, repr=False)

    def to_dict(self) -> dict[str, Any]:
        return {"time_s": self.time_s, "delta": self.delta, "source": self.source,
                "replicas_before": self.replicas_before, "replicas_after": self.replicas_after,
                "live_sessions": self.live_sessions, "observed_sessions": self.observed,
                "moved_sessions": self.moved,
                "moved_fraction": self.moved / self.observed if self.observed else None}


@dataclass
class Recorder:
    """Samples and finished requests after the warm-up."""

    warmup_s: float
    sample_times: list[float] = field(default_factory=list)
    rows: list[tuple[float, str, int, int, int]] = field(default_factory=list)
    snapshots: dict[str, list[np.ndarray]] = field(default_factory=lambda: {m: [] for m in LOAD_METRICS})
    # finished requests: arrival, ttft, e2e, prompt, cached, output, replica
    requests: list[tuple[float, float, float, int, int, int, str]] = field(default_factory=list)
    rejected: int = 0
    output_tokens_in_window: int = 0
    prompt_tokens_in_window: int = 0
    cached_tokens_in_window: int = 0

    def sample(self, t: float, loads: list[tuple[str, int, int, int]]) -> None:
        """``loads``: (replica id, in-flight requests, active sessions, assigned sessions)."""
        self.sample_times.append(t)
        for rid, a, b, c in loads:
            self.rows.append((t, rid, a, b, c))
        for i, m in enumerate(LOAD_METRICS):
            self.snapshots[m].append(np.fromiter((row[i + 1] for row in loads), dtype=np.int64, count=len(loads)))

    def finished(self, arrival: float, ttft: float, e2e: float, prompt: int, cached: int, output: int,
                 replica: str, t_finish: float) -> None:
        if t_finish >= self.warmup_s:
            self.output_tokens_in_window += output
        if arrival >= self.warmup_s:
            self.requests.append((arrival, ttft, e2e, prompt, cached, output, replica))
            self.prompt_tokens_in_window += prompt
            self.cached_tokens_in_window += cached


def summarise(rec: Recorder, duration_s: float, final_replicas: int) -> dict[str, Any]:
    window = duration_s - rec.warmup_s
    reqs = np.array([(r[1], r[2]) for r in rec.requests], dtype=float).reshape(-1, 2)
    tpot = [(r[2] - r[1]) / (r[5] - 1) for r in rec.requests if r[5] > 1]
    prompt = rec.prompt_tokens_in_window
    return {
        "load": {m: dispersion(rec.snapshots[m]).to_dict() for m in LOAD_METRICS},
        "ttft_s": percentiles(reqs[:, 0]),
        "e2e_s": percentiles(reqs[:, 1]),
        "tpot_s": percentiles(tpot),
        "chr": rec.cached_tokens_in_window / prompt if prompt else 0.0,
        "requests_finished": len(rec.requests),
        "requests_rejected": rec.rejected,
        "throughput": {
            "output_tokens_per_s": rec.output_tokens_in_window / window,
            "prompt_tokens_per_s": prompt / window,
            "uncached_prompt_tokens_per_s": (prompt - rec.cached_tokens_in_window) / window,
            "requests_per_s": len(rec.requests) / window,
        },
        "window_s": [rec.warmup_s, duration_s],
        "replicas_final": final_replicas,
    }


def write_outputs(out_dir: str | Path, rec: Recorder, summary: dict[str, Any]) -> list[Path]:
    """summary.json, load.csv (per replica over time), requests.csv, load_hist.png."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / "summary.json", out / "load.csv", out / "requests.csv", out / "load_hist.png"]
    paths[0].write_text(json.dumps(summary, indent=2, default=_json_default) + "\n", encoding="utf-8")
    with open(paths[1], "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(["t_s", "replica", "inflight", "active_sessions", "assigned_sessions"])
        for t, rid, a, b, c in rec.rows:
            w.writerow([f"{t:.3f}", rid, a, b, c])
    with open(paths[2], "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(["arrival_s", "ttft_s", "e2e_s", "prompt_tokens", "cached_tokens", "output_tokens", "replica"])
        for r in rec.requests:
            w.writerow([f"{r[0]:.4f}", f"{r[1]:.5f}", f"{r[2]:.5f}", r[3], r[4], r[5], r[6]])
    plot_load_histogram(rec, summary, paths[3])
    return paths


def plot_load_histogram(rec: Recorder, summary: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, metric, label in ((axes[0], "inflight", "in-flight requests"),
                              (axes[1], "active_sessions", "sessions with a request in flight")):
        snaps = rec.snapshots[metric]
        pooled = np.concatenate(snaps) if snaps else np.zeros(0, dtype=np.int64)
        top = int(pooled.max()) if pooled.size else 1
        ax.hist(pooled, bins=np.arange(-0.5, top + 1.5, 1.0), density=True, color="#4477aa")
        st = summary["load"][metric]
        ax.set_title(f"{label}\nmean {st['mean']:.2f}, var/mean {st['var_over_mean']:.2f}, "
                     f"<=1: {st['frac_le_1']:.1%}, >=12: {st['frac_ge_12']:.2%}", fontsize=9)
        ax.set_xlabel("per-replica load")
        ax.set_ylabel("fraction of replica-samples")
    cfg = summary.get("config", {})
    fig.suptitle(f"policy {cfg.get('policy', '?')}, {cfg.get('replicas', '?')} replicas, "
                 f"{cfg.get('sessions', '?')} sessions", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _json_default(o: object) -> object:
    if isinstance(o, (np.integer,)):
        return int(o)
    if isinstance(o, (np.floating,)):
        return float(o)
    if isinstance(o, tuple):
        return list(o)
    raise TypeError(f"not JSON-serialisable: {type(o).__name__}")
