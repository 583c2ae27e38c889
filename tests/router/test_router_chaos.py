"""Router chaos: three real replicas under steady closed-loop load, one fault at a time.

Faults, in turn: kill -9 of replica A (restarted afterwards), SIGSTOP of replica B (hung, not
dead; SIGCONT later), replica C answering 500s, and replica C slowed down (5 s per request); C sits behind a test
proxy in this process that injects the last two. For each fault the test measures how long the
router takes to take the replica out (health checks or circuit breaker) and checks:

* non-streamed requests that start after detection get no 5xx (they were retried elsewhere);
* none of them is served by the faulty replica (its sessions rebound to healthy ones);
* a stream cut mid-way by the fault ends with an SSE error event and [DONE], never a hang;
* the recovered replica rejoins and is served again.

Detection times and error counts are printed per fault (``pytest -s`` shows them).
"""
from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import httpx
import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from router_fleet import MODEL, Fleet, start_router
from tokenmill.utils.proc import ServiceProcess, free_port

REPLICA = "x-tokenmill-replica"


class FaultProxy:
    """A loopback HTTP proxy in front of one replica: ``mode`` is pass | error500 | slow."""

    def __init__(self, upstream: str, delay_s: float = 5.0) -> None:
        self.upstream = upstream
        self.mode = "pass"
        self.delay_s = delay_s
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        app = Starlette(routes=[Route("/{path:path}", self._handle, methods=["GET", "POST", "DELETE"])])
        self._server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning"))
        self._thread = threading.Thread(target=self._server.run, daemon=True)

    def __enter__(self) -> FaultProxy:
        self._thread.start()
        deadline = time.monotonic() + 20
        while not self._server.started and time.monotonic() < deadline:
            time.sleep(0.05)
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.should_exit = True
        self._thread.join(10)

    async def _handle(self, request: Request) -> Response:
        mode = self.mode
        if mode == "slow":
            await asyncio.sleep(self.delay_s)
        if mode == "error500" and request.method == "POST":
            return JSONResponse({"error": {"message": "injected fault", "type": "server_error", "param": None,
                                           "code": "injected"}}, status_code=500)
        client = httpx.AsyncClient(timeout=120)
        headers = {k: v for k, v in request.headers.items() if k.lower() not in ("host", "content-length")}
        upstream = await client.send(client.build_request(request.method, self.upstream + request.url.path,
                                                          content=await request.body(), headers=headers),
                                     stream=True)

        async def body() -> Iterator[bytes]:
            try:
                async for chunk in upstream.aiter_raw():
                    yield chunk
            finally:
                await upstream.aclose()
                await client.aclose()

        keep = {k: v for k, v in upstream.headers.items()
                if k.lower() not in ("content-length", "transfer-encoding", "connection")}
        return StreamingResponse(body(), status_code=upstream.status_code, headers=keep)


@dataclass
class Outcome:
    start: float
    end: float
    status: int
    replica: str | None
    error: str | None = None


@dataclass
class Load:
    """Closed-loop non-streamed chat requests from a few threads; sessions rotate slowly."""

    base: str
    pinned: str | None = None     # a session homed on the victim, so some traffic goes there
    threads: int = 3
    outcomes: list[Outcome] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)

    def run(self, seed: int) -> None:
        rng = random.Random(seed)
        with httpx.Client(base_url=self.base, timeout=60) as c:
            while not self._stop.is_set():
                draw = rng.random()
                if self.pinned is not None and draw < 0.25:
                    session = self.pinned
                else:
                    session = f"s{rng.randrange(12)}" if draw < 0.8 else f"new-{rng.random()}"
                t0 = time.monotonic()
                try:
                    r = c.post("/v1/chat/completions", headers={"X-Session-ID": session},
                               json={"model": MODEL, "max_tokens": rng.randint(2, 12),
                                     "messages": [{"role": "user", "content": f"turn of {session}"}]})
                    self.outcomes.append(Outcome(t0, time.monotonic(), r.status_code, r.headers.get(REPLICA),
                                                 None if r.status_code < 500 else r.text[:200]))
                except httpx.HTTPError as e:
                    self.outcomes.append(Outcome(t0, time.monotonic(), 0, None, f"{type(e).__name__}: {e}"))

    def __enter__(self) -> Load:
        self._threads = [threading.Thread(target=self.run, args=(i,), daemon=True) for i in range(self.threads)]
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(60)


def replica_state(base: str, rid: str) -> dict:
    return next(r for r in httpx.get(base + "/v1/loads", timeout=10).json()["replicas"] if r["id"] == rid)


def wait_until(pred, timeout: float, interval: float = 0.05) -> float:
    """Seconds until ``pred()`` held; fails after ``timeout``."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if pred():
            return time.monotonic() - t0
        time.sleep(interval)
    raise AssertionError(f"condition not met within {timeout}s")


def lands_on(base: str, rid: str, tries: int = 60) -> bool:
    """Fresh sessions are placed on replica ``rid`` again (it rejoined)."""
    for k in range(tries):
        r = httpx.post(base + "/v1/chat/completions", headers={"X-Session-ID": f"fresh-{rid}-{time.monotonic()}"},
                       json={"model": MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]},
                       timeout=60)
        if r.status_code == 200 and r.headers.get(REPLICA) == rid:
            return True
        time.sleep(0.1)
    return False


def session_on(base: str, rid: str) -> str:
    """A session id whose home is replica ``rid``."""
    for k in range(200):
        sid = f"pin-{rid}-{time.monotonic()}"
        r = httpx.post(base + "/v1/chat/completions", headers={"X-Session-ID": sid}, timeout=60,
                       json={"model": MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": "pin"}]})
        if r.headers.get(REPLICA) == rid:
            return sid
    raise AssertionError(f"no session landed on {rid}")


class CutStream:
    """A long stream on a given session, read in a thread; records how it ended."""

    def __init__(self, base: str, session: str) -> None:
        self.base, self.session = base, session
        self.first = threading.Event()
        self.ending: str | None = None
        self.replica: str | None = None
        self.events: list[str] = []
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    def _run(self) -> None:
        body = {"model": MODEL, "messages": [{"role": "user", "content": "long"}], "max_tokens": 3000,
                "ignore_eos": True, "stream": True}
        try:
            with httpx.stream("POST", self.base + "/v1/chat/completions", json=body, timeout=30,
                              headers={"X-Session-ID": self.session}) as r:
                self.replica = r.headers.get(REPLICA)
                for line in r.iter_lines():
                    if line.startswith("data:"):
                        self.events.append(line[5:].strip())
                        self.first.set()
            self.ending = "done"
        except httpx.HTTPError as e:
            self.ending = f"transport error {type(e).__name__}"
        self.first.set()

    def result(self) -> str:
        self._t.join(40)
        assert not self._t.is_alive(), "the stream hung"
        if self.events and self.events[-1] == "[DONE]" and len(self.events) >= 2:
            last = json.loads(self.events[-2])
            if "error" in last:
                return "error_event"
            if last.get("choices") and last["choices"][0].get("finish_reason"):
                return "finished"
        return f"bad ending: {self.ending} {self.events[-2:]}"


@pytest.fixture(scope="module")
def chaos(tiny_dir: str) -> Iterator[tuple[Fleet, FaultProxy, ServiceProcess]]:
    fleet = Fleet(tiny_dir, 3)
    try:
        fleet.start([0, 1, 2])
        with FaultProxy(fleet.url(2)) as proxy:
            router = start_router([fleet.url(0), fleet.url(1), proxy.url], "--health-interval", "0.25",
                                  "--health-timeout", "2.0", "--failure-threshold", "2", "--recovery-threshold", "2",
                                  "--breaker-threshold", "3", "--breaker-cooldown", "1.5")
            try:
                yield fleet, proxy, router
            finally:
                router.stop()
    finally:
        for p in fleet.procs:
            if p.proc is not None and p.proc.poll() is None:
                os.kill(p.proc.pid, signal.SIGCONT)
        fleet.stop()


def test_chaos_each_fault_detected_and_survived(chaos: tuple[Fleet, FaultProxy, ServiceProcess]) -> None:
    fleet, proxy, router = chaos
    base = router.base_url
    ids = [fleet.url(0).split("://")[1], fleet.url(1).split("://")[1], proxy.url.split("://")[1]]
    report: list[str] = []

    def phase(name: str, victim: str, inject, recover, stream_cut: bool) -> None:
        pinned = session_on(base, victim)       # the cut stream's session
        with Load(base, session_on(base, victim)) as load:
            time.sleep(0.5)
            stream = CutStream(base, pinned) if stream_cut else None
            if stream is not None:
                assert stream.first.wait(20) and stream.replica == victim, stream.replica
            t_fault = time.monotonic()
            inject()
            def out() -> bool:
                st = replica_state(base, victim)
                return not st["healthy"] or st["circuit_open"]

            detect_s = wait_until(out, timeout=20)
            st = replica_state(base, victim)
            by = "breaker" if st["circuit_open"] else "health checks"
            t_detect = t_fault + detect_s
            time.sleep(1.5)                      # traffic while the replica is out
            during = [o for o in load.outcomes if o.start >= t_detect]
            pinned_r = httpx.post(base + "/v1/chat/completions", headers={"X-Session-ID": pinned}, timeout=60,
                                  json={"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "x"}]})
            recover()
            rejoin_s = wait_until(lambda: replica_state(base, victim)["healthy"]
                                  and not replica_state(base, victim)["circuit_open"], timeout=60)
            assert lands_on(base, victim), f"{name}: the recovered replica got no new session"
        all_out = load.outcomes
        errors_before = [o for o in all_out if o.start < t_detect and (o.status >= 500 or o.status == 0)]
        errors_after = [o for o in during if o.status >= 500 or o.status == 0]
        on_victim = [o for o in during if o.replica == victim]
        ending = stream.result() if stream is not None else "-"
        report.append(f"{name:<12} detected in {detect_s:5.2f}s by {by:<13}  requests {len(all_out):4d}  "
                      f"5xx before detection {len(errors_before)}  after {len(errors_after)}  "
                      f"served by victim after {len(on_victim)}  cut stream: {ending}  rejoined in {rejoin_s:5.2f}s")
        assert during, f"{name}: no traffic after detection"
        assert not errors_after, f"{name}: 5xx after detection: {errors_after[:3]}"
        assert not on_victim, f"{name}: faulty replica still served {len(on_victim)} requests"
        assert pinned_r.status_code == 200 and pinned_r.headers[REPLICA] != victim   # its session rebound
        if stream is not None:
            assert ending == "error_event", f"{name}: {ending}"

    a, b = fleet.procs[0], fleet.procs[1]
    phase("kill -9", ids[0], lambda: fleet.kill(0), lambda: fleet.start([0]), stream_cut=True)
    phase("SIGSTOP", ids[1], lambda: os.kill(b.proc.pid, signal.SIGSTOP),
          lambda: os.kill(b.proc.pid, signal.SIGCONT), stream_cut=True)
    phase("500s", ids[2], lambda: setattr(proxy, "mode", "error500"), lambda: setattr(proxy, "mode", "pass"),
          stream_cut=False)
    phase("slow", ids[2], lambda: setattr(proxy, "mode", "slow"), lambda: setattr(proxy, "mode", "pass"),
          stream_cut=False)
    print("\nrouter chaos (3 replicas, health every 0.25 s, timeout 2 s, 2 failures; breaker 3 failures):")
    print("\n".join(report))
    assert a.proc is not None and a.proc.poll() is None
