"""Fixtures for engine-level prefix-cache tests: one tiny random Llama, loaded once."""
from __future__ import annotations

from typing import Any

import pytest


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """A tiny random-weight Llama through tokenmill's real loader (LoadedModel)."""
    from tokenmill.loader import load_model
    from tokenmill.loader.tiny import build_tiny_checkpoint

    path = build_tiny_checkpoint(tmp_path_factory.mktemp("cache-tiny") / "llama",
                                 "LlamaForCausalLM", seed=3)
    return load_model(str(path))


@pytest.fixture
def redis_server() -> Any:
    """A real redis-server on loopback for one test (skipped outside CI when not installed)."""
    import os

    from tokenmill.utils.redis_server import RedisServer

    try:
        server = RedisServer()
    except FileNotFoundError as e:
        if os.environ.get("CI"):
            pytest.fail(str(e))
        pytest.skip(str(e))
    with server:
        yield server
