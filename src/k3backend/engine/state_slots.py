"""KDA state slots: one per running sequence, plus prefix snapshots (ENGINE contract §4).

A KDA layer's state cannot be recomputed from MLA blocks, so a cached prefix is usable only up
to a position where a snapshot of every KDA layer's state and conv history was taken. A snapshot
is an ordinary slot, keyed by the content key of the prefix it ends (`block_manager.chain_keys`).
Running sequences come first: when none is free, the least recently used snapshot is evicted.
Slot 0 is the null slot padding rows point at and is never handed out.
"""

from __future__ import annotations

from collections import OrderedDict, deque


class StateSlots:
    """Slots 1..num_slots-1; `usage` is the fraction held by running sequences."""

    def __init__(self, num_slots: int) -> None:
        if num_slots < 2:
            raise ValueError(f"the KDA state pool needs at least 2 slots (one is the null slot), got {num_slots}")
        self.num_slots = num_slots
        self._free: deque[int] = deque(range(1, num_slots))
        self._snapshots: OrderedDict[bytes, int] = OrderedDict()  # key -> slot, least recently used first
        self._running = 0

    @property
    def capacity(self) -> int:
        return self.num_slots - 1

    @property
    def usage(self) -> float:
        return self._running / self.capacity

    def allocate(self) -> int | None:
        """A slot for a running sequence: a free one, else the least recently used snapshot's."""
        slot = self._take()
        if slot is not None:
            self._running += 1
        return slot

    def release(self, slot: int) -> None:
        self._running -= 1
        self._free.append(slot)

    def snapshot(self, key: bytes) -> int | None:
        """The slot of the snapshot of prefix `key`, if one was taken (marks it recently used)."""
        slot = self._snapshots.get(key)
        if slot is not None:
            self._snapshots.move_to_end(key)
        return slot

    def reserve_snapshot(self) -> int | None:
        """A free slot to copy a new snapshot into (never evicts another snapshot for it)."""
        return self._free.popleft() if self._free else None

    def add_snapshot(self, key: bytes, slot: int) -> None:
        """The copy into `slot` is done (after the step); a duplicate key gives its slot back."""
        if key in self._snapshots:
            self._free.append(slot)
        else:
            self._snapshots[key] = slot

    def _take(self) -> int | None:
        if self._free:
            return self._free.popleft()
        if self._snapshots:
            _, slot = self._snapshots.popitem(last=False)
            return slot
        return None
