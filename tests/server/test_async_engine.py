"""AsyncEngine on a real Engine (tiny random Llama), in-process: the thread boundary's contract."""
from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest

from tokenmill.engine.async_engine import AsyncEngine, EngineStepError, EngineStoppedError
from tokenmill.engine.config import EngineConfig
from tokenmill.contracts.sampling import SamplingParams


@pytest.fixture(scope="module")
def aengine(tiny_checkpoint: Path) -> Iterator[AsyncEngine]:
    from tokenmill.engine.engine import Engine

    engine = Engine(EngineConfig(model=str(tiny_checkpoint), kv_cache_tokens=4096, page_size=16,
                                 max_model_len=1024, debug_checks=True))
    ae = AsyncEngine(engine)
    yield ae
    ae.shutdown()
    assert not ae.is_running


def _params(n: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=n, ignore_eos=True, **kw)


def _idle_and_clean(ae: AsyncEngine) -> None:
    s = ae.stats()
    assert s.num_running == 0 and s.num_waiting == 0
    assert s.kv_pages_free + s.kv_pages_cached == s.kv_pages_total


def test_concurrent_requests_all_finish(aengine: AsyncEngine) -> None:
    async def one(i: int) -> list:
        return [out async for out in aengine.generate(f"c{i}", [10 + i, 20, 30, 40], _params(5 + i))]

    async def main() -> list[list]:
        return await asyncio.gather(*(one(i) for i in range(6)))

    results = asyncio.run(main())
    for i, outs in enumerate(results):
        assert outs[-1].finished and outs[-1].finish_reason == "length"
        assert len(outs[-1].token_ids) == 5 + i
        assert sum(len(o.new_token_ids) for o in outs) == 5 + i
        assert all(not o.finished for o in outs[:-1])
    _idle_and_clean(aengine)


def test_cancelling_the_consumer_aborts_the_request(aengine: AsyncEngine) -> None:
    async def main() -> int:
        got = 0
        seen = asyncio.Event()

        async def consume() -> None:
            nonlocal got
            async for _ in aengine.generate("cancel-me", list(range(100, 140)), _params(900)):
                got += 1
                if got == 3:
                    seen.set()

        task = asyncio.create_task(consume())
        await seen.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        # the abort goes through the inbox; wait until the engine thread has taken it
        for _ in range(2000):
            if aengine.stats().num_running == 0:
                break
            await asyncio.sleep(0.005)
        return got

    got = asyncio.run(main())
    assert got >= 3
    _idle_and_clean(aengine)
    assert aengine.stats().generation_tokens_total < 10_000


def test_rejected_request_raises_and_loop_goes_on(aengine: AsyncEngine) -> None:
    async def main() -> int:
        with pytest.raises(ValueError, match="maximum context length"):
            await aengine.submit("too-long", [5] * 1000, _params(100))
        outs = [o async for o in aengine.generate("after", [5, 6, 7], _params(3))]
        return len(outs[-1].token_ids)

    assert asyncio.run(main()) == 3


def test_duplicate_request_id_is_rejected(aengine: AsyncEngine) -> None:
    async def main() -> None:
        stream = await aengine.submit("dup", [1, 2, 3], _params(50))
        with pytest.raises(ValueError, match="already in use"):
            await aengine.submit("dup", [1, 2, 3], _params(5))
        await stream.aclose()

    asyncio.run(main())


def test_step_failure_fails_in_flight_requests_only(aengine: AsyncEngine) -> None:
    engine = aengine.engine
    real_step = engine.step
    calls = {"n": 0}

    def failing_step():  # one injected failure on the third step, then the real engine again
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("injected failure")
        return real_step()

    engine.step = failing_step  # type: ignore[method-assign]
    try:
        async def main() -> int:
            with pytest.raises(EngineStepError, match="injected failure"):
                async for _ in aengine.generate("doomed", [9, 8, 7], _params(50)):
                    pass
            outs = [o async for o in aengine.generate("survivor", [9, 8, 7], _params(4))]
            return len(outs[-1].token_ids)

        assert asyncio.run(main()) == 4
    finally:
        del engine.step
    _idle_and_clean(aengine)


def test_call_and_flush(aengine: AsyncEngine) -> None:
    async def main() -> tuple[bool, bool, int]:
        stream = await aengine.submit("busy", [3, 4, 5], _params(400))
        await stream.__anext__()
        refused = await aengine.flush_cache()
        await stream.aclose()
        flushed = False
        for _ in range(200):
            flushed = await aengine.flush_cache()
            if flushed:
                break
            await asyncio.sleep(0.01)
        pages = await aengine.call(lambda e: e.stats().kv_pages_free)
        return refused, flushed, pages

    refused, flushed, pages = asyncio.run(main())
    assert refused is False and flushed is True
    assert pages == aengine.stats().kv_pages_total


def test_streamed_flag_reaches_the_engine_request(aengine: AsyncEngine) -> None:
    """The server submits a response sent whole with ``streamed=False`` (its decodes then do not
    bound the prefill beside them); the flag must arrive on the engine's request."""
    async def main() -> list[bool]:
        seen = []
        for rid, streamed in (("whole", False), ("streamed", True)):
            stream = await aengine.submit(rid, [5, 6, 7], _params(400), streamed=streamed)
            await stream.__anext__()
            seen.append(await aengine.call(lambda e, rid=rid: e.scheduler.get(rid).streamed))
            await stream.aclose()
        return seen

    assert asyncio.run(main()) == [False, True]


def test_shutdown_rejects_new_work(tiny_checkpoint: Path, aengine: AsyncEngine) -> None:
    from tokenmill.engine.engine import Engine

    ae = AsyncEngine(Engine(EngineConfig(model=str(tiny_checkpoint), kv_cache_tokens=1024, max_model_len=512),
                            loaded=aengine.engine.loaded))

    async def main() -> None:
        stream = await ae.submit("in-flight", [1, 2, 3], _params(400))
        ae.shutdown()
        with pytest.raises(EngineStoppedError):
            async for _ in stream:
                pass
        with pytest.raises(EngineStoppedError):
            await ae.submit("late", [1, 2, 3], _params(2))

    asyncio.run(main())
    assert not ae.is_running


def test_outputs_waiting_for_a_slow_consumer_are_merged(aengine: AsyncEngine) -> None:
    async def main() -> list:
        stream = await aengine.submit("slow-reader", [11, 12, 13], _params(12))
        while aengine.stats().num_running or aengine.stats().num_waiting:
            await asyncio.sleep(0.01)
        await aengine.call(lambda e: None)  # every output delivery was scheduled before this returns
        outs = [o async for o in stream]
        await stream.aclose()
        return outs

    outs = asyncio.run(main())
    assert len(outs) == 1  # twelve steps' outputs, all read at once
    (out,) = outs
    assert out.finished and out.new_token_ids == out.token_ids and len(out.token_ids) == 12
    assert out.new_text == out.text


def test_loop_on_the_callers_thread(tiny_checkpoint: Path) -> None:
    """``start_thread=False``: the engine loop runs where ``run_forever`` is called (here the
    main thread, as in ``tokenmill serve``), the event loop on another thread; requests submitted
    before the loop starts wait for it, and ``shutdown`` from the event-loop thread ends it."""
    import threading

    from tokenmill.engine.engine import Engine

    engine = Engine(EngineConfig(model=str(tiny_checkpoint), kv_cache_tokens=2048, page_size=16,
                                 max_model_len=512, debug_checks=True))
    ae = AsyncEngine(engine, start_thread=False)
    assert ae.is_running   # accepts work: it queues until run_forever starts
    results: dict[str, object] = {}
    engine_threads: set[int] = set()
    real_step = engine.step

    def step():   # the real step, noting which thread calls it
        engine_threads.add(threading.get_ident())
        return real_step()

    engine.step = step  # type: ignore[method-assign]

    async def client() -> None:
        async def one(i: int) -> list:
            return [out async for out in ae.generate(f"main{i}", [5 + i, 6, 7, 8], _params(4 + i))]

        results["outs"] = await asyncio.gather(*(one(i) for i in range(3)))
        results["call"] = await ae.call(lambda e: threading.get_ident())

    def http_side() -> None:
        try:
            asyncio.run(client())
        except BaseException as e:  # noqa: BLE001 - reported by the main thread
            results["error"] = e
        finally:
            ae.shutdown()   # returns once the loop on the main thread has ended

    t = threading.Thread(target=http_side)
    t.start()
    ae.run_forever()        # returns when http_side shuts the engine down
    t.join(30)
    assert not t.is_alive()
    assert "error" not in results, results.get("error")
    main = threading.get_ident()
    assert engine_threads == {main} and results["call"] == main
    for i, outs in enumerate(results["outs"]):  # type: ignore[arg-type]
        assert outs[-1].finished and len(outs[-1].token_ids) == 4 + i
    assert not ae.is_running
    with pytest.raises(RuntimeError, match="already running"):
        ae.run_forever()

    async def late() -> None:
        with pytest.raises(EngineStoppedError):
            await ae.submit("late", [1, 2, 3], _params(2))

    asyncio.run(late())


def test_run_forever_refused_beside_the_background_thread(aengine: AsyncEngine) -> None:
    with pytest.raises(RuntimeError, match="already running"):
        aengine.run_forever()
    assert aengine.is_running


@pytest.mark.parametrize("defer", [True, False])
def test_deferred_delivery_gives_the_same_streams(tiny_checkpoint: Path, defer: bool) -> None:
    """With deferred delivery (AsyncEngine(defer_delivery=True), the default where a core is spare)
    a step's outputs reach the event loop when the next step's computation starts
    (ForwardContext.compute_starts); every stream still gets all its tokens, in order, with the
    same ids as without it, the last output of each request included."""
    from tokenmill.engine.engine import Engine

    engine = Engine(EngineConfig(model=str(tiny_checkpoint), kv_cache_tokens=4096, page_size=16,
                                 max_model_len=1024))
    hooks = [0]
    ae = AsyncEngine(engine, defer_delivery=defer)
    try:
        if defer:
            assert engine.runner.compute_hook is not None
            inner = engine.runner.compute_hook

            def counting() -> None:
                hooks[0] += 1
                inner()

            engine.runner.compute_hook = counting

        async def one(i: int) -> list:
            return [out async for out in ae.generate(f"d{i}", [10 + i, 20, 30, 40, 50], _params(4 + 3 * i, temperature=0.0))]

        async def main() -> list[list]:
            return await asyncio.gather(*(one(i) for i in range(4)))

        results = asyncio.run(main())
    finally:
        ae.shutdown()
    streamed = []
    for i, outs in enumerate(results):
        ids = [t for o in outs for t in o.new_token_ids]
        assert outs[-1].finished and list(outs[-1].token_ids) == ids and len(ids) == 4 + 3 * i
        assert all(not o.finished for o in outs[:-1])
        streamed.append(ids)
    # the same prompts on a plain engine, greedy: the same tokens
    plain = Engine(EngineConfig(model=str(tiny_checkpoint), kv_cache_tokens=4096, page_size=16, max_model_len=1024))
    for i in range(4):
        plain.add_request(f"p{i}", [10 + i, 20, 30, 40, 50], _params(4 + 3 * i, temperature=0.0))
    finals: dict[str, list[int]] = {}
    while plain.has_unfinished_requests():
        for o in plain.step():
            if o.finished:
                finals[o.request_id] = list(o.token_ids)
    assert [finals[f"p{i}"] for i in range(4)] == streamed
    assert (hooks[0] > 0) == defer
