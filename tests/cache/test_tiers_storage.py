"""Chained page keys, the host-tier index, page records and the file / Redis backends."""
from __future__ import annotations

import os
import random
import threading
from typing import Any

import pytest

from tokenmill.cache.page_pool import PagePool
from tokenmill.cache.radix import RadixCache
from tokenmill.cache.storage import (FileStorage, PageRecordError, RedisStorage, StorageError,
                                     StorageWorker, decode_page, encode_page, open_storage)
from tokenmill.cache.tiers import HostIndex, PageKeyer, TierDirectory, make_namespace

NS = make_namespace("model-a|abc", "layout", "float32", 4)


def test_keys_chain_and_namespace() -> None:
    k = PageKeyer(NS, 4)
    toks = list(range(100, 117))
    keys = k.keys(toks)
    assert len(keys) == 4 and len(set(keys)) == 4
    assert k.keys(toks[:8]) == keys[:2]                       # a prefix has the prefix's keys
    other = list(toks)
    other[1] = 7                                             # change page 0: every key changes
    assert all(a != b for a, b in zip(k.keys(other), keys))
    other = list(toks)
    other[9] = 7                                             # change page 2: keys 0, 1 stay
    assert k.keys(other)[:2] == keys[:2] and k.keys(other)[2] != keys[2]
    for ns in (make_namespace("model-b|abc", "layout", "float32", 4),
               make_namespace("model-a|abc", "layout", "bfloat16", 4),
               make_namespace("model-a|abc", "layout2", "float32", 4)):
        assert set(PageKeyer(ns, 4).keys(toks)).isdisjoint(keys)


def test_host_index_lru() -> None:
    h = HostIndex(2)
    s0, ev = h.put(b"a" * 16)
    assert ev is None
    h.put(b"b" * 16)
    h.get(b"a" * 16)                                        # a is now most recent
    slot, ev = h.put(b"c" * 16)
    assert ev == (b"b" * 16, slot) and b"b" * 16 not in h
    assert h.leading_run([b"a" * 16, b"c" * 16, b"b" * 16]) == 2
    with pytest.raises(ValueError):
        h.put(b"a" * 16)
    h.clear()
    assert len(h) == 0 and h.pool.num_free() == 2


def test_directory_locates_pages_per_tier() -> None:
    pool = PagePool(8)
    cache = RadixCache(pool, 4)
    keyer = PageKeyer(NS, 4)
    toks = list(range(1, 25))                               # 6 pages
    cache.insert(toks[:8], pool.alloc(2))
    keys = keyer.keys(toks)
    host = HostIndex(4)
    host.put(keys[2])
    d = TierDirectory(cache, keyer, host, {keys[3], keys[5]})
    assert d.locate(toks) == ["l1", "l1", "l2", "l3"]      # page 4 is nowhere: the run stops


def test_record_checks() -> None:
    key = PageKeyer(NS, 4).keys([1, 2, 3, 4])[0]
    payload = os.urandom(64)
    rec = encode_page(NS, key, payload)
    assert decode_page(NS, key, rec, 64) == payload
    cases = {
        "truncated": rec[:-1],
        "corrupt": rec[:-1] + bytes([rec[-1] ^ 1]),
        "foreign": encode_page(make_namespace("x", "y", "float32", 4), key, payload),
    }
    for kind, bad in cases.items():
        with pytest.raises(PageRecordError) as e:
            decode_page(NS, key, bad, 64)
        assert e.value.kind == kind
    with pytest.raises(PageRecordError) as e:
        decode_page(NS, key, rec, 32)                       # another layout's page size
    assert e.value.kind == "foreign"
    with pytest.raises(PageRecordError):
        decode_page(NS, b"z" * 16, rec, 64)
    with pytest.raises(PageRecordError):
        decode_page(NS, key, rec[:10], 64)


def _exercise(backend: Any) -> None:
    keyer = PageKeyer(NS, 4)
    keys = keyer.keys(list(range(40)))
    items = [(k, encode_page(NS, k, bytes([i]) * 32)) for i, k in enumerate(keys[:6])]
    assert backend.exists_leading_run(keys) == 0
    assert backend.put_many(items) == 6
    assert backend.put_many(items[:3]) == 0                 # present pages are not rewritten
    assert backend.exists_leading_run(keys) == 6
    assert backend.exists_leading_run(keys[1:]) == 5
    got = backend.get_many(keys[:7])
    assert got[:6] == [r for _, r in items] and got[6] is None
    assert backend.flush_namespace() == 6
    assert backend.exists_leading_run(keys) == 0


def test_file_backend(tmp_path: Any) -> None:
    b = open_storage(f"file:{tmp_path}", NS)
    assert isinstance(b, FileStorage)
    _exercise(b)
    # atomic writes leave no temporary files behind
    b.put_many([(k, encode_page(NS, k, b"x" * 8)) for k in PageKeyer(NS, 4).keys(list(range(8)))])
    assert not [p for p in tmp_path.rglob(".tmp-*")]
    other = FileStorage(tmp_path, make_namespace("other", "l", "float32", 4))
    assert other.exists_leading_run(PageKeyer(NS, 4).keys(list(range(8)))) == 0


def test_file_backend_full_disk(tmp_path: Any) -> None:
    """A real full filesystem (a 64 KiB tmpfs): writes fail with kind 'full', nothing partial."""
    import subprocess

    mnt = tmp_path / "small"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mnt)],
                      capture_output=True).returncode != 0:
        if os.environ.get("CI"):
            pytest.fail("cannot mount a tmpfs to fill")
        pytest.skip("mounting a small tmpfs needs root")
    try:
        b = FileStorage(mnt, NS)
        keys = PageKeyer(NS, 4).keys(list(range(4 * 40)))
        with pytest.raises(StorageError) as e:
            for k in keys:
                b.put_many([(k, encode_page(NS, k, os.urandom(4000)))])
        assert e.value.kind == "full"
        assert not [p for p in mnt.rglob(".tmp-*")]
        run = b.exists_leading_run(keys)
        assert 0 < run < len(keys)
        for rec, k in zip(b.get_many(keys[:run]), keys):   # every stored page is whole
            decode_page(NS, k, rec, 4000)
        # through the worker (as the engine writes): counted as 'full', the worker goes on
        errors: list[str] = []
        w = StorageWorker(b, on_error=lambda kind, msg: errors.append(kind), on_io=lambda *a: None)
        more = PageKeyer(NS, 4).keys(list(range(1000, 1000 + 4 * 8)))
        assert w.write([(k, os.urandom(4000)) for k in more], encoded=False)
        assert w.drain(10)
        assert errors == ["full"]
        pf = w.prefetch(keys[:run], 4000)
        assert pf.done.wait(10) and len(pf.payloads) == run      # reads still work
        w.close()
    finally:
        subprocess.run(["umount", str(mnt)], check=False)


def test_redis_backend(redis_server: Any) -> None:
    b = open_storage(redis_server.url, NS)
    assert isinstance(b, RedisStorage)
    _exercise(b)
    b.close()


def test_redis_down_is_unavailable() -> None:
    from tokenmill.utils.proc import free_port

    b = RedisStorage(f"redis://127.0.0.1:{free_port()}/0", NS, timeout_s=0.2)
    with pytest.raises(StorageError) as e:
        b.exists_leading_run([b"k" * 16])
    assert e.value.kind == "unavailable"


def test_worker_prefetch_order_and_errors(tmp_path: Any) -> None:
    b = FileStorage(tmp_path, NS)
    keys = PageKeyer(NS, 4).keys(list(range(4 * 70)))
    payloads = [os.urandom(16) for _ in keys]
    b.put_many([(k, encode_page(NS, k, p)) for k, p in zip(keys[:50], payloads)])
    # corrupt page 40: the prefetched run stops just before it
    path = b.path(keys[40])
    raw = bytearray(path.read_bytes())
    raw[-1] ^= 0xFF
    path.write_bytes(bytes(raw))
    errors: list[str] = []
    io: list[tuple[str, int, int]] = []
    lock = threading.Lock()

    def on_error(kind: str, msg: str) -> None:
        with lock:
            errors.append(kind)

    w = StorageWorker(b, on_error=on_error, on_io=lambda *a: io.append(a))
    pf = w.prefetch(keys, 16)
    assert pf.done.wait(10)
    assert pf.run == 50 and pf.payloads == payloads[:40]
    assert errors == ["corrupt"]
    assert w.write([(k, encode_page(NS, k, b"y" * 16)) for k in keys[50:60]])
    assert w.drain(10)
    assert b.exists_leading_run(keys) == 60
    w.close()


def test_random_page_order_roundtrip(tmp_path: Any) -> None:
    """Many writers of the same pages (two replicas): one copy each, always readable."""
    b1, b2 = FileStorage(tmp_path, NS), FileStorage(tmp_path, NS)
    keys = PageKeyer(NS, 4).keys([random.Random(3).randrange(1000) for _ in range(4 * 30)])
    items = [(k, encode_page(NS, k, k * 4)) for k in keys]
    t = threading.Thread(target=b1.put_many, args=(items,))
    t.start()
    b2.put_many(items[::-1])
    t.join()
    assert all(decode_page(NS, k, r, 64) == k * 4 for k, r in zip(keys, b1.get_many(keys)))
