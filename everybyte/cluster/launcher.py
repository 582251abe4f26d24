"""`everybyte cluster`: N `everybyte serve` workers and a router in front of them.

Workers are real processes on free ports (HTTP, KV events, replay), started here (`local`) or as
Ray actors (`ray`, cluster/ray_launcher), each with the CPU threads split between them; once all
answer /health the router starts with one `--worker URL` each (it finds their events through
/v1/kv/info). The launcher watches them: a worker that exits is reported (a JSON line on stdout,
an error on stderr) and the rest keep serving; the router exiting, SIGTERM or SIGINT stops all.
"""
from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Protocol

import httpx

from everybyte.cluster.worker_state import plan_roles

log = logging.getLogger("everybyte.cluster")
THREAD_VARS = ("EVERYBYTE_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")
OWNED_SERVE_ARGS = ("--host", "--port", "--kv-events", "--kv-events-replay", "--role")


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


@dataclass
class WorkerSpec:
    index: int
    role: str                       # both | prefill | decode
    threads: int
    serve_args: list[str] = field(default_factory=list)

    def argv(self, host: str, port: int, events_port: int, replay_port: int) -> list[str]:
        return [sys.executable, "-m", "everybyte.cli", "serve", "--host", host, "--port", str(port),
                "--role", self.role, "--kv-events", f"tcp://{host}:{events_port}",
                "--kv-events-replay", f"tcp://{host}:{replay_port}", *self.serve_args]

    def env(self, base: dict[str, str] | None = None) -> dict[str, str]:
        env = dict(os.environ if base is None else base)
        env.update({v: str(self.threads) for v in THREAD_VARS})
        return env


def plan_workers(workers: int | None, prefill: int | None, decode: int | None, serve_args: list[str],
                 cores: int | None = None, expert_parallel: int = 1) -> list[WorkerSpec]:
    """Roles and threads per worker: --prefill P --decode D makes P+D role workers, else N `both`.
    expert_parallel N: each worker is N rank processes (engine/ep), each with its share of the cores."""
    if expert_parallel < 1:
        raise ValueError(f"--expert-parallel must be >= 1, got {expert_parallel}")
    if expert_parallel > 1:
        serve_args = [*serve_args, "--expert-parallel", str(expert_parallel)]
    for flag in OWNED_SERVE_ARGS:
        if any(a == flag or a.startswith(flag + "=") for a in serve_args):
            raise ValueError(f"{flag} is set by the launcher for each worker; leave it out")
    roles = plan_roles(workers, prefill, decode)
    threads = max(1, (cores or os.cpu_count() or 1) // (len(roles) * expert_parallel))
    return [WorkerSpec(i, r, threads, list(serve_args)) for i, r in enumerate(roles)]


class WorkerHandle(Protocol):
    spec: WorkerSpec
    url: str
    pid: int | None

    def poll(self) -> int | None: ...

    def stop(self, timeout: float) -> int | None: ...


class LocalWorker:
    """A worker process on this machine."""

    def __init__(self, spec: WorkerSpec, host: str = "127.0.0.1"):
        self.spec, port = spec, free_port(host)
        self.url = f"http://{host}:{port}"
        self.proc = subprocess.Popen(spec.argv(host, port, free_port(host), free_port(host)), env=spec.env())
        self.pid: int | None = self.proc.pid

    def poll(self) -> int | None:
        return self.proc.poll()

    def stop(self, timeout: float) -> int | None:
        return stop_process(self.proc, timeout)


def stop_process(proc: subprocess.Popen, timeout: float) -> int | None:
    """SIGTERM (the server drains), then SIGKILL past the timeout."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.returncode


def wait_healthy(targets: list[tuple[str, str, Callable[[], int | None]]], timeout: float,
                 stop: threading.Event | None = None) -> None:
    """Until every (name, url, poll) answers /health; RuntimeError if one exits, the time runs
    out or `stop` is set."""
    pending, deadline = list(targets), time.monotonic() + timeout
    while pending:
        if stop is not None and stop.is_set():
            raise RuntimeError("stopped while starting")
        for t in list(pending):
            name, url, poll = t
            if (rc := poll()) is not None:
                raise RuntimeError(f"{name} ({url}) exited with code {rc} while starting")
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    pending.remove(t)
            except httpx.HTTPError:
                pass
        if pending and time.monotonic() > deadline:
            raise RuntimeError(f"{', '.join(n for n, _, _ in pending)} not healthy after {timeout:.0f} s")
        if pending:
            time.sleep(0.3)


def emit(event: str, **fields) -> None:
    """One JSON line on stdout per cluster event (ready, worker_exited, stopped)."""
    print(json.dumps({"event": event, **fields}), flush=True)


class Cluster:
    def __init__(self, workers: list[WorkerHandle], router_argv: list[str] | None, stop_timeout: float = 30.0):
        self.workers, self.router_argv, self.stop_timeout = workers, router_argv, stop_timeout
        self.router: subprocess.Popen | None = None
        self.stopping = threading.Event()
        self.exited: dict[int, int] = {}

    def start(self, health_timeout: float) -> None:
        wait_healthy([(f"worker {w.spec.index}", w.url, w.poll) for w in self.workers], health_timeout,
                     self.stopping)
        infos = [httpx.get(w.url + "/v1/kv/info", timeout=5).json() for w in self.workers]
        if self.router_argv is not None and self.router_url is not None:
            argv = [*self.router_argv, *[a for w in self.workers for a in ("--worker", w.url)]]
            self.router = router = subprocess.Popen(argv)
            wait_healthy([("the router", self.router_url, router.poll)], health_timeout, self.stopping)
        emit("ready", router=self.router_url,
             workers=[{"index": w.spec.index, "url": w.url, "pid": w.pid, "role": i["role"],
                       "threads": w.spec.threads, "kv_events": i["kv_events"]} for w, i in zip(self.workers, infos)])

    @property
    def router_url(self) -> str | None:
        if self.router_argv is None:
            return None
        port = self.router_argv[self.router_argv.index("--port") + 1]
        return f"http://127.0.0.1:{port}"

    def watch(self, interval: float = 0.5) -> int:
        """Until stopped: report workers that exit; returns the exit code for the launcher."""
        while not self.stopping.wait(interval):
            for w in self.workers:
                if w.spec.index not in self.exited and (rc := w.poll()) is not None:
                    self.exited[w.spec.index] = rc
                    log.error("worker %d (%s) exited with code %s", w.spec.index, w.url, rc)
                    emit("worker_exited", index=w.spec.index, url=w.url, returncode=rc)
            if len(self.exited) == len(self.workers):
                log.error("every worker has exited")
                return 1
            if self.router is not None and (rc := self.router.poll()) is not None:
                log.error("the router exited with code %s", rc)
                return 1
        return 0

    def stop(self) -> None:
        self.stopping.set()
        if self.router is not None:
            stop_process(self.router, self.stop_timeout)
        threads = [threading.Thread(target=w.stop, args=(self.stop_timeout,)) for w in self.workers]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        emit("stopped", workers=len(self.workers))
