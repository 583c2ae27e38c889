"""The ``agentic`` routing policy: keep sessions on their KV cache while keeping load even.

Rules, in the order ``choose`` applies them (terms defined below):

1. **Replica loss.** When a session's home is unhealthy, draining or gone, every session homed
   there is re-homed at once to its first choice in rendezvous order over the eligible
   replicas (its next request reports ``failover``). A recovered replica gets only new
   sessions: nobody is moved back.
2. **Gentle rebalancing.** A replica whose active load stays above the bound for
   ``rebalance_after_s`` gives away one idle session (nothing in flight), the one with the
   smallest context, to the least-loaded replica under the bound that holds fewer sessions;
   then its timer restarts. The session's next request reports ``moved``.
3. **Placement.** A session the table does not know (new or expired) goes to the replica with
   the lowest load score, ties broken by the session's rendezvous rank (``placed``).
4. **Stickiness and splitting.** A known session goes home (``sticky``) unless it already has
   ``session_max_inflight`` requests there or home is not under the bound; then the request
   goes to the next replica in the session's rendezvous order that is under the bound and
   holds fewer than ``session_max_inflight`` of its requests (``split``; home is unchanged).
   With ``shared_cache`` (a fleet whose replicas share an L3 cache tier) a known session with
   nothing in flight first moves to the least active replica when home has at least
   ``shared_move_margin`` more active requests (``moved``): the new replica loads the prefix
   from L3, so evening the load costs a load from storage instead of a recompute (rule 4a).
5. **No session id.** The longest prefix match in the approximate prefix index wins if it
   covers at least ``prefix_min_chunks`` chunks and that replica is under the bound
   (``prefix``); otherwise the lowest load score (``least_load``).

Terms, over the eligible replicas (healthy, not draining, not excluded):

* active(r) = max(router in-flight, reported running + waiting)
* score(r)  = active(r) + kv_weight * kv_cache_usage(r) + session_weight * sessions homed on r
* bound     = max(ceil((1 + epsilon) * (sum of active + 1) / n), load_floor); r is *under the
  bound* when active(r) + 1 <= bound (the consistent-hashing-with-bounded-loads cap, which
  always leaves at least one replica under it). r is *above the bound* when
  active(r) > max(ceil((1 + epsilon) * sum of active / n), load_floor).

Session table: home replica, last activity, context size (largest prompt + output seen) and
in-flight count per replica. A session with nothing in flight expires ``session_ttl_s`` after
its last activity.
"""
from __future__ import annotations

import math
from collections import Counter
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field

from tokenmill.router.base import (
    Decision, ReplicaView, RequestMeta, _Base, eligible_views, rendezvous_order,
)
from tokenmill.router.prefix_index import PrefixIndex, PrefixIndexConfig


@dataclass(frozen=True)
class AgenticConfig:
    """Knobs of the agentic policy (defaults suit replicas that run a handful of requests)."""

    session_max_inflight: int = 2     # a session's concurrent requests on one replica before split
    epsilon: float = 0.25             # load bound slack over the mean
    load_floor: float = 4.0           # never call a replica hot below this many active requests
    session_ttl_s: float = 600.0      # idle sessions are forgotten after this
    rebalance_after_s: float = 30.0   # a replica must stay above the bound this long to shed a session
    kv_weight: float = 1.0            # score weight of reported KV usage (0..1)
    session_weight: float = 0.5       # score weight of each session homed on the replica
    prefix_min_chunks: int = 4        # shortest prefix match (in chunks) that routes a request
    # Fleets with a shared L3 cache tier (docs/kv-tiers.md): a session's prefix is found on any
    # replica, so an idle session's next turn may move to a less loaded replica (rule 4a).
    shared_cache: bool = False
    shared_move_margin: int = 2       # move when home has at least this many more active requests

    def __post_init__(self) -> None:
        if not isinstance(self.session_max_inflight, int) or self.session_max_inflight < 1:
            raise ValueError(f"session_max_inflight must be an integer >= 1, got {self.session_max_inflight!r}")
        if not isinstance(self.shared_move_margin, int) or self.shared_move_margin < 1:
            raise ValueError(f"shared_move_margin must be an integer >= 1, got {self.shared_move_margin!r}")
        if not isinstance(self.prefix_min_chunks, int) or self.prefix_min_chunks < 1:
            raise ValueError(f"prefix_min_chunks must be an integer >= 1, got {self.prefix_min_chunks!r}")
        for name in ("epsilon", "load_floor", "kv_weight", "session_weight"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or value < 0 or math.isnan(value):
                raise ValueError(f"{name} must be a number >= 0, got {value!r}")
        for name in ("session_ttl_s", "rebalance_after_s"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"{name} must be a number > 0, got {value!r}")


@dataclass
class SessionState:
    """One row of the session table."""

    home: str
    last_seen: float
    context_tokens: int = 0
    inflight: Counter[str] = field(default_factory=Counter)   # replica id -> requests in flight
    pending_kind: str | None = None   # "failover" / "moved": reported by the next request

    @property
    def total_inflight(self) -> int:
        return sum(self.inflight.values())


@dataclass
class _Loads:
    """Load figures of one decision, from one pass over the replica views."""

    views: dict[str, ReplicaView]   # eligible and not excluded
    active: dict[str, int]          # of those views
    usable: set[str]                # eligible, excluded or not (who may keep sessions)
    healthy: set[str]               # healthy, draining or not (who keeps its cache)
    cap: float = 0.0                # bound for one more request
    hot: float = 0.0                # above this a replica counts as overloaded

    def under(self, rid: str) -> bool:
        return self.active[rid] + 1 <= self.cap


class AgenticPolicy(_Base):
    """KV-aware, load-aware session routing (see the module docstring for the rules)."""

    name = "agentic"

    def __init__(self, config: AgenticConfig | None = None,
                 index_config: PrefixIndexConfig | None = None) -> None:
        super().__init__()
        self.config = config or AgenticConfig()
        self.index = PrefixIndex(index_config)
        self._sessions: dict[str, SessionState] = {}
        self._homes: dict[str, dict[str, None]] = {}     # replica -> ordered set of session ids
        self._over_since: dict[str, float] = {}
        self._last_sweep = -math.inf

    # ----------------------------------------------------------------- introspection
    def session_home(self, session_id: str) -> str | None:
        state = self._sessions.get(session_id)
        return state.home if state else None

    def session_state(self, session_id: str) -> SessionState | None:
        return self._sessions.get(session_id)

    def sessions_per_replica(self) -> dict[str, int]:
        return {rid: len(s) for rid, s in self._homes.items() if s}

    @property
    def num_sessions(self) -> int:
        return len(self._sessions)

    # ----------------------------------------------------------------- decisions
    def choose(self, meta: RequestMeta, replicas: Sequence[ReplicaView], *,
               exclude: Collection[str] = ()) -> Decision:
        loads = self._loads(replicas, exclude)
        now = meta.now
        self._expire(now)
        self._handle_lost_replicas(loads)
        self._rebalance(loads, now)
        hashes = self.index.hashes(meta.prefix_key)
        if meta.session_id is None:
            rid, kind = self._route_anonymous(loads, hashes)
        else:
            rid, kind = self._route_session(meta, loads, exclude)
            state = self._sessions[meta.session_id]
            state.inflight[rid] += 1
            state.last_seen = max(state.last_seen, now)
            state.context_tokens = max(state.context_tokens, meta.prompt_tokens or 0)
        self.index.insert(rid, hashes)
        return self._decide(rid, kind)

    def on_finish(self, meta: RequestMeta, replica_id: str, *, output_tokens: int = 0,
                  now: float | None = None) -> None:
        """Ends one request chosen for ``meta`` on ``replica_id``; updates the session row."""
        if meta.session_id is None:
            return
        state = self._sessions.get(meta.session_id)
        if state is None:
            return
        if state.inflight[replica_id] > 0:
            state.inflight[replica_id] -= 1
        if state.inflight[replica_id] <= 0:
            del state.inflight[replica_id]
        state.last_seen = max(state.last_seen, meta.now if now is None else now)
        state.context_tokens = max(state.context_tokens, (meta.prompt_tokens or 0) + max(output_tokens, 0))

    # ----------------------------------------------------------------- steps
    def _loads(self, replicas: Sequence[ReplicaView], exclude: Collection[str]) -> _Loads:
        loads = _Loads({}, {}, set(), set())
        total = 0
        for r in replicas:
            if not r.healthy:
                continue
            loads.healthy.add(r.id)
            if r.draining:
                continue
            loads.usable.add(r.id)
            if r.id in exclude:
                continue
            loads.views[r.id] = r
            a = loads.active[r.id] = max(r.inflight, r.num_running + r.num_waiting)
            total += a
        if not loads.views:
            eligible_views(replicas, exclude)      # raises NoReplicaAvailable with the details
        cfg, n = self.config, len(loads.views)
        loads.cap = max(math.ceil((1 + cfg.epsilon) * (total + 1) / n), cfg.load_floor)
        loads.hot = max(math.ceil((1 + cfg.epsilon) * total / n), cfg.load_floor)
        return loads

    def _score(self, loads: _Loads, rid: str) -> float:
        cfg = self.config
        return (loads.active[rid] + cfg.kv_weight * loads.views[rid].kv_cache_usage
                + cfg.session_weight * len(self._homes.get(rid, ())))

    def _lowest_score(self, loads: _Loads, key: str | None, candidates: Sequence[str]) -> str:
        """Candidate with the lowest score; ties by rendezvous rank of ``key`` (or by id)."""
        scored = [(self._score(loads, rid), rid) for rid in candidates]
        best = min(score for score, _ in scored)
        tied = sorted(rid for score, rid in scored if score == best)
        if len(tied) == 1 or key is None:
            return tied[0]
        return rendezvous_order(key, tied)[0]

    def _route_anonymous(self, loads: _Loads, hashes: list[bytes]) -> tuple[str, str]:
        ids = sorted(loads.views)
        match = self.index.best_match(ids, hashes)
        if (match.replica_id is not None and match.num_chunks >= self.config.prefix_min_chunks
                and loads.under(match.replica_id)):
            return match.replica_id, "prefix"
        return self._lowest_score(loads, None, ids), "least_load"

    def _route_session(self, meta: RequestMeta, loads: _Loads,
                       exclude: Collection[str]) -> tuple[str, str]:
        sid = meta.session_id
        assert sid is not None
        state = self._sessions.get(sid)
        if state is not None and state.total_inflight == 0 and meta.now - state.last_seen > self.config.session_ttl_s:
            self._forget(sid)
            state = None
        if state is None:
            ids = sorted(loads.views)
            home = self._lowest_score(loads, sid, [r for r in ids if loads.under(r)] or ids)
            state = SessionState(home=home, last_seen=meta.now)
            self._set_home(sid, state, home)
            kind = "placed"
        else:
            kind = state.pending_kind or "sticky"
            state.pending_kind = None
            if self.config.shared_cache and state.total_inflight == 0:
                kind = self._move_to_shorter(sid, state, loads, kind)
        home = state.home
        max_inflight = self.config.session_max_inflight
        if home in loads.views and state.inflight[home] < max_inflight and loads.under(home):
            return home, kind
        # Home is excluded (a retry), hot for this session, or above the bound: split. The
        # pending failover/moved report waits for the request that really goes home.
        state.pending_kind = None if kind in ("sticky", "placed") else kind
        away = "retry" if home in exclude else "split"
        order = [rid for rid in rendezvous_order(sid, sorted(loads.views)) if rid != home]
        for rid in order:
            if loads.under(rid) and state.inflight[rid] < max_inflight:
                return rid, away
        # Every replica already holds max_inflight of this session: spread by its count.
        order = ([home] if home in loads.views else []) + order
        under = [rid for rid in order if loads.under(rid)] or order
        rid = min(under, key=lambda r: (state.inflight[r], under.index(r)))
        if rid == home:
            state.pending_kind = None
            return home, kind
        return rid, away

    def _move_to_shorter(self, sid: str, state: SessionState, loads: _Loads, kind: str) -> str:
        """Rule 4a (shared cache): a new turn of an idle session goes to the least active
        replica when home is ``shared_move_margin`` requests busier; the prefix comes from L3."""
        home = state.home
        if home not in loads.views:
            return kind
        least = min(loads.active.values())
        if loads.active[home] - least < self.config.shared_move_margin:
            return kind
        targets = [rid for rid, a in loads.active.items() if a == least]
        self._set_home(sid, state, self._lowest_score(loads, sid, targets))
        return "moved"

    def _set_home(self, sid: str, state: SessionState, home: str) -> None:
        old = self._sessions.get(sid)
        if old is not None:
            self._homes.get(old.home, {}).pop(sid, None)
        state.home = home
        self._sessions[sid] = state
        self._homes.setdefault(home, {})[sid] = None

    def _handle_lost_replicas(self, loads: _Loads) -> None:
        """Re-home sessions of replicas that are unhealthy, draining or gone; drop their index."""
        lost = [rid for rid, sessions in self._homes.items() if sessions and rid not in loads.usable]
        for rid in self.index.replica_ids():
            if rid not in loads.healthy:    # a dead replica loses its cache; a draining one keeps it
                self.index.remove_replica(rid)
        if not lost:
            return
        eligible = sorted(loads.usable)
        for rid in lost:
            for sid in list(self._homes[rid]):
                state = self._sessions[sid]
                self._set_home(sid, state, rendezvous_order(sid, eligible)[0])
                state.pending_kind = "failover"
            self._over_since.pop(rid, None)

    def _rebalance(self, loads: _Loads, now: float) -> None:
        """Track how long each replica stays above the bound; shed one idle session if too long."""
        for rid in list(self._over_since):
            if rid not in loads.views:
                del self._over_since[rid]
        for rid, active in loads.active.items():
            if active > loads.hot:
                self._over_since.setdefault(rid, now)
            else:
                self._over_since.pop(rid, None)
        for rid, since in list(self._over_since.items()):
            if now - since < self.config.rebalance_after_s:
                continue
            self._over_since[rid] = now      # the next move needs another full period
            idle = [sid for sid in self._homes.get(rid, {}) if self._sessions[sid].total_inflight == 0]
            if not idle:
                continue
            count = len(self._homes.get(rid, {}))
            targets = [t for t in sorted(loads.views) if t != rid and loads.under(t)
                       and len(self._homes.get(t, ())) < count - 1]
            if not targets:
                continue
            sid = min(idle, key=lambda s: (self._sessions[s].context_tokens, s))
            target = self._lowest_score(loads, sid, targets)
            state = self._sessions[sid]
            self._set_home(sid, state, target)
            state.pending_kind = "moved"

    def _forget(self, sid: str) -> None:
        state = self._sessions.pop(sid)
        self._homes.get(state.home, {}).pop(sid, None)

    def _expire(self, now: float) -> None:
        """Forget idle sessions older than the TTL (full sweep at most every TTL/10)."""
        ttl = self.config.session_ttl_s
        if now - self._last_sweep < ttl / 10:
            return
        self._last_sweep = now
        for sid, state in list(self._sessions.items()):
            if state.total_inflight == 0 and now - state.last_seen > ttl:
                self._forget(sid)
