"""Start tokenmill (or any) HTTP processes for tests and benchmarks, and wait until healthy."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class ServiceProcess:
    """A subprocess serving HTTP on 127.0.0.1:port; usable as a context manager.

    ``argv`` is the tokenmill subcommand line, e.g. ``["serve", "--model", dir]``; the
    ``--host``/``--port`` flags are appended. Output goes to ``log_path`` (or a temp file) so a
    failed start can show why.
    """

    def __init__(self, argv: list[str], *, port: int | None = None, health_path: str = "/health",
                 start_timeout: float = 180.0, log_path: str | Path | None = None,
                 env: dict[str, str] | None = None, python_module: str = "tokenmill.cli") -> None:
        self.port = port or free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.argv = [sys.executable, "-m", python_module, *argv, "--host", "127.0.0.1", "--port", str(self.port)]
        self.health_path = health_path
        self.start_timeout = start_timeout
        self.log_path = Path(log_path) if log_path else Path(f"/tmp/tokenmill-proc-{self.port}.log")
        self.env = {**os.environ, **(env or {})}
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> "ServiceProcess":
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(self.argv, stdout=self._log, stderr=subprocess.STDOUT, env=self.env)
        deadline = time.monotonic() + self.start_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"process exited with {self.proc.returncode}: {self.log_tail()}")
            try:
                if httpx.get(self.base_url + self.health_path, timeout=2.0).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        self.stop()
        raise TimeoutError(f"{' '.join(self.argv)} not healthy after {self.start_timeout}s: {self.log_tail()}")

    def log_tail(self, n: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> int | None:
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode

    def __enter__(self) -> "ServiceProcess":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
