"""Routing policies: pure code that picks a replica for a request.

The live router (``tokenmill route``) and the fleet simulator (``tokenmill sim``) call the same
objects, so a policy does no I/O, starts no tasks and reads no clock: time comes in
``RequestMeta.now`` (wall time in the router, simulated time in the simulator). Given the same
calls in the same order, a policy makes the same decisions.

Calling contract (both callers):

* ``decision = policy.choose(meta, views)`` for each request, with ``views`` describing every
  known replica right now (``inflight`` excludes this request). Raises ``NoReplicaAvailable``
  when no replica is healthy and not draining.
* The caller sends the request to ``decision.replica_id`` and, when the request is over
  (finished, failed or cancelled), calls ``policy.on_finish(meta, decision.replica_id)``
  exactly once, with the same ``meta`` object. A retry is a new ``choose`` (pass the failed
  replica in ``exclude``) that needs its own ``on_finish``.

Policies keep their own bookkeeping (session table, per-session in-flight counts, prefix index)
from these two calls. ``policy.counters`` counts decisions by kind.
"""
from __future__ import annotations

import random
from collections.abc import Collection, Sequence
from dataclasses import fields

from tokenmill.router.agentic import AgenticConfig, AgenticPolicy
from tokenmill.router.base import (
    Decision, NoReplicaAvailable, Policy, ReplicaView, RequestMeta, _Base, eligible_views,
    rendezvous_order, stable_hash,
)
from tokenmill.router.prefix_index import PrefixIndex, PrefixIndexConfig


class RandomPolicy(_Base):
    """Uniformly random over eligible replicas; reproducible with ``seed``."""

    name = "random"

    def __init__(self, seed: int | None = 0) -> None:
        super().__init__()
        self._rng = random.Random(seed)

    def choose(self, meta: RequestMeta, replicas: Sequence[ReplicaView], *,
               exclude: Collection[str] = ()) -> Decision:
        views = eligible_views(replicas, exclude)
        return self._decide(self._rng.choice(views).id, "random")


class RoundRobinPolicy(_Base):
    """Cycles over eligible replicas in id order."""

    name = "round_robin"

    def __init__(self) -> None:
        super().__init__()
        self._next = 0

    def choose(self, meta: RequestMeta, replicas: Sequence[ReplicaView], *,
               exclude: Collection[str] = ()) -> Decision:
        views = sorted(eligible_views(replicas, exclude), key=lambda r: r.id)
        rid = views[self._next % len(views)].id
        self._next += 1
        return self._decide(rid, "round_robin")


class LeastLoadPolicy(_Base):
    """Fewest active requests (then lowest KV usage); exact ties rotate round-robin."""

    name = "least_load"

    def __init__(self) -> None:
        super().__init__()
        self._turn = 0

    def choose(self, meta: RequestMeta, replicas: Sequence[ReplicaView], *,
               exclude: Collection[str] = ()) -> Decision:
        views = sorted(eligible_views(replicas, exclude), key=lambda r: r.id)
        best = min((r.active, r.kv_cache_usage) for r in views)
        tied = [r for r in views if (r.active, r.kv_cache_usage) == best]
        rid = tied[self._turn % len(tied)].id
        self._turn += 1
        return self._decide(rid, "least_load")


class SessionHashPolicy(_Base):
    """Rendezvous hashing of the session id over eligible replicas; no id -> random."""

    name = "session_hash"

    def __init__(self, seed: int | None = 0) -> None:
        super().__init__()
        self._rng = random.Random(seed)

    def choose(self, meta: RequestMeta, replicas: Sequence[ReplicaView], *,
               exclude: Collection[str] = ()) -> Decision:
        views = eligible_views(replicas, exclude)
        if meta.session_id is None:
            return self._decide(self._rng.choice(views).id, "random")
        return self._decide(rendezvous_order(meta.session_id, [r.id for r in views])[0], "hash")


POLICIES: dict[str, type] = {
    "random": RandomPolicy,
    "round_robin": RoundRobinPolicy,
    "least_load": LeastLoadPolicy,
    "session_hash": SessionHashPolicy,
    "agentic": AgenticPolicy,
}
DEFAULT_POLICY = "agentic"


def policy_options(name: str) -> list[str]:
    """Option names that ``make_policy(name, ...)`` accepts."""
    if name == "agentic":
        return [f.name for f in fields(AgenticConfig)] + [f.name for f in fields(PrefixIndexConfig)]
    if name in ("random", "session_hash"):
        return ["seed"]
    if name in POLICIES:
        return []
    raise ValueError(f"unknown policy {name!r}; choose one of {', '.join(POLICIES)}")


def make_policy(name: str, **options: object) -> Policy:
    """Build a policy by name. Options of ``agentic`` are the fields of ``AgenticConfig`` and
    ``PrefixIndexConfig``; ``random`` and ``session_hash`` take ``seed``. Options set to None
    are ignored (so CLI defaults can pass through). Unknown names or options raise ValueError.
    """
    allowed = policy_options(name)
    options = {k: v for k, v in options.items() if v is not None}
    unknown = sorted(set(options) - set(allowed))
    if unknown:
        raise ValueError(f"policy {name!r} does not take option(s) {', '.join(unknown)}; "
                         f"it takes: {', '.join(allowed) or 'none'}")
    if name == "agentic":
        index_names = {f.name for f in fields(PrefixIndexConfig)}
        index_cfg = PrefixIndexConfig(**{k: v for k, v in options.items() if k in index_names})  # type: ignore[arg-type]
        cfg = AgenticConfig(**{k: v for k, v in options.items() if k not in index_names})  # type: ignore[arg-type]
        return AgenticPolicy(cfg, index_cfg)
    return POLICIES[name](**options)  # type: ignore[no-any-return]


__all__ = [
    "AgenticConfig", "AgenticPolicy", "Decision", "DEFAULT_POLICY", "LeastLoadPolicy",
    "NoReplicaAvailable", "POLICIES", "Policy", "PrefixIndex", "PrefixIndexConfig", "RandomPolicy",
    "ReplicaView", "RequestMeta", "RoundRobinPolicy", "SessionHashPolicy", "eligible_views",
    "make_policy", "policy_options", "rendezvous_order", "stable_hash",
]
