"""Types shared by all routing policies: request metadata, replica views, decisions, hashing.

See ``tokenmill.router.policies`` for the calling contract. Pure code, no I/O.
"""
from __future__ import annotations

import hashlib
from collections import Counter
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Protocol


class NoReplicaAvailable(RuntimeError):
    """No replica is healthy and accepting new requests."""


@dataclass
class RequestMeta:
    """What a policy may know about a request.

    ``prefix_key``: token ids or text whose leading chunks identify the prompt's prefix (the
    router uses text: the rendered messages; the simulator may use token ids). ``now``: seconds
    on the caller's clock, non-decreasing across calls.
    """

    session_id: str | None
    prompt_tokens: int | None
    prefix_key: Sequence[int] | str | None
    now: float


@dataclass
class ReplicaView:
    """One replica as the caller sees it at the time of a decision.

    ``inflight``: the caller's own count of requests it has sent there and not finished.
    ``num_running``/``num_waiting``/``kv_cache_usage``: last reported by the replica (0 when it
    never reported). ``draining``: takes no new requests; its sessions move elsewhere.
    """

    id: str
    healthy: bool
    inflight: int
    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    draining: bool = False

    @property
    def active(self) -> int:
        """Requests on the replica: the fresher of the router's count and the replica's report."""
        return max(self.inflight, self.num_running + self.num_waiting)

    @property
    def eligible(self) -> bool:
        return self.healthy and not self.draining


@dataclass
class Decision:
    """The chosen replica and why: placed | sticky | split | moved | failover | retry | prefix |
    least_load | hash | random | round_robin."""

    replica_id: str
    kind: str


class Policy(Protocol):
    name: str
    counters: Counter[str]

    def choose(self, meta: RequestMeta, replicas: Sequence[ReplicaView], *,
               exclude: Collection[str] = ()) -> Decision: ...

    def on_finish(self, meta: RequestMeta, replica_id: str, *, output_tokens: int = 0,
                  now: float | None = None) -> None: ...


def stable_hash(*parts: str) -> int:
    """64-bit hash that is the same in every process (unlike ``hash()``)."""
    h = hashlib.blake2b(digest_size=8)
    for p in parts:
        h.update(p.encode("utf-8", "surrogatepass"))
        h.update(b"\x00")
    return int.from_bytes(h.digest(), "big")


def rendezvous_order(key: str, replica_ids: Sequence[str]) -> list[str]:
    """Replica ids by decreasing highest-random-weight score for ``key``.

    Removing a replica changes nobody's order except by dropping it; adding one inserts it at a
    uniformly random rank, so it becomes first for about 1/(N+1) of keys.
    """
    return sorted(replica_ids, key=lambda rid: (stable_hash(key, rid), rid), reverse=True)


def eligible_views(replicas: Sequence[ReplicaView], exclude: Collection[str] = ()) -> list[ReplicaView]:
    """Healthy, non-draining, not excluded replicas; raises ``NoReplicaAvailable`` if none."""
    out = [r for r in replicas if r.eligible and r.id not in exclude]
    if not out:
        raise NoReplicaAvailable(
            f"no healthy replica accepts requests ({len(replicas)} known, {len(exclude)} excluded)")
    return out


class _Base:
    name = "base"

    def __init__(self) -> None:
        self.counters: Counter[str] = Counter()

    def _decide(self, replica_id: str, kind: str) -> Decision:
        self.counters[kind] += 1
        return Decision(replica_id, kind)

    def on_finish(self, meta: RequestMeta, replica_id: str, *, output_tokens: int = 0,
                  now: float | None = None) -> None:
        """Stateless policies keep nothing per request."""
