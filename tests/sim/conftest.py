"""Fixtures of the simulator tests: small closed-loop workloads on the Kimi K2.6 TP4 preset."""
from __future__ import annotations

from collections.abc import Callable

import pytest

from tokenmill.workload import AgenticWorkloadConfig


def _agentic_workload(sessions: int, seed: int = 0) -> AgenticWorkloadConfig:
    return AgenticWorkloadConfig.production(
        num_sessions=sessions, min_turns_per_session=5, thick_session_fraction=0.1,
        thick_session_parallel=3, user_turn_probability=0.02, think_time_scale=0.5, seed=seed)


@pytest.fixture
def agentic_workload() -> Callable[..., AgenticWorkloadConfig]:
    """Production-shaped sessions (to ~100k tokens at turn 30), heterogeneous (5-30 turns), 10%
    thick (3 parallel requests per turn), tool-call heavy with heavy-tailed (lognormal) think
    times: about 5 requests in flight per replica at ~5.75 sessions per replica."""
    return _agentic_workload


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> str:
    from tokenmill.loader.tiny import build_tiny_checkpoint

    path = tmp_path_factory.mktemp("sim-tiny")
    build_tiny_checkpoint(path, arch="LlamaForCausalLM", seed=0)
    return str(path)


@pytest.fixture(scope="session")
def tiny_server(tiny_checkpoint: str, tmp_path_factory: pytest.TempPathFactory):
    """A real ``tokenmill serve`` on the tiny random-weight model."""
    from tokenmill.utils.proc import ServiceProcess

    log = tmp_path_factory.mktemp("sim-logs") / "serve.log"
    with ServiceProcess(["serve", "--model", tiny_checkpoint], log_path=log) as srv:
        yield srv
