"""The fleet: a discrete-event loop over simulated replicas, agent sessions and the router.

Everything that decides something is shared with the live system:

- placement: ``tokenmill.router.policies.make_policy(name)``, called as the router calls it
  (``choose(meta, views)`` per request, ``on_finish(meta, replica_id)`` once per request), with
  ``ReplicaView``s built from the simulated replicas;
- serving: each replica runs the engine's own ``Scheduler`` and ``KVManager`` over a real
  ``RadixCache`` and ``PagePool``, with a cost model for step time (see ``replica.py``);
- workload: sessions come from ``tokenmill.workload.make_session`` (the benchmark's own
  generator) and run closed loop; or Mooncake records replay open loop.

Events (a heap of ``(time, seq, kind, a, b)``; stale replica events are skipped by version)::

    REPLICA  a step (or a run of decode steps) ends on replica a, or one is to be planned (version b)
    TURN     session a sends its next turn (after its think time)
    TRACE    trace request number a arrives
    SAMPLE   per-replica loads are recorded
    SCALE    b replicas are added or drained (a: "manual" / "autoscale")
    AUTOSCALE the target-concurrency rule looks at the fleet
    REPORT   replicas report num_running / num_waiting / kv usage to the router
    POPULATION the number of running sessions changes to a
"""
from __future__ import annotations

import heapq
import math
import random
import sys
import time
from collections.abc import Callable
from typing import Any

from tokenmill.workload import SessionScript, TraceReplayConfig, make_session, trace_requests
from tokenmill.router.base import NoReplicaAvailable, ReplicaView, RequestMeta
from tokenmill.router.policies import make_policy
from tokenmill.sim.config import SimConfig
from tokenmill.sim.metrics import Recorder, ScaleRecord, summarise
from tokenmill.sim.replica import SimReplica, SimRequest
from tokenmill.sim.tiers import SharedStore

REPLICA, TURN, TRACE, SAMPLE, SCALE, AUTOSCALE, REPORT, POPULATION = range(8)
_FRESH_BASE = 1 << 60          # block ids of thick-session branch suffixes and trace outputs
_SESSION_STRIDE = 1 << 32      # block ids of session i are i * stride + block index
# Decision kinds that send one request away from the session's home without re-homing it.
_AWAY_KINDS = frozenset({"split", "retry"})


class SimSession:
    """A running agent session: its script, where it is, and its block-id stream."""

    __slots__ = ("script", "sid", "turn", "prompt", "outstanding", "home", "ended", "key",
                 "sent_any", "base")

    def __init__(self, script: SessionScript, start_turn: int) -> None:
        self.script = script
        self.sid = script.session_id
        self.turn = start_turn
        turns = script.turns
        prompt = len(script.shared_prompt_ids) + turns[0].num_new_tokens
        for t in range(1, start_turn + 1):
            prompt += turns[t - 1].output_tokens + turns[t].num_new_tokens
        self.prompt = prompt               # prompt tokens of the current turn
        self.outstanding = 0
        self.home: str | None = None
        self.ended = False
        self.sent_any = False
        self.key: list[int] = []
        self.base = (script.index + 1) * _SESSION_STRIDE


class SimResult(dict):  # type: ignore[type-arg]
    """The summary (a JSON-able dict) with the recorder attached for writing outputs."""

    recorder: Recorder


class FleetSimulator:
    """Runs one ``SimConfig``; ``run()`` returns the summary. Deterministic given the config."""

    def __init__(self, config: SimConfig, progress: bool = False) -> None:
        self.cfg = config
        self.profile = config.profile
        self.block = config.resolved_block_tokens()
        # the fleet's L3, shared by every replica (profile.storage_tokens; see sim/tiers.py)
        self.store: SharedStore | None = (SharedStore(max(self.profile.storage_tokens // self.block, 1))
                                          if self.profile.storage_tokens > 0 else None)
        self.policy = make_policy(config.policy, **config.policy_options)
        self.rng = random.Random(f"sim:{config.seed}")
        self.now = 0.0
        self._heap: list[tuple[float, int, int, Any, Any]] = []
        self._seq = 0
        self.replicas: dict[str, SimReplica] = {}
        self.views: dict[str, ReplicaView] = {}
        self._dirty: set[SimReplica] = set()     # replicas whose state changed since the last report
        self._next_replica = 0
        self._pending_online = 0
        self.assigned: dict[str, int] = {}
        self.sessions: dict[str, SimSession] = {}
        self.target_sessions = config.sessions
        self._next_session_index = 0
        self._next_rid = 0
        self._fresh = _FRESH_BASE
        self.rec = Recorder(config.warmup_s)
        self.scale_records: list[ScaleRecord] = []
        self._below_since: float | None = None
        self._progress = progress
        self._trace: list[Any] = []
        self.moved_kinds: dict[str, int] = {}
        self._gone_preemptions = 0               # of replicas drained and removed
        shared = config.workload.shared_prompt_tokens if config.workload is not None else 0
        self._shared_blocks = shared // self.block

    # ----------------------------------------------------------------- scheduling helpers
    def _push(self, t: float, kind: int, a: Any = None, b: Any = None) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (t, self._seq, kind, a, b))

    def _schedule_replica(self, rep: SimReplica) -> None:
        t = rep.next_event_time()
        if t is not None:
            self._push(t, REPLICA, rep, rep.version)

    def clock(self) -> float:
        return self.now

    # ----------------------------------------------------------------- replicas
    def _add_replicas(self, k: int) -> None:
        for _ in range(k):
            rid = f"r{self._next_replica:03d}"
            self._next_replica += 1
            rep = SimReplica(rid, self.profile, self.block, self.clock,
                             session_retention_s=self.cfg.session_retention_s, created_at=self.now,
                             store=self.store)
            self.replicas[rid] = rep
            self.views[rid] = ReplicaView(rid, True, 0)
            self.assigned.setdefault(rid, 0)

    def _drain_replicas(self, k: int) -> int:
        """Mark the k least-loaded non-draining replicas draining; returns how many."""
        live = [r for r in self.replicas.values() if not r.draining]
        k = min(k, len(live) - 1)
        if k <= 0:
            return 0
        live.sort(key=lambda r: (r.inflight, self.assigned.get(r.id, 0), r.id))
        for rep in live[:k]:
            rep.draining = True
            self.views[rep.id].draining = True
            self._maybe_remove(rep)
        return k

    def _maybe_remove(self, rep: SimReplica) -> None:
        if rep.draining and rep.idle and rep.id in self.replicas:
            self._gone_preemptions += rep.num_preemptions
            del self.replicas[rep.id]
            del self.views[rep.id]

    def _refresh_views(self) -> None:
        """Copy the replicas' reported load into the views (what /v1/loads would say)."""
        dirty = self._dirty
        if not dirty:
            return
        views = self.views
        for rep in dirty:
            v = views.get(rep.id)
            if v is not None:
                v.num_running = rep.num_running
                v.num_waiting = len(rep.waiting)
                v.kv_cache_usage = rep.kv_cache_usage
        dirty.clear()

    def _scale(self, delta: int, source: str) -> None:
        before = sum(1 for r in self.replicas.values() if not r.draining)
        if delta > 0:
            self._add_replicas(delta)
        else:
            self._drain_replicas(-delta)
        after = sum(1 for r in self.replicas.values() if not r.draining)
        if after == before:
            return
        rec = ScaleRecord(self.now, after - before, source, before, after)
        rec.pending = {s.sid: s.home for s in self.sessions.values()
                       if s.sent_any and not s.ended and s.home is not None}
        rec.live_sessions = len(rec.pending)
        self.scale_records.append(rec)

    # ----------------------------------------------------------------- sessions
    def _start_session(self, at: float, stationary: bool) -> None:
        wl = self.cfg.workload
        assert wl is not None
        script = make_session(wl, self._next_session_index)
        self._next_session_index += 1
        start_turn = self.rng.randrange(script.num_turns) if stationary else 0
        s = SimSession(script, start_turn)
        self.sessions[s.sid] = s
        self._push(at, TURN, s)

    def _session_key(self, s: SimSession, n: int) -> list[int]:
        key = s.key
        shared = self._shared_blocks
        for j in range(len(key), n):
            key.append(-(j + 1) if j < shared else s.base + j)
        return key[:n]

    def _send_turn(self, s: SimSession) -> None:
        turn = s.script.turns[s.turn]
        b = self.block
        out = turn.output_tokens
        for branch in range(turn.parallel_requests):
            if branch == 0:
                prompt = s.prompt
                key = self._session_key(s, (prompt + out) // b)
            else:
                prompt = s.prompt + turn.branch_tokens
                key = self._session_key(s, s.prompt // b)
                n = (prompt + out) // b - len(key)
                key.extend(range(self._fresh, self._fresh + n))
                self._fresh += n
            req = SimRequest(self._next_rid, s.sid, key, prompt, out, self.now, owner=s, branch=branch)
            self._next_rid += 1
            s.outstanding += 1
            self._route(req)
        s.sent_any = True

    def _end_turn(self, s: SimSession) -> None:
        script = s.script
        turn = script.turns[s.turn]
        if s.turn + 1 < script.num_turns and len(self.sessions) <= self.target_sessions:
            s.prompt += turn.output_tokens + script.turns[s.turn + 1].num_new_tokens
            s.turn += 1
            self._push(self.now + script.turns[s.turn].think_time_s, TURN, s)
            return
        s.ended = True
        del self.sessions[s.sid]
        if s.home is not None and s.home in self.assigned:
            self.assigned[s.home] -= 1
        for rec in self.scale_records:
            rec.pending.pop(s.sid, None)
        if len(self.sessions) < self.target_sessions:
            self._start_session(self.now, stationary=False)

    def _set_population(self, n: int) -> None:
        self.target_sessions = n
        while len(self.sessions) < n:
            self._start_session(self.now, stationary=False)

    # ----------------------------------------------------------------- trace replay
    def _load_trace(self) -> None:
        assert self.cfg.trace is not None
        # block_tokens=1 keeps D's session inference and arrival times without building token
        # lists; lengths and hash ids come from the records themselves.
        reqs = trace_requests(self.cfg.trace, TraceReplayConfig(
            block_tokens=1, time_scale=self.cfg.trace_time_scale, output_scale=1.0, max_output_tokens=None))
        self._trace = list(zip(self.cfg.trace, reqs))
        if self._trace:
            self._push(self._trace[0][1].arrival_s, TRACE, 0)

    def _send_trace(self, i: int) -> None:
        rec, treq = self._trace[i]
        if i + 1 < len(self._trace):
            self._push(self._trace[i + 1][1].arrival_s, TRACE, i + 1)
        prompt = rec.input_length
        out = max(1, rec.output_length)
        n_prompt = min(prompt // self.block, len(rec.hash_ids))
        key = list(rec.hash_ids[:n_prompt])
        req = SimRequest(self._next_rid, treq.session_id, key, prompt, out, self.now, owner=None)
        self._next_rid += 1
        self._route(req)

    # ----------------------------------------------------------------- routing
    def _route(self, req: SimRequest) -> None:
        if self.cfg.report_interval_s == 0:
            self._refresh_views()
        meta = RequestMeta(req.session_id, req.prompt_tokens,
                           None if req.session_id is not None else req.key, self.now)
        req.meta = meta
        try:
            decision = self.policy.choose(meta, list(self.views.values()))
        except NoReplicaAvailable:
            self._reject(req)
            return
        rep = self.replicas[decision.replica_id]
        req.decision_kind = decision.kind
        s = req.owner
        if isinstance(s, SimSession) and decision.kind not in _AWAY_KINDS:
            # The session's home: where its requests go when they are not split off.
            for srec in self.scale_records:
                old = srec.pending.pop(s.sid, None)
                if old is not None:
                    srec.observed += 1
                    srec.moved += old != rep.id
            if s.home != rep.id:
                if s.home is not None and s.home in self.assigned:
                    self.assigned[s.home] -= 1
                self.assigned[rep.id] = self.assigned.get(rep.id, 0) + 1
                s.home = rep.id
        if not rep.fits(req):
            self.policy.on_finish(meta, rep.id, output_tokens=0, now=self.now)
            self._reject(req)
            return
        done = rep.submit(req, self.now)
        self.views[rep.id].inflight += 1     # the router's own count: exact, never stale
        self._dirty.add(rep)
        self._schedule_replica(rep)
        self._finished(rep, done)

    def _reject(self, req: SimRequest) -> None:
        self.rec.rejected += 1
        s = req.owner
        if isinstance(s, SimSession):
            s.outstanding -= 1
            if s.outstanding == 0:
                s.turn = s.script.num_turns - 1     # a session whose request cannot run ends
                self._end_turn(s)

    def _finished(self, rep: SimReplica, done: list[SimRequest]) -> None:
        if done:
            view = self.views.get(rep.id)
            if view is not None:
                view.inflight -= len(done)
        for req in done:
            self.policy.on_finish(req.meta, rep.id, output_tokens=req.output_tokens, now=self.now)
            self.rec.finished(req.arrival, req.ttft, req.t_finish - req.arrival, req.prompt_tokens,
                              req.cached_tokens, req.output_tokens, rep.id, req.t_finish)
            s = req.owner
            if isinstance(s, SimSession):
                s.outstanding -= 1
                if s.outstanding == 0:
                    self._end_turn(s)
        if done:
            self._maybe_remove(rep)

    # ----------------------------------------------------------------- periodic events
    def _sample(self) -> None:
        loads = [(rid, rep.inflight, len(rep.sessions), self.assigned.get(rid, 0))
                 for rid, rep in self.replicas.items()]
        self.rec.sample(self.now, loads)

    def _autoscale(self) -> None:
        rule = self.cfg.autoscale
        assert rule is not None
        demand = sum(r.inflight for r in self.replicas.values())
        want = min(rule.max_replicas, max(rule.min_replicas, math.ceil(demand / rule.target)))
        have = sum(1 for r in self.replicas.values() if not r.draining) + self._pending_online
        if want > have:
            self._below_since = None
            self._pending_online += want - have
            self._push(self.now + rule.startup_s, SCALE, "autoscale", want - have)
        elif want < have:
            if self._below_since is None:
                self._below_since = self.now
            elif self.now - self._below_since >= rule.scale_down_delay_s:
                self._scale(want - have, "autoscale")
                self._below_since = None
        else:
            self._below_since = None
        self._push(self.now + rule.interval_s, AUTOSCALE)

    # ----------------------------------------------------------------- the loop
    def run(self) -> SimResult:
        cfg = self.cfg
        wall0 = time.perf_counter()
        self._add_replicas(cfg.replicas)
        if cfg.workload is not None:
            for _ in range(cfg.sessions):
                self._start_session(self.rng.uniform(0, cfg.start_spread_s) if cfg.start_spread_s else 0.0,
                                    cfg.stationary_start)
            for pc in cfg.population_changes:
                self._push(pc.time_s, POPULATION, pc.sessions)
        else:
            self._load_trace()
        for ev in cfg.scale_events:
            self._push(ev.time_s, SCALE, "manual", ev.delta)
        self._push(cfg.warmup_s, SAMPLE)
        if cfg.autoscale is not None:
            self._push(cfg.autoscale.interval_s, AUTOSCALE)
        if cfg.report_interval_s > 0:
            self._refresh_views()
            self._push(cfg.report_interval_s, REPORT)
        bar = _progress_bar(cfg.duration_s) if self._progress else None
        shown = 0
        heap = self._heap
        handlers: dict[int, Callable[[Any, Any], None]] = {
            TURN: lambda a, b: self._send_turn(a),
            TRACE: lambda a, b: self._send_trace(a),
            SAMPLE: self._on_sample,
            SCALE: self._on_scale,
            AUTOSCALE: lambda a, b: self._autoscale(),
            REPORT: self._on_report,
            POPULATION: lambda a, b: self._set_population(a),
        }
        while heap and heap[0][0] <= cfg.duration_s:
            t, _, kind, a, b = heapq.heappop(heap)
            self.now = t
            if kind == REPLICA:
                if a.version != b or a.id not in self.replicas:
                    continue
                done = a.on_event(t)
                self._dirty.add(a)
                self._schedule_replica(a)
                self._finished(a, done)
            else:
                handlers[kind](a, b)
            if bar is not None and t - shown >= 1.0:
                bar.update(int(t) - int(shown))
                shown = float(int(t))
        if bar is not None:
            bar.update(int(cfg.duration_s) - int(shown))
            bar.close()
        self.now = cfg.duration_s
        summary = summarise(self.rec, cfg.duration_s, sum(1 for r in self.replicas.values() if not r.draining))
        summary["preemptions"] = self._gone_preemptions + sum(r.num_preemptions for r in self.replicas.values())
        summary["scale_events"] = [r.to_dict() for r in self.scale_records]
        summary["decisions"] = dict(sorted(self.policy.counters.items()))
        tiers = [r.tiers for r in self.replicas.values() if r.tiers is not None]
        if tiers:   # hits over the whole run, by tier, on the replicas alive at the end
            summary["tiers"] = {
                "hit_tokens": {k: sum(t.hit_tokens[k] for t in tiers) for k in ("l1", "l2", "l3")},
                "load_s": sum(t.load_s for t in tiers),
                "storage_pages": len(self.store) if self.store is not None else 0,
                "storage_pages_written": self.store.pages_written if self.store is not None else 0,
            }
        summary["config"] = self.describe()
        summary["sim_wall_s"] = time.perf_counter() - wall0
        result = SimResult(summary)
        result.recorder = self.rec
        return result

    def _on_sample(self, a: Any, b: Any) -> None:
        self._sample()
        self._push(self.now + self.cfg.sample_interval_s, SAMPLE)

    def _on_scale(self, source: Any, delta: Any) -> None:
        if source == "autoscale" and delta > 0:
            self._pending_online -= delta
        self._scale(delta, source)

    def _on_report(self, a: Any, b: Any) -> None:
        self._refresh_views()
        self._push(self.now + self.cfg.report_interval_s, REPORT)

    def describe(self) -> dict[str, Any]:
        cfg = self.cfg
        return {
            "replicas": cfg.replicas, "sessions": cfg.sessions, "policy": cfg.policy,
            "policy_options": cfg.policy_options, "duration_s": cfg.duration_s, "warmup_s": cfg.warmup_s,
            "profile": cfg.profile.name, "block_tokens": self.block, "seed": cfg.seed,
            "report_interval_s": cfg.report_interval_s, "session_retention_s": cfg.session_retention_s,
            "scale_events": [list(e) for e in cfg.scale_events],
            "population_changes": [list(p) for p in cfg.population_changes],
            "autoscale": None if cfg.autoscale is None else vars(cfg.autoscale).copy(),
            "workload": cfg.workload.describe() if cfg.workload is not None else {"kind": "mooncake",
                                                                                   "records": len(cfg.trace or ())},
        }

    def check_invariants(self) -> None:
        for rep in self.replicas.values():
            rep.check_invariants()


def _progress_bar(total_s: float) -> Any:
    from tqdm import tqdm

    return tqdm(total=int(total_s), unit="sim-s", file=sys.stderr, dynamic_ncols=True, leave=False)


def simulate(config: SimConfig, progress: bool = False) -> SimResult:
    """Run one simulation and return its summary (see ``metrics.summarise``)."""
    return FleetSimulator(config, progress=progress).run()
