"""L3 shared storage for KV pages: the page record format, file and Redis backends, and the
worker thread that moves pages off the engine step's critical path.

This module does I/O but holds no tensors: a page travels as ``bytes`` (its layers' K and V,
exactly as the device pool stores them), wrapped in a checked record.

Record format (little-endian), one per page::

    magic "TMKV" | version u16 | reserved u16 | namespace 16 B | key 16 B | payload length u64
    | crc32 of payload u32 | payload

A record is accepted only if every field matches what the reader expects: its own namespace
(model identity + KV dtype/layout + page size), the key it asked for, the payload size its
layout implies, and the checksum. Anything else is a miss, counted by kind, never data.

Backends implement ``exists_leading_run`` (one batched query), ``exists_many`` (the same for
sparse keys: a hybrid model's state snapshots, stored as records of this format too),
``get_many``, ``put_many`` (never rewriting a present page) and ``flush_namespace``:

* ``file:DIR``: one file per page under ``DIR/<namespace>/<aa>/<key>.kvpage``, written to a
  temporary file in the same folder and renamed into place, so a reader sees a whole record
  or none.
* ``redis://HOST:PORT/DB``: one string value per page under ``tokenmill:kv:<namespace>:<key>``,
  written with ``SET NX``; queries are pipelined (one round trip per batch).
"""
from __future__ import annotations

import errno
import logging
import os
import queue
import shutil
import struct
import tempfile
import threading
import time
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

__all__ = ["FileStorage", "PageRecordError", "Prefetch", "RedisStorage", "StorageBackend",
           "StorageError", "StorageWorker", "decode_page", "encode_page", "open_storage"]

MAGIC = b"TMKV"
RECORD_VERSION = 1
_HEADER = struct.Struct("<4sHH16s16sQI")
HEADER_BYTES = _HEADER.size
REDIS_PREFIX = b"tokenmill:kv:"


class StorageError(Exception):
    """A backend operation failed; ``kind`` names the failure for the error counter."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


class PageRecordError(StorageError):
    """A stored record is not a valid page for this reader (corrupt, truncated, foreign)."""


def encode_page(namespace: bytes, key: bytes, payload: bytes) -> bytes:
    return _HEADER.pack(MAGIC, RECORD_VERSION, 0, namespace, key, len(payload),
                        zlib.crc32(payload)) + payload


def decode_page(namespace: bytes, key: bytes, record: bytes, payload_bytes: int) -> bytes:
    """The payload of ``record`` if it is this namespace's page ``key``; else PageRecordError."""
    if len(record) < HEADER_BYTES:
        raise PageRecordError("truncated", f"page record of {len(record)} bytes has no header")
    magic, version, _, ns, k, length, crc = _HEADER.unpack_from(record)
    if magic != MAGIC or version != RECORD_VERSION:
        raise PageRecordError("corrupt", "page record has a bad magic number or version")
    if ns != namespace:
        raise PageRecordError("foreign", "page record belongs to another model or KV layout")
    if k != key:
        raise PageRecordError("corrupt", "page record holds another page's key")
    if length != payload_bytes:
        raise PageRecordError("foreign", f"page payload is {length} bytes, this layout needs "
                                         f"{payload_bytes}")
    payload = record[HEADER_BYTES:]
    if len(payload) != length:
        raise PageRecordError("truncated", f"page payload has {len(payload)} of {length} bytes")
    if zlib.crc32(payload) != crc:
        raise PageRecordError("corrupt", "page payload fails its checksum")
    return payload


class StorageBackend:
    """get / set / exists-leading-run over page keys of one namespace."""

    url: str = ""

    def __init__(self, namespace: bytes) -> None:
        self.namespace = namespace
        self.ns_hex = namespace.hex()

    def exists_leading_run(self, keys: Sequence[bytes]) -> int:
        raise StorageError("unsupported", f"{type(self).__name__} cannot answer exists queries")

    def get_many(self, keys: Sequence[bytes]) -> list[bytes | None]:
        raise StorageError("unsupported", f"{type(self).__name__} cannot read")

    def exists_many(self, keys: Sequence[bytes]) -> list[bool]:
        """Whether each of ``keys`` is stored (sparse keys: a hybrid model's state snapshots)."""
        return [self.exists_leading_run([k]) == 1 for k in keys]

    def put_many(self, items: Sequence[tuple[bytes, bytes]]) -> int:
        """Store records whose key is absent; returns how many were written."""
        raise StorageError("unsupported", f"{type(self).__name__} cannot write")

    def flush_namespace(self) -> int:
        """Delete every page of this namespace; returns how many were deleted."""
        raise StorageError("unsupported", f"{type(self).__name__} cannot flush")

    def close(self) -> None:
        pass


class FileStorage(StorageBackend):
    def __init__(self, root: str | os.PathLike[str], namespace: bytes) -> None:
        super().__init__(namespace)
        self.root = Path(root)
        self.url = f"file:{self.root}"
        self.dir = self.root / self.ns_hex
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise StorageError("io", f"cannot create the cache folder {self.dir}: {e}") from None

    def path(self, key: bytes) -> Path:
        h = key.hex()
        return self.dir / h[:2] / f"{h}.kvpage"

    def exists_leading_run(self, keys: Sequence[bytes]) -> int:
        n = 0
        for k in keys:
            if not self.path(k).is_file():
                break
            n += 1
        return n

    def exists_many(self, keys: Sequence[bytes]) -> list[bool]:
        return [self.path(k).is_file() for k in keys]

    def get_many(self, keys: Sequence[bytes]) -> list[bytes | None]:
        out: list[bytes | None] = []
        for k in keys:
            try:
                out.append(self.path(k).read_bytes())
            except FileNotFoundError:
                out.append(None)
            except OSError as e:
                raise StorageError("io", f"cannot read {self.path(k)}: {e}") from None
        return out

    def put_many(self, items: Sequence[tuple[bytes, bytes]]) -> int:
        written = 0
        for key, record in items:
            path = self.path(key)
            if path.exists():
                continue
            tmp = None
            try:
                path.parent.mkdir(exist_ok=True)
                fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=path.parent)
                with os.fdopen(fd, "wb") as f:
                    f.write(record)
                os.replace(tmp, path)
                tmp = None
                written += 1
            except OSError as e:
                kind = "full" if e.errno in (errno.ENOSPC, errno.EDQUOT) else "io"
                raise StorageError(kind, f"cannot write {path}: {e}") from None
            finally:
                if tmp is not None:
                    try:
                        os.unlink(tmp)
                    except OSError:
                        pass
        return written

    def flush_namespace(self) -> int:
        n = sum(1 for _ in self.dir.glob("*/*.kvpage"))
        shutil.rmtree(self.dir, ignore_errors=True)
        self.dir.mkdir(parents=True, exist_ok=True)
        return n


class RedisStorage(StorageBackend):
    def __init__(self, url: str, namespace: bytes, *, timeout_s: float = 1.0) -> None:
        super().__init__(namespace)
        import redis

        self.url = url
        self._redis_errors = (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError)
        self._any_error = redis.exceptions.RedisError
        self.client = redis.Redis.from_url(url, socket_timeout=timeout_s,
                                           socket_connect_timeout=timeout_s)
        self.prefix = REDIS_PREFIX + self.ns_hex.encode() + b":"

    def _name(self, key: bytes) -> bytes:
        return self.prefix + key.hex().encode()

    def _call(self, what: str, fn: Callable[[], object]) -> object:
        try:
            return fn()
        except self._redis_errors as e:
            raise StorageError("unavailable", f"redis at {self.url} is unreachable ({what}): {e}") from None
        except self._any_error as e:
            if "OOM" in str(e):
                raise StorageError("full", f"redis at {self.url} is out of memory ({what}): {e}") from None
            raise StorageError("io", f"redis at {self.url} failed ({what}): {e}") from None

    def exists_leading_run(self, keys: Sequence[bytes]) -> int:
        if not keys:
            return 0

        def run() -> list[int]:
            pipe = self.client.pipeline(transaction=False)
            for k in keys:
                pipe.exists(self._name(k))
            return pipe.execute()

        found = self._call("exists", run)
        n = 0
        for f in found:  # type: ignore[union-attr]
            if not f:
                break
            n += 1
        return n

    def exists_many(self, keys: Sequence[bytes]) -> list[bool]:
        if not keys:
            return []

        def run() -> list[int]:
            pipe = self.client.pipeline(transaction=False)
            for k in keys:
                pipe.exists(self._name(k))
            return pipe.execute()

        return [bool(f) for f in self._call("exists", run)]  # type: ignore[union-attr]

    def get_many(self, keys: Sequence[bytes]) -> list[bytes | None]:
        if not keys:
            return []
        return list(self._call("get", lambda: self.client.mget([self._name(k) for k in keys])))  # type: ignore[arg-type]

    def put_many(self, items: Sequence[tuple[bytes, bytes]]) -> int:
        if not items:
            return 0

        def run() -> list[object]:
            pipe = self.client.pipeline(transaction=False)
            for k, record in items:
                pipe.set(self._name(k), record, nx=True)
            return pipe.execute()

        return sum(1 for r in self._call("set", run) if r)  # type: ignore[union-attr]

    def flush_namespace(self) -> int:
        def run() -> int:
            n = 0
            batch: list[bytes] = []
            for name in self.client.scan_iter(match=self.prefix + b"*", count=1000):
                batch.append(name)
                if len(batch) >= 1000:
                    n += self.client.unlink(*batch)
                    batch = []
            if batch:
                n += self.client.unlink(*batch)
            return n

        return int(self._call("flush", run))  # type: ignore[arg-type]

    def close(self) -> None:
        try:
            self.client.close()
        except Exception:  # noqa: BLE001 - closing a dead connection must not raise
            pass


class RankShardedStorage(StorageBackend):
    """Reads of a tensor-parallel replica's pages: rank ``r`` stores its shard of a page under its
    own namespace (``backends[r]``); a page exists only when every rank's record does, and its
    record here is every rank's payload, checked against that rank's namespace and joined in rank
    order, under ``namespace``. Writes are the ranks' own (each through its own backend)."""

    def __init__(self, namespace: bytes, backends: Sequence[StorageBackend], payload_bytes: Sequence[int]) -> None:
        super().__init__(namespace)
        self.backends = list(backends)
        self.payload_bytes = list(payload_bytes)
        self.url = f"{self.backends[0].url} ({len(self.backends)} rank namespaces)"

    def exists_leading_run(self, keys: Sequence[bytes]) -> int:
        n = len(keys)
        for b in self.backends:
            n = b.exists_leading_run(keys[:n])
            if n == 0:
                break
        return n

    def get_many(self, keys: Sequence[bytes]) -> list[bytes | None]:
        per_rank = [b.get_many(keys) for b in self.backends]
        out: list[bytes | None] = []
        for i, key in enumerate(keys):
            records = [recs[i] for recs in per_rank]
            if any(r is None for r in records):
                out.append(None)
                continue
            payload = b"".join(decode_page(b.namespace, key, r, n)   # type: ignore[arg-type]
                               for b, r, n in zip(self.backends, records, self.payload_bytes))
            out.append(encode_page(self.namespace, key, payload))
        return out

    def flush_namespace(self) -> int:
        return min(b.flush_namespace() for b in self.backends)

    def close(self) -> None:
        for b in self.backends:
            b.close()


def open_storage(spec: str, namespace: bytes, *, timeout_s: float = 1.0) -> StorageBackend | None:
    """``none`` -> None, ``file:DIR`` -> FileStorage, ``redis://HOST:PORT/DB`` -> RedisStorage."""
    if spec in ("", "none"):
        return None
    if spec.startswith("file:"):
        root = spec[len("file:"):]
        if not root:
            raise ValueError("--cache-storage file: needs a folder, as in file:/var/cache/tokenmill")
        return FileStorage(root, namespace)
    if spec.startswith(("redis://", "rediss://", "unix://")):
        return RedisStorage(spec, namespace, timeout_s=timeout_s)
    raise ValueError(f"--cache-storage must be none, file:DIR or redis://HOST:PORT/DB, got {spec!r}")


@dataclass
class Prefetch:
    """A leading run of pages being read from L3; ``payloads`` grows in key order."""

    keys: list[bytes]
    payload_bytes: int
    started: float = field(default_factory=time.monotonic)
    payloads: list[bytes] = field(default_factory=list)
    run: int | None = None          # leading run the backend reported (None until known)
    done: threading.Event = field(default_factory=threading.Event)
    cancelled: bool = False
    finished_at: float | None = None
    # Hybrid models: state-snapshot keys of the page boundaries snap_first, snap_first + 1, ...
    # After the pages, the deepest boundary within the pages reachable (page_start + pages read)
    # whose snapshot record reads back whole is kept in ``snapshot`` as (boundary, payload);
    # an unreadable record is counted and the next earlier boundary is tried.
    snap_keys: list[bytes] = field(default_factory=list)
    snap_first: int = 0
    snap_bytes: int = 0
    page_start: int = 0
    snapshot: tuple[int, bytes] | None = None
    snapshot_fallbacks: int = 0


class StorageWorker:
    """One background thread doing every L3 call, prefetches before writes.

    ``on_error(kind, message)`` and ``on_io(op, nbytes, pages)`` are called from the worker
    thread; the receiver keeps them thread-safe (plain counter updates).
    After an ``unavailable`` error the backend is left alone for ``retry_s`` seconds: prefetches
    finish empty at once and writes are dropped (counted), so a dead server costs no timeouts.
    """

    BATCH = 32

    def __init__(self, backend: StorageBackend, *, on_error: Callable[[str, str], None],
                 on_io: Callable[[str, int, int], None], retry_s: float = 2.0,
                 max_queued_writes: int = 4096) -> None:
        self.backend = backend
        self.on_error = on_error
        self.on_io = on_io
        self.retry_s = retry_s
        self.down_until = 0.0
        self._prefetches: queue.SimpleQueue[Prefetch] = queue.SimpleQueue()
        self._writes: queue.Queue[tuple[list[tuple[bytes, Any]], bool]] = queue.Queue(max_queued_writes)
        self._calls: queue.SimpleQueue[tuple[Callable[[], object], queue.SimpleQueue]] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stop = False
        self._idle = threading.Event()
        self._idle.set()
        self.dropped_writes = 0
        self._thread = threading.Thread(target=self._run, name="tokenmill-kv-storage", daemon=True)
        self._thread.start()

    # ---------------------------------------------------------------- engine side
    @property
    def available(self) -> bool:
        return time.monotonic() >= self.down_until

    def prefetch(self, keys: list[bytes], payload_bytes: int, *, page_start: int = 0,
                 snap_keys: Sequence[bytes] = (), snap_first: int = 0, snap_bytes: int = 0) -> Prefetch:
        """Read the leading run of ``keys`` (pages from ``page_start``); with ``snap_keys``, then
        the deepest readable state snapshot within reach (see :class:`Prefetch`)."""
        pf = Prefetch(keys, payload_bytes, snap_keys=list(snap_keys), snap_first=snap_first,
                      snap_bytes=snap_bytes, page_start=page_start)
        if not self.available or not (keys or pf.snap_keys):
            pf.run = 0
            pf.finished_at = time.monotonic()
            pf.done.set()
            return pf
        self._idle.clear()
        self._prefetches.put(pf)
        self._wake.set()
        return pf

    def write(self, items: Sequence[tuple[bytes, Any]], *, encoded: bool = True) -> bool:
        """Queue pages for writing; False (dropped, counted) when the queue is full or L3 is down.

        ``encoded=False``: the items are (key, payload) with any bytes-like payload (a row of a
        snapshot array); the worker builds the records (copy + checksum) off the engine thread.
        """
        if not items:
            return True
        if not self.available:
            self.dropped_writes += len(items)
            return False
        try:
            self._idle.clear()
            self._writes.put_nowait((list(items), encoded))
        except queue.Full:
            self.dropped_writes += len(items)
            return False
        self._wake.set()
        return True

    def call(self, fn: Callable[[], object], timeout: float = 30.0) -> object:
        """Run ``fn`` on the worker thread (in order with its other work) and return its result."""
        box: queue.SimpleQueue = queue.SimpleQueue()
        self._idle.clear()
        self._calls.put((fn, box))
        self._wake.set()
        ok, value = box.get(timeout=timeout)
        if not ok:
            raise value
        return value

    def drain(self, timeout: float = 30.0) -> bool:
        """Wait until every queued prefetch and write is done (tests, shutdown)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._idle.wait(0.01) and self._queues_empty():
                return True
        return False

    def close(self) -> None:
        self.drain(5.0)
        self._stop = True
        self._wake.set()
        self._thread.join(5.0)
        self.backend.close()

    # ---------------------------------------------------------------- worker thread
    def _queues_empty(self) -> bool:
        return self._prefetches.empty() and self._writes.empty() and self._calls.empty()

    def _run(self) -> None:
        while not self._stop:
            self._wake.wait(0.5)
            self._wake.clear()
            while True:
                if not self._calls.empty():
                    fn, box = self._calls.get()
                    try:
                        box.put((True, fn()))
                    except BaseException as e:  # noqa: BLE001 - handed back to the caller
                        box.put((False, e))
                    continue
                if not self._prefetches.empty():
                    self._do_prefetch(self._prefetches.get())
                    continue
                try:
                    items, encoded = self._writes.get_nowait()
                except queue.Empty:
                    break
                self._do_write(items, encoded)
            if self._queues_empty():
                self._idle.set()

    def _failed(self, e: StorageError) -> None:
        if e.kind == "unavailable":
            if self.available:
                log.warning("KV storage tier %s is down; retrying in %.1f s: %s", self.backend.url,
                            self.retry_s, e)
            self.down_until = time.monotonic() + self.retry_s
        else:
            log.warning("KV storage tier %s: %s error: %s", self.backend.url, e.kind, e)
        self.on_error(e.kind, str(e))

    def _do_prefetch(self, pf: Prefetch) -> None:
        try:
            if pf.cancelled or not self.available:
                pf.run = 0
                return
            self._read_pages(pf)
            if pf.snap_keys and not pf.cancelled and self.available:
                self._read_snapshot(pf)
        except StorageError as e:
            self._failed(e)
        except Exception as e:  # noqa: BLE001 - a backend bug must cost a miss, not the engine
            log.exception("KV storage prefetch failed")
            self.on_error("io", str(e))
        finally:
            pf.finished_at = time.monotonic()
            pf.done.set()

    def _read_snapshot(self, pf: Prefetch) -> None:
        top = min(pf.page_start + len(pf.payloads), pf.snap_first + len(pf.snap_keys) - 1)
        bounds = list(range(top, pf.snap_first - 1, -1))      # deepest first
        for i in range(0, len(bounds), self.BATCH):
            if pf.cancelled:
                return
            chunk = bounds[i:i + self.BATCH]
            present = self.backend.exists_many([pf.snap_keys[b - pf.snap_first] for b in chunk])
            for b, there in zip(chunk, present):
                if there and self._read_one_snapshot(pf, b):
                    return

    def _read_one_snapshot(self, pf: Prefetch, b: int) -> bool:
        """Read and check the snapshot after page ``b``; True when it is kept."""
        key = pf.snap_keys[b - pf.snap_first]
        record = self.backend.get_many([key])[0]
        if record is None:          # deleted since the exists query
            return False
        try:
            payload = decode_page(self.backend.namespace, key, record, pf.snap_bytes)
        except PageRecordError as e:
            pf.snapshot_fallbacks += 1
            log.warning("KV storage tier %s: the state snapshot after page %d is unreadable (%s); "
                        "falling back to an earlier one", self.backend.url, b, e)
            self.on_error(e.kind, str(e))
            return False
        self.on_io("read", len(record), 0)
        pf.snapshot = (b, payload)
        return True

    def _read_pages(self, pf: Prefetch) -> None:
        if pf.keys:
            pf.run = self.backend.exists_leading_run(pf.keys)
        else:
            pf.run = 0
        ns = self.backend.namespace
        for i in range(0, pf.run, self.BATCH):
            if pf.cancelled:
                return
            batch = pf.keys[i:min(i + self.BATCH, pf.run)]
            records = self.backend.get_many(batch)
            nbytes = 0
            for key, record in zip(batch, records):
                if record is None:   # deleted since the exists query
                    return
                try:
                    payload = decode_page(ns, key, record, pf.payload_bytes)
                except PageRecordError as e:
                    self._failed(e)
                    return
                nbytes += len(record)
                pf.payloads.append(payload)
            self.on_io("read", nbytes, len(batch))

    def _do_write(self, items: list[tuple[bytes, Any]], encoded: bool) -> None:
        if not self.available:
            self.dropped_writes += len(items)
            return
        ns = self.backend.namespace
        try:
            for i in range(0, len(items), self.BATCH):
                batch = items[i:i + self.BATCH]
                if not encoded:
                    batch = [(k, encode_page(ns, k, bytes(p))) for k, p in batch]
                written = self.backend.put_many(batch)
                self.on_io("write", sum(len(r) for _, r in batch), written)
                self.on_io("present", 0, len(batch) - written)
        except StorageError as e:
            self._failed(e)
        except Exception as e:  # noqa: BLE001
            log.exception("KV storage write failed")
            self.on_error("io", str(e))
