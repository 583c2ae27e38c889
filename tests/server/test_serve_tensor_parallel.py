"""`tokenmill serve --tensor-parallel-size 2`: serves like one rank; a killed rank ends the server,
and a router in front of it sees the replica leave."""
from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from pathlib import Path

import httpx
import openai
import psutil
import pytest

from tokenmill.utils.proc import ServiceProcess


def _rank_pids(server_pid: int) -> list[int]:
    """The server's worker ranks (spawned interpreters), oldest first."""
    kids = [p for p in psutil.Process(server_pid).children()
            if any("spawn_main" in part for part in p.cmdline())]
    return [p.pid for p in sorted(kids, key=lambda p: p.create_time())]


def test_serve_tp2_then_a_killed_rank_stops_the_server(tiny_checkpoint: Path, tmp_path: Path) -> None:
    argv = ["serve", "--model", str(tiny_checkpoint), "--served-model-name", "tiny", "--kv-cache-tokens", "4096",
            "--tensor-parallel-size", "2", "--threads", "1", "--decode-slowdown", "0"]
    one_argv = [a for a in argv if a not in ("--tensor-parallel-size", "2")]
    prompt = "Hello there, how are"
    with ServiceProcess(one_argv, log_path=tmp_path / "one.log") as one:
        ref = openai.OpenAI(base_url=one.base_url + "/v1", api_key="x", max_retries=0).completions.create(
            model="tiny", prompt=prompt, max_tokens=8, temperature=0)
    server = ServiceProcess(argv, log_path=tmp_path / "tp.log")
    with server, contextlib.ExitStack() as stack:
        assert server.proc is not None
        client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0, timeout=60)
        got = client.completions.create(model="tiny", prompt=prompt, max_tokens=8, temperature=0)
        assert got.choices[0].text == ref.choices[0].text
        ranks = _rank_pids(server.proc.pid)
        assert len(ranks) == 2
        router = stack.enter_context(ServiceProcess(
            ["route", "--health-interval", "0.3", "--failure-threshold", "1", "--recovery-threshold", "1",
             "--log-level", "warning", "--replica", server.base_url], start_timeout=60, log_path=tmp_path / "router.log"))
        killed: list[float] = []

        def kill() -> None:
            killed.append(time.monotonic())
            os.kill(ranks[1], signal.SIGKILL)

        threading.Timer(1.0, kill).start()
        with pytest.raises((openai.APIError, httpx.HTTPError)):
            stream = client.completions.create(model="tiny", prompt=prompt, max_tokens=3000, temperature=0,
                                               stream=True, extra_body={"ignore_eos": True})
            for _ in stream:
                pass
            raise AssertionError("the stream finished although a rank was killed")  # pragma: no cover
        try:
            code = server.proc.wait(timeout=20)
        except Exception:  # noqa: BLE001
            pytest.fail(f"the server did not exit after a rank died: {server.log_tail()}")
        assert killed and time.monotonic() - killed[0] < 20
        assert code != 0
        log = server.log_path.read_text(errors="replace")   # the whole log: gloo's own error text is long
        assert "rank 1 exited with code -9" in log, server.log_tail()
        assert not psutil.pid_exists(ranks[0]) or psutil.Process(ranks[0]).status() == psutil.STATUS_ZOMBIE
        deadline = time.monotonic() + 15   # the router sees the replica leave
        while httpx.get(router.base_url + "/health", timeout=5).json()["healthy_replicas"] != 0:
            assert time.monotonic() < deadline, router.log_tail()
            time.sleep(0.2)
