"""Counts per block name (SessionTable: how many sessions' contexts hold each block). NameCounts
is the Python reference, a dict; new_name_counts() gives the compiled table
(native/csrc/name_counts.c: no siphash, dict insert or int object per name) when it builds and
EVERYBYTE_NATIVE_NAMES is not 0. tests/test_sessions.py runs both on the same operations."""
from __future__ import annotations

import functools
import os
from typing import Any, Protocol, Sequence

from everybyte.native import loader


class Counts(Protocol):
    def add(self, names: Sequence[bytes], start: int, delta: int) -> None: ...
    def get(self, name: bytes) -> int: ...
    def keys(self) -> Any: ...
    def __getitem__(self, name: bytes) -> int: ...
    def __contains__(self, name: object) -> bool: ...
    def __len__(self) -> int: ...


class NameCounts:
    def __init__(self) -> None:
        self.counts: dict[bytes, int] = {}

    def add(self, names: Sequence[bytes], start: int, delta: int) -> None:
        """counts[n] += delta for each n in names[start:] (absent: 0, or a KeyError when delta
        < 1), removed at 0 or less."""
        counts = self.counts
        for i in range(max(start, 0), len(names)):
            n = names[i]
            if not isinstance(n, bytes):
                raise TypeError(f"a block name must be bytes, not {type(n).__name__}")
            left = (counts.get(n, 0) if delta > 0 else counts[n]) + delta
            if left > 0:
                counts[n] = left
            else:
                del counts[n]

    def get(self, name: bytes) -> int:
        return self.counts.get(name, 0)

    def keys(self) -> Any:
        return list(self.counts)

    def __getitem__(self, name: bytes) -> int:
        return self.counts[name]

    def __contains__(self, name: object) -> bool:
        return name in self.counts

    def __len__(self) -> int:
        return len(self.counts)


@functools.cache
def _native() -> Any:
    if os.environ.get("EVERYBYTE_NATIVE_NAMES", "1") == "0":
        return None
    return loader.try_module("name_counts", "compiled name counts", "a dict", headers=("name_hash.h",))[0]


def new_name_counts() -> Counts:
    module = _native()
    counts: Counts = module.NameCounts() if module is not None else NameCounts()
    return counts
