"""The unit index of the host and disk tiers: blocks stored together (one batch buffer, one
pack file) form a unit, found by block name and evicted least recently used first."""
from __future__ import annotations

import threading
from collections import OrderedDict


class Unit:
    """Blocks written at once (one host buffer, one file): where each is, and the bytes they hold."""
    __slots__ = ("blocks", "nbytes", "path")

    def __init__(self, blocks: dict, nbytes: int, path: str | None = None):
        self.blocks, self.nbytes, self.path = blocks, nbytes, path


class UnitIndex:
    """Blocks by name, LRU over units; a unit's bytes count until its last block is gone, and
    eviction takes a whole unit (its blocks were written together, so are about as old)."""

    def __init__(self):
        self.lock = threading.RLock()
        self.units: OrderedDict[Unit, None] = OrderedDict()
        self.unit_of: dict[bytes, Unit] = {}
        self.used = 0

    def __len__(self) -> int:
        return len(self.unit_of)

    def __contains__(self, name) -> bool:
        return name in self.unit_of

    def add(self, unit: Unit) -> None:
        with self.lock:
            self.units[unit] = None
            self.used += unit.nbytes
            for name in unit.blocks:
                self.remove(name)
                self.unit_of[name] = unit

    def find(self, name: bytes, touch: bool = True):
        """(unit, where) or None."""
        with self.lock:
            unit = self.unit_of.get(name)
            if unit is None:
                return None
            if touch:
                self.units.move_to_end(unit)
            return unit, unit.blocks[name]

    def remove(self, name: bytes) -> Unit | None:
        """Forget a block; returns its unit if that is now empty (its bytes are no longer counted)."""
        with self.lock:
            unit = self.unit_of.pop(name, None)
            if unit is None:
                return None
            del unit.blocks[name]
            if unit.blocks:
                return None
            self.units.pop(unit, None)
            self.used -= unit.nbytes
            return unit

    def pop_lru(self) -> Unit | None:
        with self.lock:
            if not self.units:
                return None
            unit, _ = self.units.popitem(last=False)
            self.used -= unit.nbytes
            for name in unit.blocks:
                self.unit_of.pop(name, None)
            return unit

    def names(self) -> list[bytes]:
        with self.lock:
            return [n for u in self.units for n in u.blocks]
