"""AsyncEngine: the engine behind a thread boundary, for asyncio servers.

One thread owns the :class:`~tokenmill.engine.engine.Engine` and is the only thread that ever
calls it: a background thread started by the constructor, or (``start_thread=False``) the thread
that calls :meth:`AsyncEngine.run_forever`, typically the process's main thread while the event
loop runs on another one. The second is what ``tokenmill serve`` does: torch's OpenMP kernels run
markedly slower when a thread other than the main thread starts their parallel regions (measured:
a SmolLM2-135M fp32 decode step 26 ms instead of 18 ms on 2 cores; see docs/results/engine.md).
The engine thread loops: drain the command inbox (add, abort, call), run ``Engine.step()``
while there is work, and sleep on an event when there is none. The asyncio side never waits on
a step: it puts commands into a thread-safe queue and receives outputs on per-request
``asyncio.Queue`` objects, filled from the engine thread with ``loop.call_soon_threadsafe``
(one hand-off per step for all requests that progressed).

Contract:

* :meth:`AsyncEngine.submit` returns once the engine thread has accepted the request; a
  ``ValueError`` from ``Engine.add_request`` (bad input) is raised there, before any output.
* :meth:`RequestStream.__anext__` yields :class:`RequestOutput` objects until one is finished.
* Leaving a stream before it finished (``aclose()``, or the consuming task being cancelled while
  it iterates :meth:`AsyncEngine.generate`) aborts the request, which frees its pages.
* An exception raised by ``Engine.step()`` fails the requests that were in flight with an
  :class:`EngineStepError` and the loop keeps serving new requests, except a
  :class:`~tokenmill.contracts.errors.ReplicaFailedError` (a tensor-parallel rank died): then the
  in-flight requests fail, the loop stops (new requests get :class:`EngineStoppedError`),
  :attr:`AsyncEngine.fatal_error` holds the error and ``on_fatal`` is called with it, from the
  engine thread (the server uses it to shut down and exit non-zero).
* :meth:`AsyncEngine.run_forever` (``start_thread=False`` only) runs the loop in the calling thread
  until :meth:`AsyncEngine.shutdown` (from any thread) or a fatal error stops it.
* :meth:`AsyncEngine.stats` returns a snapshot refreshed by the engine thread after every step
  and every batch of commands, so reading it never waits for a step.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import queue
import sys
import threading
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from tokenmill.contracts.errors import ReplicaFailedError
from tokenmill.engine.admission import QueueFullError

if TYPE_CHECKING:
    from tokenmill.engine.engine import Engine, EngineStats
    from tokenmill.engine.request import RequestOutput
    from tokenmill.contracts.sampling import SamplingParams

logger = logging.getLogger(__name__)

T = TypeVar("T")

# GIL switch interval set by an AsyncEngine (Python's default is 5 ms); see AsyncEngine.__init__
SWITCH_INTERVAL_S = 0.0005


class EngineStepError(RuntimeError):
    """The engine failed while running a step that included this request."""


class EngineStoppedError(RuntimeError):
    """The engine loop is not running (shut down, or never started)."""


@dataclass
class _Add:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    session_id: str | None
    stream: RequestStream
    accepted: asyncio.Future[None]
    deadline: float | None = None
    queue_deadline: float | None = None
    streamed: bool = True


@dataclass
class _Abort:
    request_id: str


@dataclass
class _Call:
    fn: Callable[[Engine], Any]
    future: asyncio.Future[Any]
    loop: asyncio.AbstractEventLoop


class RequestStream:
    """Outputs of one request, as an async iterator on the event loop that submitted it.

    When the consumer falls behind the engine, the outputs waiting for it are merged into one
    (cumulative fields from the newest, ``new_token_ids``/``new_text`` concatenated), so a slow
    client costs one hand-off per read, not one per step. An output that finishes the request is
    never merged with what follows, and errors are raised after the outputs before them.

    Always close it (``await stream.aclose()``, or ``async with stream``): closing a stream that
    has not finished aborts the request in the engine.
    """

    def __init__(self, engine: AsyncEngine, request_id: str, loop: asyncio.AbstractEventLoop) -> None:
        self.request_id = request_id
        self._engine = engine
        self._loop = loop
        self._items: deque[RequestOutput | BaseException] = deque()
        self._ready = asyncio.Event()
        self.finished = False
        self.closed = False

    # called on the event loop (scheduled by the engine thread)
    def _put(self, item: RequestOutput | BaseException) -> None:
        self._items.append(item)
        self._ready.set()

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished or self.closed:
            raise StopAsyncIteration
        while not self._items:
            self._ready.clear()
            await self._ready.wait()
        item = self._items.popleft()
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        if not item.finished and self._items and not isinstance(self._items[0], BaseException):
            token_ids, texts = list(item.new_token_ids), [item.new_text]
            lps = list(item.new_logprobs) if item.new_logprobs is not None else None
            while self._items and not isinstance(self._items[0], BaseException) and not item.finished:
                item = self._items.popleft()  # type: ignore[assignment]
                token_ids += item.new_token_ids
                texts.append(item.new_text)
                if lps is not None and item.new_logprobs is not None:
                    lps += item.new_logprobs
            item = dataclasses.replace(item, new_token_ids=token_ids, new_text="".join(texts), new_logprobs=lps)
        if item.finished:
            self.finished = True
        return item

    async def aclose(self) -> None:
        """Stop listening; abort the request in the engine if it has not finished."""
        if self.closed:
            return
        self.closed = True
        self._engine._live_ids.discard(self.request_id)
        if not self.finished:
            self._engine._send(_Abort(self.request_id))

    async def __aenter__(self) -> RequestStream:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


class AsyncEngine:
    """Runs an :class:`Engine` on one thread of its own (a background thread, or the caller's with
    ``start_thread=False`` and :meth:`run_forever`); see the module docstring for the contract."""

    def __init__(self, engine: Engine, *, name: str = "tokenmill-engine",
                 on_fatal: Callable[[BaseException], None] | None = None, start_thread: bool = True,
                 switch_interval_s: float | None = SWITCH_INTERVAL_S, defer_delivery: bool | None = None) -> None:
        self.engine = engine
        self.on_fatal = on_fatal
        self.fatal_error: BaseException | None = None
        self._inbox: queue.SimpleQueue[_Add | _Abort | _Call] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stopping = threading.Event()
        # request_id -> stream; touched only by the engine thread
        self._streams: dict[str, tuple[RequestStream, asyncio.AbstractEventLoop]] = {}
        # request ids submitted and not yet closed; touched only by event-loop code
        self._live_ids: set[str] = set()
        self._stats: EngineStats = engine.stats()
        self._done = threading.Event()      # set when the loop has ended (or never will run)
        self._loop_started = False
        self._loop_ident = 0
        # Deferred delivery: a step's outputs go to the event loops when the next step's
        # computation starts (ForwardContext.compute_starts), not between the steps. The event-loop
        # thread's Python for them (the SSE chunks) then runs while the engine thread is in the
        # native forward with the GIL released, instead of taking the GIL from the engine's
        # scheduling and batch building at each of their torch ops. Only where a core is spare
        # for it (the engine's threads fewer than the process's CPUs): with every core in the
        # forward's thread team, the event loop's work would stall that team at its barriers
        # (benchmarks/serve_ab.py, single stream on 2 cores: 1.10x at --threads 1; a prototype
        # that deferred at --threads 2 measured 0.79x).
        runner = getattr(engine, "runner", None)
        if defer_delivery is None:
            defer_delivery = _spare_core()
        self._defer = bool(defer_delivery) and runner is not None and hasattr(runner, "compute_hook")
        self._pending: list[tuple[asyncio.AbstractEventLoop, list[tuple[RequestStream, RequestOutput]]]] = []
        if self._defer:
            runner.compute_hook = self._deliver_pending
        if switch_interval_s is not None:
            # the engine thread gives the GIL back around every torch op and wants it again right
            # after: with Python's default 5 ms interval, a busy event-loop thread could keep it
            # that long per hand-off (process-wide, and only ever lowered here; on SmolLM2 at
            # concurrency 4 the A/B against 5 ms was within the noise)
            sys.setswitchinterval(min(sys.getswitchinterval(), switch_interval_s))
        self._thread: threading.Thread | None = None
        if start_thread:
            self._thread = threading.Thread(target=self.run_forever, name=name, daemon=True)
            self._thread.start()

    # ------------------------------------------------------------------ asyncio side
    @property
    def is_running(self) -> bool:
        return not self._done.is_set() and not self._stopping.is_set()

    def stats(self) -> EngineStats:
        """Latest snapshot of ``Engine.stats()`` (refreshed after every step and command batch).

        The cache-tier counters are read live: the storage worker moves pages between steps."""
        tiers = getattr(self.engine, "tiers", None)
        if tiers is None:
            return self._stats
        return dataclasses.replace(self._stats, tiers=tiers.snapshot_stats())

    async def submit(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                     session_id: str | None = None, *, deadline: float | None = None,
                     queue_deadline: float | None = None, streamed: bool = True) -> RequestStream:
        """Queue a request; return its stream once the engine accepted it.

        Raises ``ValueError`` when the engine rejects the request (or the id is in use),
        :class:`~tokenmill.engine.admission.QueueFullError` when its waiting queue is full and
        :class:`EngineStoppedError` when the loop is not running. ``deadline``,
        ``queue_deadline`` and ``streamed`` are passed to ``Engine.add_request``.
        """
        if not self.is_running:
            raise EngineStoppedError("the engine is shutting down")
        if request_id in self._live_ids:
            raise ValueError(f"request id {request_id!r} is already in use")
        loop = asyncio.get_running_loop()
        stream = RequestStream(self, request_id, loop)
        accepted: asyncio.Future[None] = loop.create_future()
        self._live_ids.add(request_id)
        try:
            self._send(_Add(request_id, list(prompt_token_ids), params, session_id, stream, accepted,
                            deadline, queue_deadline, streamed))
            await accepted
        except BaseException:
            self._live_ids.discard(request_id)
            if accepted.done() and accepted.exception() is None:
                await stream.aclose()  # accepted, but our caller was cancelled meanwhile
            elif not accepted.done():
                self._send(_Abort(request_id))  # may still be accepted later: abort it then
            raise
        return stream

    async def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                       session_id: str | None = None) -> AsyncIterator[RequestOutput]:
        """Yield the request's outputs until it finishes; leaving early aborts it."""
        stream = await self.submit(request_id, prompt_token_ids, params, session_id)
        try:
            async for out in stream:
                yield out
        finally:
            await stream.aclose()

    async def call(self, fn: Callable[[Engine], T]) -> T:
        """Run ``fn(engine)`` on the engine thread between steps and return its result."""
        if not self.is_running:
            raise EngineStoppedError("the engine is shutting down")
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[T] = loop.create_future()
        self._send(_Call(fn, fut, loop))
        return await fut

    async def flush_cache(self) -> bool:
        """Empty the prefix cache; False when requests are running (nothing is flushed then)."""
        return await self.call(lambda e: e.flush_cache())

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the loop: abort whatever is in flight and wait (up to ``timeout``) for it to end.

        From the engine thread itself, or before :meth:`run_forever` was ever called, it only
        asks the loop to stop."""
        self._stopping.set()
        self._wake.set()
        if self._thread is not None:
            if self._thread is not threading.current_thread():
                self._thread.join(timeout)
        elif self._loop_started and threading.get_ident() != self._loop_ident:
            self._done.wait(timeout)

    def _send(self, cmd: _Add | _Abort | _Call) -> None:
        if isinstance(cmd, _Abort):
            self._live_ids.discard(cmd.request_id)
        self._inbox.put(cmd)
        self._wake.set()
        self._interrupt(True)   # a chain of decode steps running now ends after its current step

    # ------------------------------------------------------------------ engine thread
    def run_forever(self) -> None:
        """Run the engine loop in the calling thread until :meth:`shutdown` or a fatal error.

        Only for an AsyncEngine built with ``start_thread=False`` (the constructor's thread calls
        it otherwise), and only once."""
        if self._loop_started or (self._thread is not None and self._thread is not threading.current_thread()):
            raise RuntimeError("the engine loop is already running (or has run)")
        self._loop_started = True
        self._loop_ident = threading.get_ident()
        try:
            self._run()
        finally:
            self._done.set()

    def _run(self) -> None:
        engine = self.engine
        while not self._stopping.is_set():
            self._wake.clear()
            handled = self._drain_inbox()
            if engine.has_unfinished_requests():
                self._step()  # refreshes the stats snapshot itself
            else:
                self._refresh_stats()
                if not handled:
                    self._wake.wait()
        self._abort_all(EngineStoppedError("the engine shut down before the request finished"))
        self._drain_inbox()
        try:
            engine.close()   # flush queued L3 writes
        except Exception:  # noqa: BLE001
            logger.exception("closing the engine failed")
        self._refresh_stats()

    def _interrupt(self, on: bool) -> None:
        interrupt = getattr(self.engine, "interrupt_chain", None)
        if interrupt is not None:
            interrupt(on)

    def _drain_inbox(self) -> bool:
        self._interrupt(False)   # before the commands are taken: one sent after this sets it again
        handled = False
        accepted: list[_Add] = []
        while True:
            try:
                cmd = self._inbox.get_nowait()
            except queue.Empty:
                break
            handled = True
            if isinstance(cmd, _Add):
                if self._handle_add(cmd):
                    accepted.append(cmd)
            elif isinstance(cmd, _Abort):
                if self._streams.pop(cmd.request_id, None) is not None:
                    try:
                        self.engine.abort_request(cmd.request_id)
                    except Exception:  # noqa: BLE001 - an abort must never stop the loop
                        logger.exception("aborting request %s failed", cmd.request_id)
            else:
                self._handle_call(cmd)
        if accepted:
            self._refresh_stats()  # a caller whose request was accepted sees it in stats()
            for cmd in accepted:
                _resolve(cmd.stream._loop, cmd.accepted, result=None)
        return handled

    def _handle_add(self, cmd: _Add) -> bool:
        """Add the request to the engine; True if accepted (the caller is told after the drain)."""
        loop = cmd.stream._loop
        if self._stopping.is_set():
            _resolve(loop, cmd.accepted, exc=EngineStoppedError("the engine is shutting down"))
            return False
        if cmd.request_id in self._streams:
            _resolve(loop, cmd.accepted, exc=ValueError(f"request id {cmd.request_id!r} is already in use"))
            return False
        try:
            self.engine.add_request(cmd.request_id, cmd.prompt_token_ids, cmd.params, session_id=cmd.session_id,
                                    deadline=cmd.deadline, queue_deadline=cmd.queue_deadline,
                                    streamed=cmd.streamed)
        except Exception as e:  # noqa: BLE001 - reported to that request only
            passed = isinstance(e, (ValueError, QueueFullError))
            _resolve(loop, cmd.accepted, exc=e if passed else EngineStepError(str(e)))
            return False
        self._streams[cmd.request_id] = (cmd.stream, loop)
        return True

    def _handle_call(self, cmd: _Call) -> None:
        try:
            result = cmd.fn(self.engine)
        except Exception as e:  # noqa: BLE001 - reported to the caller
            _resolve(cmd.loop, cmd.future, exc=e)
        else:
            self._refresh_stats()  # whoever awaited the call sees its effect in stats()
            _resolve(cmd.loop, cmd.future, result=result)

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except ReplicaFailedError as e:  # the replica is gone: fail everything and stop the loop
            logger.critical("%s; failing %d in-flight request(s) and stopping the engine", e, len(self._streams))
            self.fatal_error = e
            self._stopping.set()
            self._abort_all(EngineStepError(f"engine step failed: {e}"))
            if self.on_fatal is not None:
                self.on_fatal(e)
            return
        except Exception as e:  # noqa: BLE001 - fail the requests in flight, keep the loop
            logger.exception("engine step failed; failing %d in-flight request(s)", len(self._streams))
            self._abort_all(EngineStepError(f"engine step failed: {e}"))
            return
        per_loop: dict[asyncio.AbstractEventLoop, list[tuple[RequestStream, RequestOutput]]] = {}
        for out in outputs:
            entry = self._streams.get(out.request_id)
            if entry is None:
                continue  # aborted meanwhile
            stream, loop = entry
            per_loop.setdefault(loop, []).append((stream, out))
            if out.finished:
                del self._streams[out.request_id]
        self._refresh_stats()  # before delivery: a client that saw its output sees it counted
        self._deliver_pending()   # a step that ran no forward: the previous outputs go now, in order
        if self._defer and self.engine.has_unfinished_requests():
            self._pending.extend(per_loop.items())   # delivered as the next step computes
            return
        for loop, batch in per_loop.items():
            _call_soon(loop, _deliver, batch)

    def _deliver_pending(self) -> None:
        pending, self._pending = self._pending, []
        for loop, batch in pending:
            _call_soon(loop, _deliver, batch)

    def _abort_all(self, exc: BaseException) -> None:
        self._deliver_pending()   # outputs already made go before the error
        streams = list(self._streams.items())
        self._streams.clear()
        for request_id, (stream, loop) in streams:
            try:
                self.engine.abort_request(request_id)
            except Exception:  # noqa: BLE001
                logger.exception("aborting request %s failed", request_id)
            _call_soon(loop, stream._put, exc)

    def _refresh_stats(self) -> None:
        try:
            self._stats = self.engine.stats()
        except Exception:  # noqa: BLE001 - stats are best effort, the loop must go on
            logger.exception("engine.stats() failed")


def _spare_core() -> bool:
    """Whether the process has a CPU beyond torch's intra-op threads (deferred delivery)."""
    import torch

    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    return torch.get_num_threads() < cpus


def _deliver(batch: list[tuple[RequestStream, RequestOutput]]) -> None:
    for stream, out in batch:
        stream._put(out)


def _call_soon(loop: asyncio.AbstractEventLoop, fn: Callable[..., Any], *args: Any) -> None:
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:  # the loop is closed: nobody is listening any more
        pass


def _resolve(loop: asyncio.AbstractEventLoop, fut: asyncio.Future[Any], *, result: Any = None,
             exc: BaseException | None = None) -> None:
    def set_it() -> None:
        if fut.done():
            return
        if exc is not None:
            fut.set_exception(exc)
        else:
            fut.set_result(result)

    _call_soon(loop, set_it)
