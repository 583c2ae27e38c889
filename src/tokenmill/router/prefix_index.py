"""Approximate per-replica prefix index for requests that carry no session id.

The router cannot see a replica's radix cache, so it keeps its own guess: for every request it
routed, the chained hashes of the prompt's first page-sized chunks, filed under the replica that
served it. A later prompt that starts the same way is most likely cached there.

Chunks and hashes::

    key:     | c0 | c1 | c2 | c3 | ... (whole chunks only; a trailing partial chunk is dropped)
    hashes:    h0   h1   h2   h3        h_i = blake2b(c_i, key=h_{i-1})

Because each hash covers the whole prefix up to its chunk, finding ``h_i`` under a replica means
(up to hash collisions, 64-bit) that the replica has seen the first ``i + 1`` chunks. Each
replica's entries live in a bounded LRU, so the index is approximate in two ways: it forgets
old prefixes, and it does not know what the replica itself evicted.

Pure Python, no I/O: used by the live router and by the fleet simulator through the policies.
"""
from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import NamedTuple


@dataclass(frozen=True)
class PrefixIndexConfig:
    """How prompts are cut into chunks and how much the index remembers.

    ``chunk_tokens`` applies to token-id keys (match the replicas' page size), ``chunk_chars``
    to text keys (about four characters per token). ``max_chunks`` bounds the hashing work per
    request; ``max_entries_per_replica`` bounds memory (LRU beyond it).
    """

    chunk_tokens: int = 16
    chunk_chars: int = 64
    max_chunks: int = 8192
    max_entries_per_replica: int = 65536

    def __post_init__(self) -> None:
        for name in ("chunk_tokens", "chunk_chars", "max_chunks", "max_entries_per_replica"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"PrefixIndexConfig.{name} must be a positive integer, got {value!r}")


class PrefixMatch(NamedTuple):
    replica_id: str | None   # replica with the longest match; None when nothing matched
    num_chunks: int          # matched leading chunks on that replica (0 when none)


def chunk_hashes(key: Sequence[int] | str, chunk_len: int, max_chunks: int) -> list[bytes]:
    """Chained 8-byte hashes of the whole ``chunk_len``-sized chunks at the start of ``key``."""
    n = min(len(key) // chunk_len, max_chunks)
    out: list[bytes] = []
    prev = b""
    for i in range(n):
        part = key[i * chunk_len:(i + 1) * chunk_len]
        if isinstance(part, str):
            data = part.encode("utf-8", "surrogatepass")
        else:
            data = array("q", part).tobytes()
        prev = hashlib.blake2b(data, digest_size=8, key=prev).digest()
        out.append(prev)
    return out


class PrefixIndex:
    """Per-replica LRU sets of chained chunk hashes."""

    def __init__(self, config: PrefixIndexConfig | None = None) -> None:
        self.config = config or PrefixIndexConfig()
        self._entries: dict[str, OrderedDict[bytes, None]] = {}

    def hashes(self, key: Sequence[int] | str | None) -> list[bytes]:
        """Chunk hashes of a prefix key (token ids or text); empty for None or short keys."""
        if key is None:
            return []
        size = self.config.chunk_chars if isinstance(key, str) else self.config.chunk_tokens
        return chunk_hashes(key, size, self.config.max_chunks)

    def match_length(self, replica_id: str, hashes: Sequence[bytes]) -> int:
        """Number of leading chunks of ``hashes`` that ``replica_id`` is believed to hold."""
        entries = self._entries.get(replica_id)
        if not entries or not hashes:
            return 0
        # Membership is prefix-closed (see insert), so binary search finds the longest match.
        # Should a hole appear anyway, the answer is still a length that really matched,
        # because each hash covers its whole prefix.
        lo, hi = 0, len(hashes)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if hashes[mid - 1] in entries:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def best_match(self, replica_ids: Iterable[str], hashes: Sequence[bytes]) -> PrefixMatch:
        """Replica (among ``replica_ids``) with the longest match; ties go to the earliest."""
        best = PrefixMatch(None, 0)
        for rid in replica_ids:
            n = self.match_length(rid, hashes)
            if n > best.num_chunks:
                best = PrefixMatch(rid, n)
        return best

    def insert(self, replica_id: str, hashes: Sequence[bytes]) -> None:
        """Record that ``replica_id`` now holds the prefix; refreshes LRU order of its chunks."""
        if not hashes:
            return
        entries = self._entries.setdefault(replica_id, OrderedDict())
        # Deepest chunk first, so the shallow chunks end up most recent: eviction then trims
        # chains from their tails (like leaves of a radix tree) and membership stays
        # prefix-closed, which match_length's binary search relies on.
        for h in reversed(hashes):
            if h in entries:
                entries.move_to_end(h)
            else:
                entries[h] = None
        limit = self.config.max_entries_per_replica
        while len(entries) > limit:
            entries.popitem(last=False)

    def remove_replica(self, replica_id: str) -> None:
        """Forget everything about a replica (it went away or lost its cache)."""
        self._entries.pop(replica_id, None)

    def replica_ids(self) -> list[str]:
        return list(self._entries)

    def num_entries(self, replica_id: str) -> int:
        return len(self._entries.get(replica_id, ()))
