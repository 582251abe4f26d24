"""The disk tier's reader alone vs a plain sequential read of the same file, page cache dropped,
interleaved: the C reader (no GIL) and the pure-Python one, each through the tier's ring of
1 MiB pieces with a consumer that only waits and releases, idle and next to a thread running
Python. Prints JSON: bytes/s per reader and each one's median ratio to the plain read.

    everybyte bench disk-reader [--mib 13] [--reps 9] [--json PATH]
"""
from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import threading
import time

import torch

from everybyte.bench import report
from everybyte.bench.micro.memory_tiers import _DiskRead
from everybyte.kv.data.tiers import reader, reader_native
from everybyte.kv.data.tiers.disk import READ_SIZE, RING_SLOTS, STREAM_BYTES


def ring_read(path: str, progress) -> float:
    fd = os.open(path, os.O_RDONLY)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    size = os.fstat(fd).st_size
    pieces, nbytes = reader.plan([(i, min(STREAM_BYTES, size - o)) for i, o in enumerate(range(0, size, STREAM_BYTES))],
                                 0, STREAM_BYTES, RING_SLOTS)
    buf = memoryview(torch.empty(nbytes, dtype=torch.uint8).numpy())
    t0 = time.perf_counter()
    th = threading.Thread(target=reader.read_into, args=(fd, buf, [p for *_, p in pieces], READ_SIZE, progress))
    th.start()
    for _, start, length, _ in pieces:
        progress.wait_for(start + length)
        progress.release(start + length)
    th.join()
    return size / (time.perf_counter() - t0)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="everybyte bench disk-reader", description=__doc__.splitlines()[0])
    p.add_argument("--mib", type=float, default=13.0, help="file size (the bench's 2K-token prefix is ~13 MiB)")
    p.add_argument("--reps", type=int, default=9, help="interleaved runs per reader")
    p.add_argument("--json", metavar="PATH", help="also write the JSON result here")
    args = p.parse_args(argv)
    if args.mib <= 0 or args.reps < 1:
        p.error("--mib must be > 0 and --reps >= 1")
    kinds = {"python": reader.Progress}
    if reader_native.available():
        kinds["c"] = reader_native.ReadProgress
    out = {"file_bytes": int(args.mib * 2**20), "reps": args.reps, "runs": {}, "environment": report.environment()}
    with tempfile.TemporaryDirectory() as root:
        plain = _DiskRead(root, out["file_bytes"], READ_SIZE)
        for busy in (False, True):
            stop = [False]

            def spin():
                while not stop[0]:
                    pass
            th = threading.Thread(target=spin, daemon=True) if busy else None
            if th:
                th.start()
            bws = {k: [] for k in ["plain", *kinds]}
            for _ in range(args.reps):
                bws["plain"].append(plain())
                for k, make in kinds.items():
                    bws[k].append(ring_read(plain.path, make()))
            stop[0] = True
            if th:
                th.join()
            out["runs"]["busy_python_thread" if busy else "idle"] = {
                "bytes_s": {k: statistics.median(v) for k, v in bws.items()},
                "vs_plain_read": {k: statistics.median(a / b for a, b in zip(bws[k], bws["plain"])) for k in kinds}}
    report.emit(out, args.json)
    return 0
