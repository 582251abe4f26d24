"""Sequential reads into a buffer that another thread consumes as they land: the reader runs
on an I/O thread, reports how far it has come, waits before it reuses a part of the buffer the
consumer has not released yet, and stops early when asked (so the buffer can be reused the
moment stop() returns). With the C reader (reader_native.ReadProgress) all of it runs without
the GIL; Progress is the pure-Python fallback with the same methods."""
from __future__ import annotations

import os
import threading

from everybyte.kv.data.tiers import reader_native


class Progress:
    """How far a background read has come: bytes in, whether it ended (and why if it failed),
    bytes the consumer is done with; stop() makes the reader quit and returns once it has."""

    def __init__(self):
        self.got, self.ended, self.error, self.stopping, self.released = 0, False, None, False, 0
        self._cond = threading.Condition()

    def advance(self, got: int, ended: bool = False, error: Exception | None = None) -> bool:
        """Report progress; False when the reader should stop."""
        with self._cond:
            self.got, self.ended, self.error = got, self.ended or ended, self.error or error
            self._cond.notify_all()
            return not self.stopping

    def wait_for(self, nbytes: int) -> tuple[int, bool, Exception | None]:
        with self._cond:
            self._cond.wait_for(lambda: self.got >= nbytes or self.ended)
            return self.got, self.ended, self.error

    def release(self, nbytes: int) -> None:
        """The consumer is done with the first nbytes read."""
        with self._cond:
            self.released = max(self.released, nbytes)
            self._cond.notify_all()

    def wait_released(self, nbytes: int) -> bool:
        """Reader: wait until the first nbytes are released; False when it should stop instead."""
        with self._cond:
            self._cond.wait_for(lambda: self.released >= nbytes or self.stopping)
            return not self.stopping

    def stop(self) -> None:
        with self._cond:
            self.stopping = True
            self._cond.notify_all()
            self._cond.wait_for(lambda: self.ended)

    def read(self, fd: int, pieces: list[tuple[int, int, int, int]], mv: memoryview, chunk: int) -> None:
        """The reader's side (see read_into), in Python."""
        got = 0
        try:
            for file_off, at, length, free_at in pieces:
                if free_at and not self.wait_released(free_at):
                    break
                done = 0
                while done < length:
                    n = os.preadv(fd, [mv[at + done:at + min(length, done + chunk)]], file_off + done)
                    if n <= 0:
                        break                       # the file is shorter than its table says
                    done, got = done + n, got + n
                    if not self.advance(got):
                        break
                if done < length or self.stopping:
                    break
            self.advance(got, ended=True)
        except OSError as e:
            self.advance(got, ended=True, error=e)


def plan(frames: list[tuple[int, int]], off: int, piece_bytes: int, slots: int = 0) -> tuple[list, int]:
    """Group frames [(i, size)] lying back to back at file offset `off` into pieces of at most
    piece_bytes (a larger frame alone), each placed in a buffer for read_into; with `slots` and a
    range longer than that many pieces, the buffer is a ring of `slots` piece-sized slots, a
    piece read once the one before it in its slot is released. [(frames, offset in the range,
    bytes, (file offset, offset in the buffer, bytes, release needed first))], buffer bytes."""
    groups, at = [], 0
    for i, size in frames:
        if groups and groups[-1][2] + size <= piece_bytes:
            groups[-1][0].append((i, size))
            groups[-1][2] += size
        else:
            groups.append([[(i, size)], at, size])
        at += size
    slot = max(g[2] for g in groups) if slots else 0
    slot = slot if slot * slots < at else 0
    out = [(g, start, n, (off + start, j % slots * slot if slot else start, n,
                          groups[j - slots][1] + groups[j - slots][2] if slot and j >= slots else 0))
           for j, (g, start, n) in enumerate(groups)]
    return out, slot * slots if slot else at


def new_progress():
    """The C progress when the C reader builds (reads and waits without the GIL), else Progress."""
    return reader_native.ReadProgress() if reader_native.available() else Progress()


def read_into(fd: int, mv: memoryview, pieces: list[tuple[int, int, int, int]], read_size: int, progress) -> None:
    """Read pieces [(file offset, offset in mv, length, release needed first)] in order, each
    piece once progress.released reaches its last number (the part of mv it lands in is free
    again), with back-to-back reads of read_size; ends the progress and closes fd."""
    try:
        progress.read(fd, pieces, mv, read_size)
    finally:
        os.close(fd)
