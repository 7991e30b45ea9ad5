"""KDA state slots: live slots of running requests and checkpoints keyed by page hash, with LRU eviction."""

from __future__ import annotations

from collections import OrderedDict


class SlotPool:
    """Owns slot ids 0..num_slots-1; each is exactly one of free, live, checkpoint."""

    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self.free: list[int] = list(range(num_slots - 1, -1, -1))
        self.live: set[int] = set()
        self.checkpoints: OrderedDict[int, int] = OrderedDict()  # page hash -> slot, LRU order (oldest first)

    @property
    def num_checkpoints(self) -> int:
        return len(self.checkpoints)

    def _take(self, protect: set[int] = frozenset()) -> int | None:
        if self.free:
            return self.free.pop()
        for h in self.checkpoints:  # oldest first
            if h not in protect:
                return self.checkpoints.pop(h)
        return None

    def acquire_live(self) -> int | None:
        """A slot for a running request, evicting the LRU checkpoint if none is free; None if impossible."""
        slot = self._take()
        if slot is not None:
            self.live.add(slot)
        return slot

    def release_live(self, slot: int) -> None:
        self.live.remove(slot)
        self.free.append(slot)

    def lookup(self, h: int) -> int | None:
        """The checkpoint slot saved at the boundary ending with page hash h (marks it recently used)."""
        slot = self.checkpoints.get(h)
        if slot is not None:
            self.checkpoints.move_to_end(h)
        return slot

    def new_checkpoint(self, h: int, protect: set[int] = frozenset()) -> int | None:
        """Reserve a slot for a checkpoint keyed h (not evicting keys in `protect`); None if impossible."""
        if h in self.checkpoints:
            return None
        slot = self._take(protect | {h})
        if slot is not None:
            self.checkpoints[h] = slot
        return slot

    def drop_checkpoint(self, h: int) -> None:
        slot = self.checkpoints.pop(h, None)
        if slot is not None:
            self.free.append(slot)

    def check(self) -> None:
        free, ckpt = set(self.free), set(self.checkpoints.values())
        assert len(free) == len(self.free) and len(ckpt) == len(self.checkpoints), "slot listed twice"
        assert not (free & self.live) and not (free & ckpt) and not (self.live & ckpt), "slot in two states"
        assert len(free) + len(self.live) + len(ckpt) == self.num_slots, "slot lost"
