"""Real replicas for router tests: ``tokenmill serve`` processes on a tiny random model.

Helpers shared by the fixtures in conftest.py and by the tests (a uniquely named module, so
``import`` finds it whatever other conftest files are on the path).
"""
from __future__ import annotations

import concurrent.futures
import signal

from tokenmill.utils.proc import ServiceProcess

MODEL = "tiny"


def serve_argv(model_dir: str) -> list[str]:
    return ["serve", "--model", model_dir, "--served-model-name", MODEL, "--kv-cache-tokens", "16384",
            "--session-retention-s", "600", "--log-level", "warning"]


class Fleet:
    """A few replicas started together; ``kill(i)`` stops one hard (SIGKILL)."""

    def __init__(self, model_dir: str, size: int) -> None:
        self.model_dir = model_dir
        self.procs: list[ServiceProcess] = [ServiceProcess(serve_argv(model_dir)) for _ in range(size)]
        self.alive = [False] * size

    def start(self, indices: list[int]) -> None:
        todo = [i for i in indices if not self.alive[i]]
        with concurrent.futures.ThreadPoolExecutor(len(todo) or 1) as pool:
            for i, fut in [(i, pool.submit(self.procs[i].start)) for i in todo]:
                fut.result()
                self.alive[i] = True

    def url(self, i: int) -> str:
        return self.procs[i].base_url

    def kill(self, i: int) -> None:
        self.procs[i].stop(signal.SIGKILL)
        self.alive[i] = False

    def stop(self) -> None:
        live = [p for p in self.procs if p.proc is not None]   # also any that failed to start
        with concurrent.futures.ThreadPoolExecutor(len(live) or 1) as pool:
            list(pool.map(lambda p: p.stop(timeout=10.0), live))
        self.alive = [False] * len(self.procs)


def start_router(urls: list[str], *extra: str) -> ServiceProcess:
    argv = ["route", "--health-interval", "0.3", "--failure-threshold", "1", "--recovery-threshold", "1",
            "--load-interval", "0.2", "--log-level", "warning"]
    for u in urls:
        argv += ["--replica", u]
    return ServiceProcess([*argv, *extra], start_timeout=60).start()


def metric_samples(text: str, name: str) -> dict[frozenset[tuple[str, str]], float]:
    """Samples of one metric in Prometheus text: {frozenset of (label, value)}: value}."""
    import re

    out = {}
    for line in text.splitlines():
        m = re.match(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})? (\S+)$", line)
        if m and m.group(1) == name:
            labels = frozenset(re.findall(r'([a-zA-Z_]+)="([^"]*)"', m.group(2) or ""))
            out[labels] = float(m.group(3))
    return out


def metric(text: str, name: str, **labels: str) -> float:
    want = frozenset(labels.items())
    for lab, v in metric_samples(text, name).items():
        if lab == want:
            return v
    raise KeyError(f"{name}{labels} not in the exposition")
