"""Static hashing analysis: sessions spread by a hash over replicas, no time involved.

With a uniform hash, the number of sessions on one replica is Binomial(N, 1/R) for N sessions
on R replicas, close to Poisson(N/R). Its variance equals its mean whatever the scale, so the
share of nearly idle replicas (<= 1 session) and of overloaded ones (>= 12) does not shrink as
the fleet grows: at 5 sessions per replica, about 4% and 0.5% (the seed's 'scale does not save
unlucky hashing').

``hash_counts`` places sessions with the router's own ``session_hash`` policy (rendezvous
hashing), so this checks the policy's uniformity as much as it reproduces the arithmetic.
"""
from __future__ import annotations

import math
import random
from collections.abc import Iterable
from typing import NamedTuple

import numpy as np

from tokenmill.router.policies import ReplicaView, RequestMeta, make_policy


class StaticHashResult(NamedTuple):
    sessions: int
    replicas: int
    seeds: int
    mean: float
    variance: float              # across replicas, averaged over seeds
    var_over_mean: float
    frac_le_1: float             # over all (seed, replica) cells
    frac_ge_12: float
    binomial_le_1: float
    binomial_ge_12: float
    poisson_le_1: float
    poisson_ge_12: float

    def to_dict(self) -> dict[str, float | int]:
        return self._asdict()


def hash_counts(num_sessions: int, num_replicas: int, seed: int, policy: str = "session_hash") -> np.ndarray:
    """Sessions per replica when ``num_sessions`` fresh session ids are routed by ``policy``.

    Session ids are random (fixed by ``seed``), like the UUIDs agents send; replicas are
    ``r000 .. r{R-1}``; every replica looks idle, so only the hash decides.
    """
    if num_sessions < 0 or num_replicas < 1:
        raise ValueError(f"need sessions >= 0 and replicas >= 1, got {num_sessions}, {num_replicas}")
    pol = make_policy(policy, seed=seed) if policy in ("random", "session_hash") else make_policy(policy)
    views = [ReplicaView(f"r{j:03d}", True, 0) for j in range(num_replicas)]
    index = {v.id: j for j, v in enumerate(views)}
    rng = random.Random(f"static-hash:{seed}")
    counts = np.zeros(num_replicas, dtype=np.int64)
    for _ in range(num_sessions):
        sid = f"{rng.getrandbits(128):032x}"
        counts[index[pol.choose(RequestMeta(sid, None, None, 0.0), views).replica_id]] += 1
    return counts


def binomial_tails(n: int, p: float, low: int = 1, high: int = 12) -> tuple[float, float]:
    """P(X <= low) and P(X >= high) for X ~ Binomial(n, p)."""
    pmf = [math.comb(n, k) * p**k * (1 - p) ** (n - k) for k in range(n + 1)]
    return float(sum(pmf[: low + 1])), float(sum(pmf[high:]))


def poisson_tails(lam: float, low: int = 1, high: int = 12) -> tuple[float, float]:
    """P(X <= low) and P(X >= high) for X ~ Poisson(lam)."""
    pmf = [math.exp(-lam) * lam**k / math.factorial(k) for k in range(high)]
    return float(sum(pmf[: low + 1])), float(1.0 - sum(pmf))


def static_hash_analysis(num_sessions: int = 250, num_replicas: int = 50, seeds: Iterable[int] = range(200),
                         policy: str = "session_hash") -> StaticHashResult:
    """Monte-Carlo spread of sessions over replicas under ``policy``, beside the analytic tails."""
    rows = [hash_counts(num_sessions, num_replicas, s, policy) for s in seeds]
    if not rows:
        raise ValueError("need at least one seed")
    counts = np.stack(rows)
    mean = float(counts.mean())
    var = float(counts.var(axis=1).mean())
    b_le, b_ge = binomial_tails(num_sessions, 1.0 / num_replicas)
    p_le, p_ge = poisson_tails(num_sessions / num_replicas)
    return StaticHashResult(num_sessions, num_replicas, len(rows), mean, var, var / mean if mean else 0.0,
                            float((counts <= 1).mean()), float((counts >= 12).mean()), b_le, b_ge, p_le, p_ge)
