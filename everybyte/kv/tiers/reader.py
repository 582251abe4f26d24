"""Sequential reads into a buffer that another thread consumes as they land: the reader runs
on an I/O thread, reports how far it has come, and stops early when asked (so the buffer can be
reused the moment stop() returns)."""
from __future__ import annotations

import os
import threading

from everybyte.formats import cpu_kernels


class Progress:
    """How far a background read has come: bytes in, whether it ended (and why if it failed);
    stop() makes the reader quit and returns once it has."""

    def __init__(self):
        self.got, self.ended, self.error, self.stopping = 0, False, None, False
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

    def stop(self) -> None:
        with self._cond:
            self.stopping = True
            self._cond.wait_for(lambda: self.ended)


def read_into(fd: int, off: int, mv: memoryview, read_size: int, progress: Progress, report: int = 1 << 20) -> None:
    """Fill mv from fd at off with back-to-back reads of read_size, reporting every `report`
    bytes (the C loop reads those without taking the GIL in between); closes fd."""
    got = 0
    try:
        while got < len(mv):
            n = cpu_kernels.read_range(fd, off + got, mv[got:got + report], read_size)
            if n is None:
                n = os.preadv(fd, [mv[got:got + read_size]], off + got)
            if n <= 0:
                break                           # the file is shorter than its table says
            got += n
            if not progress.advance(got):
                break
        progress.advance(got, ended=True)
    except OSError as e:
        progress.advance(got, ended=True, error=e)
    finally:
        os.close(fd)
