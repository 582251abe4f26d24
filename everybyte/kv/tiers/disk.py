"""G3: a local directory of block files, LRU within a byte capacity.

Writes are atomic (temp file in the same directory, fsync, os.replace), so a crash mid-write
leaves either no block or a whole one. Each file is framed with a crc32 checked on every read; a
corrupt or truncated file is a miss: counted, logged once, and removed.
"""
from __future__ import annotations

import os
import threading
import time
import uuid
from collections import OrderedDict

from everybyte.kv.tiers.base import FRAME, TierBackend, as_bytes_view, frame_header, unframe

SUFFIX = ".kvb"
TMP_PREFIX = ".tmp-"


class DiskTier(TierBackend):
    kind = "disk"

    def __init__(self, root: str | os.PathLike, capacity_bytes: int, level: str = "G3",
                 fsync: bool = True, on_evict=None, stale_tmp_s: float = 0.0):
        super().__init__(capacity_bytes, level, on_evict)
        self.root = os.path.abspath(os.fspath(root))
        self.fsync = fsync
        os.makedirs(self.root, exist_ok=True)
        self._index: OrderedDict[bytes, int] = OrderedDict()   # name -> file size, LRU order
        self._used = 0
        self._lock = threading.Lock()
        self.rescan(stale_tmp_s)

    def path(self, name: bytes) -> str:
        h = name.hex()
        return os.path.join(self.root, h[:2], h + SUFFIX)

    def rescan(self, stale_tmp_s: float = 0.0) -> None:
        """Rebuild the index from the directory (oldest mtime first); remove leftover temp files."""
        found, now = [], time.time()
        for dirpath, _, files in os.walk(self.root):
            for f in files:
                p = os.path.join(dirpath, f)
                try:
                    st = os.stat(p)
                    if f.startswith(TMP_PREFIX):
                        if now - st.st_mtime >= stale_tmp_s:
                            os.unlink(p)
                    elif f.endswith(SUFFIX) and len(f) == 32 + len(SUFFIX):
                        found.append((st.st_mtime, bytes.fromhex(f[:32]), st.st_size))
                except (OSError, ValueError):
                    continue
        found.sort()
        with self._lock:
            self._index = OrderedDict((name, size) for _, name, size in found)
            self._used = sum(self._index.values())

    # ---- operations ---------------------------------------------------------------------------
    def put(self, name, data) -> bool:
        payload = as_bytes_view(data)
        size = FRAME.size + len(payload)
        if size > self.capacity_bytes:
            self.stats.add("rejected")
            return False
        if self.contains(name):
            self._touch(name)
            return True
        self._make_room(size)
        path = self.path(name)
        tmp = os.path.join(os.path.dirname(path), f"{TMP_PREFIX}{name.hex()}-{uuid.uuid4().hex[:12]}")
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(tmp, "wb") as f:
                f.write(frame_header(payload))
                f.write(payload)
                f.flush()
                if self.fsync:
                    os.fsync(f.fileno())
            os.replace(tmp, path)
        except OSError as e:
            self.stats.add("errors")
            self._warn_once("write", "%s tier %s: cannot write blocks (%s); treating as full", self.kind,
                            self.root, e)
            try:
                os.unlink(tmp)
            except OSError:
                pass
            return False
        with self._lock:
            if name not in self._index:
                self._used += size
            self._index[name] = size
            self._index.move_to_end(name)
        self.stats.add("puts")
        self.stats.add("bytes_written", size)
        return True

    def get(self, name):
        path = self.path(name)
        try:
            with open(path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                buf = bytearray(size)
                got = f.readinto(buf)
        except FileNotFoundError:
            self._drop_index(name)
            self.stats.add("misses")
            return None
        except OSError as e:
            self.stats.add("errors")
            self.stats.add("misses")
            self._warn_once("read", "%s tier %s: read failed (%s); treating as a miss", self.kind, self.root, e)
            return None
        payload = unframe(memoryview(buf)[:got])
        if payload is None:
            self.stats.add("corrupt")
            self.stats.add("misses")
            self._warn_once("corrupt", "%s tier %s: corrupt block %s removed (further ones only counted)",
                            self.kind, self.root, name.hex())
            self._remove(name)
            return None
        self._touch(name, size)
        self.stats.add("hits")
        self.stats.add("bytes_read", got)
        return payload

    def contains(self, name) -> bool:
        return name in self._index

    def delete(self, name) -> bool:
        if self._remove(name):
            self.stats.add("deletes")
            return True
        return False

    # ---- bookkeeping --------------------------------------------------------------------------
    def _touch(self, name: bytes, size: int | None = None) -> None:
        with self._lock:
            if name in self._index:
                self._index.move_to_end(name)
            elif size is not None:
                self._index[name] = size
                self._used += size

    def _drop_index(self, name: bytes) -> None:
        with self._lock:
            size = self._index.pop(name, None)
            if size is not None:
                self._used -= size

    def _remove(self, name: bytes) -> bool:
        self._drop_index(name)
        try:
            os.unlink(self.path(name))
            return True
        except OSError:
            return False

    def _make_room(self, size: int) -> None:
        while True:
            with self._lock:
                if self._used + size <= self.capacity_bytes or not self._index:
                    return
                victim = next(iter(self._index))
            self._remove(victim)
            self._evicted(victim, None)

    def drop_page_cache(self, name: bytes) -> None:
        """Ask the OS to forget a block file's cached pages (for honest bandwidth probes)."""
        try:
            fd = os.open(self.path(name), os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
        except (OSError, AttributeError):
            pass

    @property
    def used_bytes(self) -> int:
        return self._used

    def __len__(self):
        return len(self._index)
