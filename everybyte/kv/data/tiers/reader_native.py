"""The disk reader's C side (native/csrc/disk_reader.c, built by native/loader.py on first use):
ReadProgress runs a ranged read and the consumer's waits without the GIL. It lives here, beside
its user (reader.py), and not in the codec library: it does I/O. `available()` is False when the
build fails (a warning says why); reader.new_progress then uses the pure-Python Progress."""
from __future__ import annotations

import ctypes
import errno
import functools
import os

from everybyte.native import loader

FLAGS = loader.FLAGS + ["-pthread"]


def _build() -> ctypes.CDLL:
    lib = loader.load("disk_reader", loader.csrc("disk_reader.c"), flags=FLAGS)
    lib.progress_new.restype = ctypes.c_void_p
    for name in ("progress_free", "progress_wait", "progress_release", "progress_stop", "progress_end",
                 "read_pieces"):
        getattr(lib, name).restype = None
    return lib


@functools.cache
def _loaded() -> tuple[ctypes.CDLL | None, str | None]:
    """The library and why it is not there, decided once (tests clear the cache)."""
    return loader.try_build("C disk reader", "the Python one", _build)


def available() -> bool:
    return _loaded()[0] is not None


def error() -> str | None:
    return _loaded()[1]


class ReadProgress:
    """A ranged read's progress kept in C (see read_pieces): waits, releases and the reads all run
    without the GIL. Freed when the last Python reference (consumer's or reader's) goes."""

    def __init__(self):
        lib, why = _loaded()
        if lib is None:
            raise RuntimeError(f"C disk reader unavailable: {why}")
        self._lib = lib
        self.handle = ctypes.c_void_p(self._lib.progress_new())
        if not self.handle.value:
            raise MemoryError("progress_new")

    def wait_for(self, nbytes: int) -> tuple[int, bool, Exception | None]:
        out = (ctypes.c_int64 * 3)()
        self._lib.progress_wait(self.handle, ctypes.c_int64(nbytes), out)
        return out[0], bool(out[1]), OSError(out[2], os.strerror(out[2])) if out[2] else None

    def release(self, nbytes: int) -> None:
        self._lib.progress_release(self.handle, ctypes.c_int64(nbytes))

    def stop(self) -> None:
        self._lib.progress_stop(self.handle)

    def end(self, got: int = 0, err: int = 0) -> None:
        self._lib.progress_end(self.handle, ctypes.c_int64(got), ctypes.c_int(err))

    def read(self, fd: int, pieces: list[tuple[int, int, int, int]], buf: memoryview, chunk: int) -> None:
        """Read pieces [(file offset, offset in buf, length, bytes released first)] into buf; the
        progress ends however this returns (an error before the reads: EIO)."""
        try:
            if any(at < 0 or n < 0 or at + n > len(buf) for _, at, n, _ in pieces):
                raise ValueError("a piece lies outside the buffer")
            flat = (ctypes.c_int64 * (4 * len(pieces)))(*(x for piece in pieces for x in piece))
            arr = (ctypes.c_char * len(buf)).from_buffer(buf)
        except BaseException:
            self.end(0, errno.EIO)
            raise
        self._lib.read_pieces(ctypes.c_int(fd), flat, ctypes.c_int64(len(pieces)), arr, ctypes.c_int64(chunk),
                              self.handle)

    def __del__(self):
        if getattr(self, "handle", None) and self.handle.value:
            self._lib.progress_free(self.handle)
            self.handle = None
