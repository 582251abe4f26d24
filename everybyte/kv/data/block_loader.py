"""Loading named blocks from the tiers into G1 without blocking the engine.

A LoadJob locates a run of names across the tiers (first tier that has each), reads them (one
streamed batch read per tier), and as each part comes in checks its blocks against the pool's
header and copies the good ones into the job's G1 blocks with one strided copy per pool field and run
(pool_codec), so a disk read and the copies overlap; all on a worker thread while the engine
keeps stepping other requests. It is the real KVMover (kv/mover.py). The engine thread starts jobs and,
once per step, collects the finished ones to name their blocks in the prefix cache.

A job holds a reference on its blocks until it is collected, so they never go to another request
while the worker may still write them. A job past its deadline is cancelled: cancel() returns
only once the worker can no longer write (the copy runs under the job's lock and checks the flag
first), and whatever it did not load is recomputed. A missing, failing or corrupt block ends the
job's run there: the blocks after it are recomputed too.
"""
from __future__ import annotations

import concurrent.futures as cf
import logging
import threading
from itertools import takewhile
from typing import Hashable

import torch

from everybyte.kv.clock import SYSTEM, Clock
from everybyte.kv.data.tiers.pool_codec import pool_codec
from everybyte.kv.mover import LoadJob
from everybyte.kv.tier_movement import TierSet
from everybyte.kv.tiers.base import job_executor

log = logging.getLogger(__name__)
SCRATCH_MAX = 64 << 20            # a disk read asks for a few MiB (see DiskTier._read_frames)


class BlockLoader:
    def __init__(self, pool, tiers: TierSet, timeout_s: float = 10.0, clock: Clock = SYSTEM):
        self.pool, self.tiers, self.timeout_s, self.clock = pool, tiers, timeout_s, clock
        self.codec = pool_codec(pool)
        self.nbytes = self.codec.nbytes
        self.jobs: list[LoadJob] = []
        self.inflight: dict[bytes, tuple[LoadJob, int]] = {}     # name -> (job, index in the job)
        self._stream = torch.cuda.Stream() if pool.stacks[0].tensor.is_cuda else None
        self._scratch = threading.local()           # per worker thread: memory reads land in

    # ---- engine thread -----------------------------------------------------------------------
    def store(self, block_ids: list[int], names: list[bytes], pin_memory: bool = False) -> torch.Tensor:
        return self.codec.store(block_ids, names, pin_memory=pin_memory)

    def start(self, names: list[bytes], blocks: list[int], owner: Hashable = None,
              prestage: bool = False) -> LoadJob:
        """Load `names` into `blocks` (the caller gives the job one reference on each)."""
        job = LoadJob(list(names), list(blocks), owner, prestage, self.clock.monotonic() + self.timeout_s)
        for i, name in enumerate(job.names):
            self.inflight.setdefault(name, (job, i))
        self.jobs.append(job)
        job.future = job_executor().submit(self._run, job)
        return job

    def in_flight(self, names: list[bytes]) -> list[tuple[LoadJob, int]]:
        """(job, index) for the leading names that some job is loading now."""
        return list(takewhile(lambda hit: hit is not None, map(self.inflight.get, names)))

    def finished(self) -> list[LoadJob]:
        """Jobs done, or past their deadline (cancelled); each is returned once."""
        now, out = self.clock.monotonic(), []
        for job in self.jobs:
            if not job.future.done() and now >= job.deadline:
                self.cancel(job)
                log.warning("load of %d blocks timed out after %.1f s: recomputing", len(job.names), self.timeout_s)
            if job.future.done() or job.cancelled:
                out.append(job)
        for job in out:
            if not job.cancelled and job.future.exception() is not None:
                log.warning("load of %d blocks failed (%r): recomputing", len(job.names), job.future.exception())
            job.finished = True
            self.jobs.remove(job)
            for name in job.names:
                if self.inflight.get(name, (None,))[0] is job:
                    del self.inflight[name]
        return out

    def wait(self, timeout: float) -> bool:
        """Block until a job finishes (or a deadline passes), at most `timeout` s; True if one did."""
        if not self.jobs:
            return False
        timeout = min(timeout, max(min(j.deadline for j in self.jobs) - self.clock.monotonic(), 0.0))
        done, _ = cf.wait([j.future for j in self.jobs], timeout, return_when=cf.FIRST_COMPLETED)
        now = self.clock.monotonic()
        return bool(done) or any(now >= j.deadline for j in self.jobs)

    @staticmethod
    def cancel(job: LoadJob) -> None:
        """After this returns the job's worker writes nothing more into the pool."""
        with job.lock:
            job.cancelled = True

    # ---- worker ------------------------------------------------------------------------------
    def _run(self, job: LoadJob) -> None:
        found = self.tiers.locate(job.names)
        arrived: list = [None] * len(found)          # (tier, buffer or None) as reads come in
        done = 0                                     # leading blocks loaded
        scratch = _Scratch(self._scratch)            # the buffers never outlive this call
        stream = self.tiers.stream(found, job.names[:len(found)], scratch)
        try:
            for tier, batch in stream:
                for i, buf in batch:
                    arrived[i] = (tier, buf)
                end = done
                while end < len(found) and arrived[end] is not None:
                    end += 1
                if end > done and not self._load_run(job, done, arrived[done:end]):
                    return
                done = end
                for i, buf in batch:        # waiting for an earlier block: the tier reuses its read buffer
                    if i >= done and isinstance(buf, torch.Tensor):
                        arrived[i] = (tier, buf.clone())
        finally:
            stream.close()                  # now, not when collected: a disk reader may wait on its ring

    def _load_run(self, job: LoadJob, at: int, got: list) -> bool:
        """Check and copy blocks that arrived for job.names[at:]; False when the job's run ends
        here (a miss, a corrupt block, a cancel)."""
        bufs = list(takewhile(lambda b: b is not None, (buf for _, buf in got)))
        if not bufs:                  # the run ends at its first block (missing or corrupt in the tier)
            return False
        names, blocks = job.names[at:at + len(bufs)], job.blocks[at:at + len(bufs)]
        with job.lock:
            if job.cancelled:
                return False
            if self._stream is None:
                good, err = self.codec.load_checked(bufs, names, blocks)
            else:
                with torch.cuda.stream(self._stream):
                    good, err = self.codec.load_checked(bufs, names, blocks, non_blocking=True)
                self._stream.synchronize()
            job.loaded += [tier.level for tier, _ in got[:good]]
        if err is not None:
            tier, name = got[good][0], names[good]
            log.warning("block %s from %s is corrupt (%s): recomputing", name.hex()[:12], tier.level, err)
            job.corrupt.append(tier.level)
            tier.delete(name)
        return good == len(got)


class _Scratch:
    """The read buffer of a worker thread, reused by every read it does: a tier may overwrite
    what it yielded once the next batch is asked for (the job copies or clones what it keeps),
    so one buffer serves a whole job. Fresh allocations of ~10 MB cost a page fault per 4 KiB on
    every load (~1/3 of a disk read here). It grows to the largest request up to SCRATCH_MAX; a
    larger one is allocated."""

    def __init__(self, local: threading.local):
        self.local = local

    def __call__(self, nbytes: int) -> torch.Tensor:
        buf = getattr(self.local, "arena", None)
        if buf is None or buf.numel() < nbytes:
            if nbytes > SCRATCH_MAX:
                return torch.empty(nbytes, dtype=torch.uint8)
            buf = self.local.arena = torch.empty(nbytes, dtype=torch.uint8)
        return buf[:nbytes]
