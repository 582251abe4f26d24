"""G3: a local directory of block files, LRU within a byte capacity.

One block put alone is one file (`<name>.kvb`: a frame with a checksum, then the block). A batch is
one pack file (`<id>.kvp`: a table of names and offsets with its own checksum, then each block framed
as above), so reading it back is one sequential read into one buffer instead of a file per block.
Writes are atomic (temp file in the same directory, fsync, os.replace), so a crash mid-write
leaves either nothing or a whole file. Every frame is checked on read; a corrupt or truncated
block is a miss: counted, logged once, and forgotten. Eviction takes a whole file (UnitIndex).
"""
from __future__ import annotations

import os
import time
import uuid

import torch

from everybyte.kv.data.tiers.buffers import as_bytes_view
from everybyte.kv.data.tiers.disk_files import PACK_SUFFIX, SUFFIX, TMP_PREFIX, file_parts, read_pack_table
from everybyte.kv.data.tiers.reader import new_progress, plan, read_into
from everybyte.kv.data.tiers.units import Unit, UnitIndex
from everybyte.kv.tiers.base import TierBackend, io_executor, parallel
from everybyte.kv.tiers.frame import FRAME, unframe

READ_SIZE = 128 << 10                  # one read call: sequential calls keep the kernel reading ahead
STREAM_BYTES = 1 << 20                 # frames handed on at a time while the rest of a range is read
RING_SLOTS = 4                         # pieces of a long range in memory at once


class DiskTier(TierBackend):
    kind = "disk"

    def __init__(self, root: str | os.PathLike, capacity_bytes: int, level: str = "G3",
                 fsync: bool = True, on_evict=None, stale_tmp_s: float = 0.0):
        super().__init__(capacity_bytes, level, on_evict)
        self.root = os.path.abspath(os.fspath(root))
        self.fsync = fsync
        os.makedirs(self.root, exist_ok=True)
        self._index = UnitIndex()
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
                        found.append((st.st_mtime, Unit({bytes.fromhex(f[:32]): (0, st.st_size)}, st.st_size, p)))
                    elif f.endswith(PACK_SUFFIX) and (blocks := read_pack_table(p)) is not None:
                        found.append((st.st_mtime, Unit(blocks, st.st_size, p)))
                    elif f.endswith(PACK_SUFFIX):
                        os.unlink(p)
                except (OSError, ValueError):
                    continue
        found.sort(key=lambda x: x[0])
        index = UnitIndex()
        for _, unit in found:
            index.add(unit)
        self._index = index

    # ---- writes -------------------------------------------------------------------------------
    def put(self, name, data) -> bool:
        return self.put_many([name], [data])[0]

    def put_many(self, names, datas) -> list[bool]:
        payloads = [as_bytes_view(d) for d in datas]
        new = list({n: p for n, p in zip(names, payloads) if not self._touch(n)}.items())
        if not new:
            return [True] * len(names)
        if len(new) == 1:
            path = self.path(new[0][0])
        else:
            h = uuid.uuid4().hex
            path = os.path.join(self.root, h[:2], h + PACK_SUFFIX)
        parts, blocks = file_parts(new)
        size = sum(len(p) for p in parts)
        if size > self.capacity_bytes:
            self.stats.add("rejected", len(new))
            return [n not in dict(new) for n in names]
        self._make_room(size)
        if not self._write(path, parts):
            return [n not in dict(new) for n in names]
        self._index.add(Unit(blocks, size, path))
        self.stats.add("puts", len(new))
        self.stats.add("bytes_written", size)
        return [True] * len(names)

    def _write(self, path: str, parts: list) -> bool:
        tmp = os.path.join(os.path.dirname(path), f"{TMP_PREFIX}{os.path.basename(path)}-{uuid.uuid4().hex[:12]}")
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(tmp, "wb") as f:
                for p in parts:
                    f.write(p)
                f.flush()
                if self.fsync:
                    os.fsync(f.fileno())
            os.replace(tmp, path)
            return True
        except OSError as e:
            self.stats.add("errors")
            self._warn_once("write", "%s tier %s: cannot write blocks (%s); treating as full", self.kind,
                            self.root, e)
            try:
                os.unlink(tmp)
            except OSError:
                pass
            return False

    # ---- reads --------------------------------------------------------------------------------
    def get(self, name):
        return self.get_many([name])[0]

    def get_many(self, names) -> list:
        out: list = [None] * len(names)
        for batch in self.get_stream(names):
            for i, payload in batch:
                out[i] = payload
        return out

    def get_stream(self, names, scratch=None):
        """Blocks of one pack at adjacent offsets are read as one range with back-to-back
        sequential reads into one buffer (from `scratch` when given), yielded every STREAM_BYTES as
        their frames check out; block files on their own are read in parallel and yielded at once."""
        where, ranges = [], []            # ranges: [path, offset, [(i, size), ...], bytes]
        for i, name in enumerate(names):
            found = self._index.find(name)
            where.append((found[0].path, *found[1], i) if found else (self.path(name), 0, None, i))
        for path, off, size, i in sorted(w for w in where if w[2] is not None):
            r = ranges[-1] if ranges else None
            if r and r[0] == path and r[1] + r[3] == off:
                r[2].append((i, size))
                r[3] += size
            else:
                ranges.append([path, off, [(i, size)], size])
        packs = sorted((r for r in ranges if len(r[2]) > 1), key=lambda r: r[2][0][0])
        singles = [lambda r=r: list(self._read_frames(r[0], r[1], r[2]))[0] for r in ranges if len(r[2]) == 1]
        singles += [lambda path=path, i=i: list(self._read_frames(path, 0, [(i, None)]))[0]
                    for path, _, size, i in where if size is None]
        if singles:
            yield self._settle(names, where, [x for res in parallel(singles) for x in res])
        for path, off, members, _ in packs:
            for batch in self._read_frames(path, off, members, scratch, background=True):
                yield self._settle(names, where, batch)

    def _settle(self, names: list[bytes], where: list, batch: list) -> list:
        """Count a batch of read results [(i, payload or None, error)]; forget what failed."""
        for i, payload, error in batch:
            if error:
                self._failed(names[i], error)
            elif where[i][2] is None:        # a file this index did not know (another node's)
                self._index.add(Unit({names[i]: (0, payload.numel() + FRAME.size)},
                                     payload.numel() + FRAME.size, where[i][0]))
        hits = [p for _, p, _ in batch if p is not None]
        self.stats.add("hits", len(hits))
        self.stats.add("misses", len(batch) - len(hits))
        self.stats.add("bytes_read", sum(p.numel() + FRAME.size for p in hits))
        return [(i, p) for i, p, _ in batch]

    def _read_frames(self, path: str, off: int, members: list, scratch=None, background: bool = False):
        """Read framed blocks [(i, size)] lying back to back at `off` (size None: a whole file)
        with back-to-back sequential reads, and yield [(i, payload view or None, error)] for each
        piece of about STREAM_BYTES once its frames are in and checked. In the background, a
        range over 2 * STREAM_BYTES is read by an I/O thread, so the disk keeps reading while
        this generator checks frames and its consumer copies them (in line, the reads and the
        copies add up). Given scratch, a range longer than RING_SLOTS pieces is read through that
        many piece-sized slots, each reused once the consumer asks for the batch after the one
        read into it: a load needs a few MiB of buffer whatever its size."""
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            yield [(i, None, "missing") for i, _ in members]
            return
        except OSError as e:
            yield [(i, None, e) for i, _ in members]
            return
        try:
            if members[0][1] is None:
                members = [(members[0][0], os.fstat(fd).st_size)]
            nbytes = sum(size for _, size in members)
            background = background and nbytes > 2 * STREAM_BYTES
            pieces, size = plan(members, off, STREAM_BYTES, RING_SLOTS if background and scratch else 0)
            dst = scratch(size) if scratch else torch.empty(size, dtype=torch.uint8)
        except BaseException:
            os.close(fd)
            raise
        places = [place for *_, place in pieces]
        mv, progress = memoryview(dst.numpy()), new_progress()
        if background:
            io_executor().submit(read_into, fd, mv, places, READ_SIZE, progress)
        else:
            read_into(fd, mv, places, READ_SIZE, progress)
        try:
            for group, start, length, (_, at, _, _) in pieces:
                got, ended, error = progress.wait_for(start + length)
                ready, logical = [], start
                for i, size in group:
                    logical += size
                    payload = unframe(mv[at:at + size]) if logical <= got else None
                    ready.append((i, dst[at + FRAME.size:at + size], None) if payload is not None
                                 else (i, None, error or "corrupt"))
                    at += size
                yield ready
                progress.release(start + length)
        finally:
            progress.stop()             # a consumer that stops early: nothing more lands in dst

    def _failed(self, name: bytes, error) -> None:
        if error == "missing":
            self._index.remove(name)
            return
        if error == "corrupt":
            self.stats.add("corrupt")
            self._warn_once("corrupt", "%s tier %s: corrupt block %s removed (further ones only counted)",
                            self.kind, self.root, name.hex())
            self._remove(name)
        else:
            self.stats.add("errors")
            self._warn_once("read", "%s tier %s: read failed (%s); treating as a miss", self.kind, self.root, error)

    # ---- bookkeeping --------------------------------------------------------------------------
    def contains(self, name) -> bool:
        return name in self._index

    def delete(self, name) -> bool:
        if self._remove(name):
            self.stats.add("deletes")
            return True
        return False

    def _touch(self, name: bytes) -> bool:
        """Whether the block is stored (and mark it recently used)."""
        if not self.contains(name):
            return False
        self._index.find(name)
        return True

    def _remove(self, name: bytes) -> bool:
        found = self._index.find(name, touch=False)
        path = found[0].path if found else self.path(name)
        freed = self._index.remove(name)
        if found and freed is None:
            return True               # other blocks of its pack still live there
        try:
            os.unlink(path)
            return True
        except OSError:
            return bool(found)

    def _make_room(self, size: int) -> None:
        while True:
            with self._index.lock:
                if self._index.used + size <= self.capacity_bytes:
                    return
                unit = self._index.pop_lru()
            if unit is None:
                return
            try:
                os.unlink(unit.path)
            except OSError:
                pass
            self._evicted(list(unit.blocks), [None] * len(unit.blocks))

    def drop_page_cache(self, name: bytes) -> None:
        """Ask the OS to forget a block file's cached pages (for honest bandwidth probes)."""
        found = self._index.find(name, touch=False)
        try:
            fd = os.open(found[0].path if found else self.path(name), os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
        except (OSError, AttributeError):
            pass

    @property
    def used_bytes(self) -> int:
        return self._index.used

    def __len__(self):
        return len(self._index)

