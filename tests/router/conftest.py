"""Fixtures for router tests: one fleet of real replicas per test module.

Replicas start in parallel (~10-20 s each on this machine); each test starts its own router
process over the replicas it needs, so router state never leaks between tests. Session ids are
unique per test, so shared replica caches do not either.
"""
from __future__ import annotations

from collections.abc import Iterator

import pytest

from router_fleet import Fleet
from tokenmill.loader.tiny import build_tiny_checkpoint


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(build_tiny_checkpoint(tmp_path_factory.mktemp("router-tiny") / "model"))


@pytest.fixture(scope="module")
def fleet(tiny_dir: str) -> Iterator[Fleet]:
    f = Fleet(tiny_dir, 4)
    try:
        f.start([0, 1, 2, 3])
        yield f
    finally:
        f.stop()
