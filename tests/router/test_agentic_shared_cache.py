"""The agentic policy's shared-cache rule (fleets with an L3 tier): idle sessions follow load."""
from __future__ import annotations

import pytest

from tokenmill.router.agentic import AgenticConfig, AgenticPolicy
from tokenmill.router.base import ReplicaView, RequestMeta


def views(active: dict[str, int]) -> list[ReplicaView]:
    return [ReplicaView(rid, True, n) for rid, n in active.items()]


def turn(policy: AgenticPolicy, sid: str, active: dict[str, int], now: float):
    meta = RequestMeta(sid, 1000, None, now)
    d = policy.choose(meta, views(active))
    policy.on_finish(meta, d.replica_id, output_tokens=10, now=now + 0.1)
    return d


@pytest.mark.parametrize("shared", [False, True])
def test_idle_session_moves_to_the_shortest_queue_only_with_shared_cache(shared: bool) -> None:
    p = AgenticPolicy(AgenticConfig(shared_cache=shared))
    first = turn(p, "s", {"a": 0, "b": 0, "c": 0}, 0.0)
    assert first.kind == "placed"
    home = first.replica_id
    others = [r for r in "abc" if r != home]
    busy = {home: 3, others[0]: 1, others[1]: 2}     # home 2 above the least: margin 2 is met
    d = turn(p, "s", busy, 1.0)
    if shared:
        assert (d.replica_id, d.kind) == (others[0], "moved")
        assert p.session_home("s") == others[0]
    else:
        assert (d.replica_id, d.kind) == (home, "sticky")
    # one request of difference is within the margin: the session stays where it is
    now_home = p.session_home("s")
    d = turn(p, "s", {r: (2 if r == now_home else 1) for r in "abc"}, 2.0)
    assert (d.replica_id, d.kind) == (now_home, "sticky")


def test_a_session_with_requests_in_flight_does_not_move() -> None:
    p = AgenticPolicy(AgenticConfig(shared_cache=True))
    home = turn(p, "s", {"a": 0, "b": 0}, 0.0).replica_id
    other = "b" if home == "a" else "a"
    d1 = p.choose(RequestMeta("s", 1000, None, 1.0), views({home: 0, other: 0}))
    assert d1.replica_id == home
    d2 = p.choose(RequestMeta("s", 1000, None, 1.1), views({home: 3, other: 0}))
    assert d2.kind != "moved" and p.session_home("s") == home


def test_config_checks() -> None:
    with pytest.raises(ValueError):
        AgenticConfig(shared_move_margin=0)
