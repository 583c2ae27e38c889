"""State-pool slots of a hybrid model, as plain integer ids (no tensors).

A hybrid model (:attr:`tokenmill.contracts.kv.KVCacheSpec.is_hybrid`) keeps, beside its paged
attention KV, a fixed-size recurrent + convolution state per request for each linear-attention
layer. The engine's tensors (:class:`tokenmill.layers.state_pool.StatePool`) are indexed by slot
ids handed out here; the simulator can use the same allocator with no tensors at all.

The ids ``0 .. num_slots-1`` are split in two fixed ranges::

    [ 0 .................. num_request_slots-1 | num_request_slots ... num_slots-1 ]
      request slots: one per running request     snapshot slots: prefix-cache state snapshots

A running request owns one request slot from admission to release (finish, abort, preemption);
snapshot slots are for the prefix cache (copies of a request's state at a token boundary). The
two never mix, so snapshots can never starve admission and a full snapshot budget never blocks a
request. Allocation and free are checked like :class:`~tokenmill.cache.page_pool.PagePool`'s.
"""
from __future__ import annotations


class _FreeList:
    def __init__(self, first: int, count: int) -> None:
        self.first, self.count = first, count
        self._free: list[int] = list(range(first + count - 1, first - 1, -1))   # low ids first
        self._is_free = bytearray(b"\x01") * count

    def alloc(self) -> int | None:
        if not self._free:
            return None
        s = self._free.pop()
        self._is_free[s - self.first] = 0
        return s

    def free(self, slot: int, kind: str) -> None:
        i = slot - self.first
        if not 0 <= i < self.count:
            raise ValueError(f"{kind} slot {slot} is outside [{self.first}, {self.first + self.count})")
        if self._is_free[i]:
            raise ValueError(f"{kind} slot {slot} freed twice")
        self._is_free[i] = 1
        self._free.append(slot)

    def is_free(self, slot: int) -> bool:
        return bool(self._is_free[slot - self.first])


class StateSlotPool:
    """Free lists of request slots and snapshot slots (see the module docstring for the layout)."""

    def __init__(self, num_request_slots: int, num_snapshot_slots: int = 0) -> None:
        if num_request_slots <= 0:
            raise ValueError(f"a state pool needs at least one request slot, got {num_request_slots}")
        if num_snapshot_slots < 0:
            raise ValueError(f"num_snapshot_slots must be >= 0, got {num_snapshot_slots}")
        self.num_request_slots = num_request_slots
        self.num_snapshot_slots = num_snapshot_slots
        self._requests = _FreeList(0, num_request_slots)
        self._snapshots = _FreeList(num_request_slots, num_snapshot_slots)

    @property
    def num_slots(self) -> int:
        """Size of the state pool the model runner allocates (request + snapshot slots)."""
        return self.num_request_slots + self.num_snapshot_slots

    # -- request slots ---------------------------------------------------------------------------
    def num_free(self) -> int:
        """Request slots free now."""
        return len(self._requests._free)

    def num_used(self) -> int:
        return self.num_request_slots - self.num_free()

    def alloc(self) -> int | None:
        """A request slot, or None when every one is taken."""
        return self._requests.alloc()

    def free(self, slot: int) -> None:
        """Give a request slot back; raises ValueError on a double free or a foreign id."""
        self._requests.free(slot, "request")

    def is_free(self, slot: int) -> bool:
        return self._requests.is_free(slot)

    # -- snapshot slots (used by the prefix cache) ----------------------------------------------
    def num_free_snapshots(self) -> int:
        return len(self._snapshots._free)

    def alloc_snapshot(self) -> int | None:
        return self._snapshots.alloc()

    def free_snapshot(self, slot: int) -> None:
        self._snapshots.free(slot, "snapshot")
