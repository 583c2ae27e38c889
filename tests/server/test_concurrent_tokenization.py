"""Tokenization of many concurrent requests: safe across threads, and it does not serialise.

A fast tokenizer raises "Already borrowed" when two threads use one instance at once; the
server gives each thread its own copy (``TokenizerPool``).
"""
from __future__ import annotations

import asyncio
import random
import threading

import openai
import pytest

from tokenmill.server.common import TokenizerPool

from tests.server.conftest import MODEL_NAME


def _long_text(rng: random.Random, words: int) -> str:
    vocab = ["cache", "token", "session", "agent", "prefix", "kernel", "page", "radix", "batch", "decode"]
    return " ".join(rng.choice(vocab) + str(rng.randrange(100)) for _ in range(words))


def test_32_concurrent_long_chat_and_completion_requests_all_succeed(server):
    rng = random.Random(3)
    texts = [_long_text(rng, 150) for _ in range(32)]
    # a client of this test's own event loop (the shared async client belongs to another loop)
    async_client = openai.AsyncOpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=300)

    async def chat(text: str):
        return await async_client.chat.completions.create(
            model=MODEL_NAME, messages=[{"role": "user", "content": text}], max_tokens=1, temperature=0)

    async def completion(text: str):
        return await async_client.completions.create(model=MODEL_NAME, prompt=text, max_tokens=1, temperature=0)

    async def run():
        async with async_client:
            return await asyncio.gather(*(chat(t) if i % 2 else completion(t) for i, t in enumerate(texts)),
                                        return_exceptions=True)

    results = asyncio.run(run())
    errors = [r for r in results if isinstance(r, BaseException)]
    assert not errors, errors[:3]
    assert all(r.usage.prompt_tokens > 150 for r in results)


def test_pool_gives_each_thread_its_own_copy(tiny_tokenizer):
    pool = TokenizerPool(tiny_tokenizer)
    seen: dict[int, object] = {}

    def work(i: int) -> None:
        tok = pool.get()
        assert pool.get() is tok                     # stable within a thread
        seen[i] = tok
        assert tok.encode("hello world") == tiny_tokenizer.encode("hello world")

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len({id(t) for t in seen.values()}) == 4 and pool.num_copies == 4
    assert all(t is not tiny_tokenizer for t in seen.values())


def test_pool_workers_start_up_front_and_stay_fixed(tiny_tokenizer):
    pool = TokenizerPool(tiny_tokenizer, num_workers=3)
    before = threading.active_count()
    pool.start()
    assert pool.num_copies == 3                      # every worker made its copy at start-up
    assert threading.active_count() == before + 3
    pool.start()                                     # idempotent

    async def many() -> list[list[int]]:
        return await asyncio.gather(*(pool.run(lambda: pool.get().encode("hello world")) for _ in range(32)))

    out = asyncio.run(many())
    assert all(ids == tiny_tokenizer.encode("hello world") for ids in out)
    assert pool.num_copies == 3 and threading.active_count() == before + 3   # no new threads, no new copies
    pool.shutdown()
    with pytest.raises(ValueError, match="at least one worker"):
        TokenizerPool(tiny_tokenizer, num_workers=0)
