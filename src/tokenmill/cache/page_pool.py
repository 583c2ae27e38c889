"""A pool of fixed-size KV pages, as plain integer ids (no tensors).

The engine's KV tensors are indexed by these ids; the simulator uses the same pool with no
tensors at all. Allocation is all-or-nothing so a failed request never holds a partial set.
"""
from __future__ import annotations

from collections.abc import Iterable


class PagePool:
    """Free list of page ids ``0 .. num_pages-1``.

    ``alloc`` returns ``None`` rather than a partial list when too few pages are free.
    ``free`` raises ``ValueError`` on a double free or an id out of range, since either means
    page accounting is already broken somewhere upstream.
    """

    def __init__(self, num_pages: int) -> None:
        if num_pages <= 0:
            raise ValueError(f"a page pool needs at least one page, got {num_pages}")
        self.num_pages = num_pages
        # Pop from the end: low ids are handed out first, which keeps tests readable.
        self._free: list[int] = list(range(num_pages - 1, -1, -1))
        self._is_free = bytearray(b"\x01") * num_pages

    def num_free(self) -> int:
        return len(self._free)

    def num_used(self) -> int:
        return self.num_pages - len(self._free)

    def alloc(self, n: int) -> list[int] | None:
        if n < 0:
            raise ValueError(f"cannot allocate {n} pages")
        if n > len(self._free):
            return None
        if n == 0:
            return []
        pages = self._free[-n:]
        del self._free[-n:]
        pages.reverse()
        for p in pages:
            self._is_free[p] = 0
        return pages

    def free(self, pages: Iterable[int]) -> None:
        for p in pages:
            if not 0 <= p < self.num_pages:
                raise ValueError(f"page id {p} is outside the pool of {self.num_pages}")
            if self._is_free[p]:
                raise ValueError(f"page {p} freed twice")
            self._is_free[p] = 1
            self._free.append(p)

    def is_free(self, page: int) -> bool:
        return bool(self._is_free[page])
