"""A table's independent rows in worker processes (`sim whatif --jobs`): each row is a pure function
of the shared inputs and its own task, so N processes give the table one gives, in the same order,
sooner. The shared inputs (a trace of thousands of sessions) reach the workers once, at their start
(inherited when processes fork), not with every task."""
from __future__ import annotations

import multiprocessing
import os
from concurrent.futures import ProcessPoolExecutor, as_completed
from concurrent.futures.process import BrokenProcessPool
from typing import Any, Callable

from everybyte.native.host_memory import available_memory_bytes

_shared: tuple[Any, ...] = ()


def _start(shared: tuple[Any, ...]) -> None:
    global _shared
    _shared = shared


def _row(fn: Callable[..., dict[str, Any]], task: tuple[Any, ...]) -> dict[str, Any]:
    return fn(*_shared, *task)


def usable_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:                      # not on Linux
        return os.cpu_count() or 1


def default_jobs(tasks: int, bytes_per_job: int) -> int:
    """One process per usable CPU, at most one per task, and no more than free memory holds at
    bytes_per_job each (at least one)."""
    jobs = min(usable_cpus(), tasks)
    free = available_memory_bytes()
    if free is not None:
        jobs = min(jobs, free // bytes_per_job)
    return max(1, jobs)


def run_rows(fn: Callable[..., dict[str, Any]], shared: tuple[Any, ...], tasks: list[tuple[Any, ...]], jobs: int,
             progress: Callable[[dict[str, Any]], None] | None = None,
             weights: list[float] | None = None) -> list[dict[str, Any]]:
    """[fn(*shared, *task) for task in tasks], in up to `jobs` processes; progress(row) as each is done.
    weights: each task's expected cost; the processes take the heaviest first, so that a long row
    does not start last and run alone. RuntimeError when a worker process dies (e.g. killed for
    memory) before its row is done."""
    if jobs < 1:
        raise ValueError(f"jobs must be at least 1, got {jobs}")
    if jobs == 1 or len(tasks) <= 1:
        rows = []
        for task in tasks:
            rows.append(fn(*shared, *task))
            if progress:
                progress(rows[-1])
        return rows
    method = "fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn"
    out: list[dict[str, Any] | None] = [None] * len(tasks)
    try:
        with ProcessPoolExecutor(min(jobs, len(tasks)), mp_context=multiprocessing.get_context(method),
                                 initializer=_start, initargs=(shared,)) as pool:
            order = sorted(range(len(tasks)), key=lambda i: -weights[i]) if weights else range(len(tasks))
            futures = {pool.submit(_row, fn, tasks[i]): i for i in order}
            try:
                for done in as_completed(futures):
                    row = out[futures[done]] = done.result()
                    if progress:
                        progress(row)
            except BaseException:
                pool.shutdown(wait=False, cancel_futures=True)     # the rows not yet started never start
                raise
    except BrokenProcessPool:
        raise RuntimeError(f"a worker process died before its row was done (killed for memory?): run fewer "
                           f"at once (--jobs {max(1, jobs // 2)})") from None
    return [row for row in out if row is not None]
