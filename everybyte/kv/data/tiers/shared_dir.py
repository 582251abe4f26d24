"""G3.5 / G4: a directory shared by many nodes (NFS, a parallel file system), same files and
semantics as the disk tier. Other nodes add and remove files at any time, so presence is asked of
the file system, reads refresh mtime (the cross-node LRU clock), and the byte count is re-read
from the directory every `rescan_s` seconds and before evicting."""
from __future__ import annotations

import os
import time

from everybyte.kv.data.tiers.disk import DiskTier


class SharedDirTier(DiskTier):
    kind = "shared"

    def __init__(self, root, capacity_bytes: int, level: str = "G3.5", fsync: bool = True,
                 on_evict=None, rescan_s: float = 5.0, stale_tmp_s: float = 3600.0):
        self.rescan_s = rescan_s
        self._scanned_at = 0.0
        self._stale_tmp_s = stale_tmp_s
        super().__init__(root, capacity_bytes, level, fsync, on_evict, stale_tmp_s)

    def rescan(self, stale_tmp_s: float | None = None) -> None:
        super().rescan(self._stale_tmp_s if stale_tmp_s is None else stale_tmp_s)
        self._scanned_at = time.monotonic()

    def _maybe_rescan(self) -> None:
        if time.monotonic() - self._scanned_at >= self.rescan_s:
            self.rescan()

    def contains(self, name) -> bool:
        return os.path.exists(self.path(name))

    def put_many(self, names, datas) -> list[bool]:
        """One file per block, always: other nodes find blocks by name."""
        return [super(SharedDirTier, self).put_many([n], [d])[0] for n, d in zip(names, datas)]

    def get_stream(self, names, scratch=None):
        for batch in super().get_stream(names, scratch):
            for i, payload in batch:
                if payload is not None:
                    try:
                        os.utime(self.path(names[i]))
                    except OSError:
                        pass
            yield batch

    def _make_room(self, size: int) -> None:
        self._maybe_rescan()
        super()._make_room(size)

    @property
    def used_bytes(self) -> int:
        self._maybe_rescan()
        return self._index.used
