"""Replica discovery: a file reloaded on change, and DNS names re-resolved periodically.

Each source owns the replicas it added (``Replica.source``): when a URL disappears from its
file, or an address from its DNS answer, that replica is drained (not cut off), and it leaves
the registry once its in-flight requests end. Replicas from ``--replica`` flags or the admin
API are never touched by discovery.

File format: one URL (``http://host:port`` or ``host:port``) per line; blank lines and text
after ``#`` are ignored.
"""
from __future__ import annotations

import asyncio
import logging
import os
import socket
from dataclasses import dataclass
from pathlib import Path

from tokenmill.router.replicas import ReplicaRegistry, normalize_url, replica_id_for

log = logging.getLogger("tokenmill.router")


def read_replica_file(path: str | Path) -> list[str]:
    """URLs listed in a replica file (normalized); raises ValueError naming the bad line."""
    urls: list[str] = []
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        text = line.split("#", 1)[0].strip()
        if not text:
            continue
        try:
            urls.append(normalize_url(text))
        except ValueError as e:
            raise ValueError(f"{path}:{n}: {e}") from None
    return urls


def parse_dns_target(target: str) -> tuple[str, int]:
    """``NAME:PORT`` -> (name, port); raises ValueError with the expected form."""
    name, sep, port = target.rpartition(":")
    if not sep or not name or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"--replica-dns expects NAME:PORT, got {target!r}")
    return name, int(port)


def sync_source(registry: ReplicaRegistry, source: str, urls: list[str]) -> None:
    """Make the replicas owned by ``source`` match ``urls``: add new ones, drain missing ones."""
    wanted = {replica_id_for(u): u for u in urls}
    for replica in registry.all():
        if replica.source == source and replica.id not in wanted and not replica.draining:
            registry.drain(replica.id)
    for rid, url in wanted.items():
        existing = registry.get(rid)
        if existing is None or existing.source == source:
            registry.add(url, source=source, replica_id=rid)


@dataclass
class Discovery:
    """Periodic discovery loops for one registry."""

    registry: ReplicaRegistry
    replica_file: str | None = None
    dns_targets: tuple[str, ...] = ()
    interval_s: float = 2.0

    def __post_init__(self) -> None:
        if not self.interval_s > 0:
            raise ValueError(f"discovery interval must be > 0, got {self.interval_s!r}")
        for t in self.dns_targets:
            parse_dns_target(t)
        self._file_stamp: tuple[int, int] | None = None
        self._tasks: list[asyncio.Task[None]] = []

    def load_file(self, *, force: bool = False) -> bool:
        """Reload the replica file if it changed (mtime or size); True when it was read.
        A missing or malformed file keeps the current replicas and logs why."""
        if self.replica_file is None:
            return False
        try:
            st = os.stat(self.replica_file)
        except OSError as e:
            log.warning("replica file %s unreadable: %s", self.replica_file, e)
            return False
        stamp = (st.st_mtime_ns, st.st_size)
        if stamp == self._file_stamp and not force:
            return False
        try:
            urls = read_replica_file(self.replica_file)
        except (OSError, ValueError) as e:
            log.warning("replica file not applied: %s", e)
            return False
        self._file_stamp = stamp
        sync_source(self.registry, "file", urls)
        log.info("replica file %s: %d replica(s)", self.replica_file, len(urls))
        return True

    async def resolve_dns(self) -> None:
        """Resolve every DNS target to all its IPv4 addresses and sync the ``dns`` replicas."""
        loop = asyncio.get_running_loop()
        urls: list[str] = []
        for target in self.dns_targets:
            name, port = parse_dns_target(target)
            try:
                infos = await loop.getaddrinfo(name, port, family=socket.AF_INET, type=socket.SOCK_STREAM)
            except OSError as e:
                log.warning("cannot resolve %s: %s; keeping its replicas", target, e)
                return
            urls.extend(f"http://{ip}:{port}" for ip in sorted({info[4][0] for info in infos}))
        sync_source(self.registry, "dns", urls)

    async def _file_loop(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            self.load_file()

    async def _dns_loop(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            await self.resolve_dns()

    async def start(self) -> None:
        """Run one discovery round now, then keep refreshing in the background."""
        if self.replica_file is not None:
            self.load_file(force=True)
            self._tasks.append(asyncio.create_task(self._file_loop()))
        if self.dns_targets:
            await self.resolve_dns()
            self._tasks.append(asyncio.create_task(self._dns_loop()))

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []
