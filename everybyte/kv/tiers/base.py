"""A tier below the device: a byte store of encoded blocks keyed by block name.

Every backend has a byte capacity and put/get/contains/delete; a miss, a full tier, an outage or
corrupt bytes are answers (None / False), never exceptions, and are counted. put_many/get_many
move a batch at once (the host tier keeps a batch in one buffer, the disk tier in one file). The
*_async variants run on small shared thread pools so the engine can overlap I/O with compute:
io_executor for single reads and writes (they never wait on other tasks), job_executor for tasks
that wait on io_executor tasks (batch reads, block loads).
The backends themselves (and the byte helpers they share) are KV data: kv/data/tiers/. This
interface imports no torch, so the tier bookkeeping (kv/tier_movement) loads without it.
"""
from __future__ import annotations

import logging
import threading
from abc import ABC, abstractmethod
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Iterable, Iterator

log = logging.getLogger("everybyte.kv.tiers")

_executors: dict[str, ThreadPoolExecutor] = {}
_executor_lock = threading.Lock()


def _pool(name: str, max_workers: int) -> ThreadPoolExecutor:
    with _executor_lock:
        if name not in _executors:
            _executors[name] = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix=f"everybyte-kv-{name}")
        return _executors[name]


def io_executor(max_workers: int = 4) -> ThreadPoolExecutor:
    return _pool("io", max_workers)


def job_executor(max_workers: int = 2) -> ThreadPoolExecutor:
    return _pool("job", max_workers)


def parallel(fns: list[Callable]) -> list:
    """Run fns on the io executor (the first one on this thread) and return their results."""
    futures = [io_executor().submit(f) for f in fns[1:]]
    return [fns[0]()] + [f.result() for f in futures] if fns else []


class TierStats:
    FIELDS = ("hits", "misses", "puts", "rejected", "evictions", "deletes", "corrupt", "errors",
              "bytes_read", "bytes_written")

    def __init__(self):
        self._lock = threading.Lock()
        self.counts = dict.fromkeys(self.FIELDS, 0)

    def add(self, key: str, n: int = 1) -> None:
        with self._lock:
            self.counts[key] += n

    def __getitem__(self, key: str) -> int:
        return self.counts[key]

    def to_dict(self) -> dict[str, int]:
        with self._lock:
            return dict(self.counts)


class TierBackend(ABC):
    """`kind` is host / disk / redis / shared; `level` the G-level it serves (G2, G3, G3.5, G4).
    `on_evict(name, data)` is called for blocks this tier drops to make room (e.g. to spill them
    one tier down); data is None when the backend cannot hand the bytes back cheaply. When set,
    `on_evict_many(names, datas)` gets a whole evicted batch instead."""
    kind = "tier"

    def __init__(self, capacity_bytes: int, level: str = "", on_evict: Callable | None = None):
        if capacity_bytes <= 0:
            raise ValueError(f"tier capacity must be > 0 bytes, got {capacity_bytes}")
        self.capacity_bytes = int(capacity_bytes)
        self.level = level
        self.on_evict = on_evict
        self.on_evict_many: Callable | None = None
        self.stats = TierStats()
        self._warned: set[str] = set()

    # ---- the four operations --------------------------------------------------------------
    @abstractmethod
    def put(self, name: bytes, data) -> bool:
        """Store an encoded block (bytes-like or a CPU uint8 tensor); False when it cannot
        (larger than the tier, tier down). Storing a name already present is a no-op True."""

    @abstractmethod
    def get(self, name: bytes):
        """The stored bytes (bytes-like or a uint8 tensor), None on a miss of any cause."""

    @abstractmethod
    def contains(self, name: bytes) -> bool: ...

    @abstractmethod
    def delete(self, name: bytes) -> bool: ...

    @property
    @abstractmethod
    def used_bytes(self) -> int: ...

    def __len__(self) -> int:
        return 0

    def put_many(self, names: list[bytes], datas) -> list[bool]:
        """Store a batch (a list of buffers, or a 2-D uint8 tensor of one block per row)."""
        return [self.put(n, d) for n, d in zip(names, datas)]

    def get_many(self, names: list[bytes]) -> list:
        """get() of each name, reads in parallel."""
        return parallel([lambda n=n: self.get(n) for n in names])

    def get_stream(self, names: list[bytes], scratch: Callable | None = None) -> Iterator[list[tuple[int, object]]]:
        """get_many's answers as they come in: batches of (index into names, buffer or None),
        each index once. A backend reading one long range yields its first blocks while the rest
        are still on their way, so the loader copies those meanwhile. `scratch(nbytes)`, when
        given, hands out reusable memory to read into, and then a buffer in a batch may be
        overwritten once the next batch is asked for: the caller copies (or clones) what it
        keeps. Without it the buffers are the caller's."""
        yield list(enumerate(self.get_many(names)))

    def contains_many(self, names: Iterable[bytes]) -> list[bool]:
        return [self.contains(n) for n in names]

    def longest_prefix(self, names: list[bytes]) -> int:
        """How many leading names of a chain this tier holds."""
        for i, n in enumerate(names):
            if not self.contains(n):
                return i
        return len(names)

    def close(self) -> None:
        pass

    # ---- async ------------------------------------------------------------------------------
    def put_async(self, name: bytes, data) -> Future:
        return io_executor().submit(self.put, name, data)

    def get_async(self, name: bytes) -> Future:
        return io_executor().submit(self.get, name)

    def contains_async(self, name: bytes) -> Future:
        return io_executor().submit(self.contains, name)

    def delete_async(self, name: bytes) -> Future:
        return io_executor().submit(self.delete, name)

    def get_many_async(self, names: list[bytes]) -> Future:
        return job_executor().submit(self.get_many, names)

    def put_many_async(self, names: list[bytes], datas) -> Future:
        return io_executor().submit(self.put_many, names, datas)

    # ---- helpers ------------------------------------------------------------------------------
    def _warn_once(self, key: str, msg: str, *args) -> None:
        if key not in self._warned:
            self._warned.add(key)
            log.warning(msg, *args)

    def _evicted(self, names: list[bytes], datas: list) -> None:
        self.stats.add("evictions", len(names))
        try:
            if self.on_evict_many is not None:
                self.on_evict_many(names, datas)
            elif self.on_evict is not None:
                for name, data in zip(names, datas):
                    self.on_evict(name, data)
        except Exception:
            log.exception("%s tier: on_evict failed", self.kind)

    def describe(self) -> dict:
        return {"kind": self.kind, "level": self.level, "capacity_bytes": self.capacity_bytes,
                "used_bytes": self.used_bytes, "blocks": len(self), **self.stats.to_dict()}
