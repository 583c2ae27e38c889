"""Start a throw-away ``redis-server`` on loopback (tests and benchmarks of the L3 tier).

The binary is Debian's ``redis-server`` package (installed by the Makefile's ``redis`` target
when missing). Persistence is off: the server lives as long as the test or benchmark.
"""
from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

from tokenmill.utils.proc import free_port


class RedisServer:
    """``with RedisServer() as r: r.url`` -> ``redis://127.0.0.1:PORT/0``; ``kill()`` for faults."""

    def __init__(self, port: int | None = None, *, maxmemory: str | None = None) -> None:
        self.binary = shutil.which("redis-server")
        if self.binary is None:
            raise FileNotFoundError("redis-server is not installed (Debian package redis-server; "
                                    "`make redis` installs it)")
        self.port = port or free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.maxmemory = maxmemory
        self.proc: subprocess.Popen[bytes] | None = None
        self._dir: tempfile.TemporaryDirectory[str] | None = None

    def start(self, timeout: float = 10.0) -> RedisServer:
        self._dir = tempfile.TemporaryDirectory(prefix="tokenmill-redis-")
        argv = [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                "--appendonly", "no", "--dir", self._dir.name, "--protected-mode", "no"]
        if self.maxmemory:
            argv += ["--maxmemory", self.maxmemory, "--maxmemory-policy", "noeviction"]
        log = open(Path(self._dir.name) / "redis.log", "wb")
        self.proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"redis-server exited with {self.proc.returncode}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(16).startswith(b"+PONG"):
                        return self
            except OSError:
                time.sleep(0.05)
        self.kill()
        raise RuntimeError(f"redis-server did not answer on port {self.port} within {timeout} s")

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(5)
        self.proc = None

    def stop(self) -> None:
        self.kill()
        if self._dir is not None:
            self._dir.cleanup()
            self._dir = None

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
