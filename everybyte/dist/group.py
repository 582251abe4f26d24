"""ProcessGroup: the ranks of one expert-parallel group on torch.distributed and the collectives
models/ uses, each with a timeout and a clear error when a peer rank dies.

Two torch groups: the data group (gloo on CPU, NCCL on GPU) carries token rows and expert weights
and every operation on it times out after `timeout_s`; the control group (always gloo, CPU)
carries python objects such as the step header that worker ranks wait on while the engine is idle,
so its waits have no practical limit (a dead rank 0 still ends them at once: its sockets close).
A failed collective names the rank whose process is gone; after a failure the group is broken and
every later call raises the same error at once instead of waiting on a peer that cannot answer.
"""
from __future__ import annotations

import os
import pickle
import socket
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist

from everybyte.dist.liveness import Peer, dead_peers, me

IDLE_WAIT = timedelta(days=365)        # the control group: idle workers wait for the next step


class RankDiedError(RuntimeError):
    def __init__(self, message: str, rank: int | None):
        super().__init__(message)
        self.rank = rank


class CollectiveTimeoutError(RuntimeError):
    pass


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def backend_for(device: str | torch.device) -> str:
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


class ProcessGroup:
    """One per process: ProcessGroup(rank, world_size, port) joins the group whose rank 0 listens
    on host:port (the rendezvous; every rank gets the same port)."""

    def __init__(self, rank: int, world_size: int, port: int, host: str = "127.0.0.1",
                 device: str | torch.device = "cpu", timeout_s: float = 60.0):
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside a group of world_size {world_size}")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s!r}")
        if dist.is_initialized():
            raise RuntimeError("this process already belongs to a torch.distributed group")
        self.rank, self.world_size, self.timeout_s = rank, world_size, timeout_s
        self.device = torch.device(device)
        self.backend = backend_for(self.device)
        if self.device.type == "cuda":
            self.device = torch.device("cuda", rank % torch.cuda.device_count())
            torch.cuda.set_device(self.device)
        self.timeout = timedelta(seconds=timeout_s)
        dist.init_process_group(self.backend, init_method=f"tcp://{host}:{port}", rank=rank,
                                world_size=world_size, timeout=self.timeout)
        self.control = dist.new_group(backend="gloo", timeout=IDLE_WAIT)
        self.broken: RuntimeError | None = None
        peers: list[Any] = [None] * world_size
        dist.all_gather_object(peers, me(rank, os.getpid()), group=self.control)
        self.peers: list[Peer] = peers

    # ---- collectives on the data group ------------------------------------------------------
    def all_to_all_single(self, input: torch.Tensor, output_splits: list[int],
                          input_splits: list[int]) -> torch.Tensor:
        """Rows of `input` split by input_splits go to ranks 0..N-1; rows from each rank arrive
        in rank order, output_splits[r] of them from rank r. Splits may be uneven or zero."""
        if len(output_splits) != self.world_size or len(input_splits) != self.world_size:
            raise ValueError(f"need {self.world_size} split sizes, got {len(input_splits)} in and "
                             f"{len(output_splits)} out")
        if sum(input_splits) != input.shape[0]:
            raise ValueError(f"input_splits sum to {sum(input_splits)}, input has {input.shape[0]} rows")
        out = input.new_empty((sum(output_splits), *input.shape[1:]))
        self._run("all_to_all", lambda: dist.all_to_all_single(
            out, input.contiguous(), list(output_splits), list(input_splits), async_op=True))
        return out

    def exchange_counts(self, counts: list[int]) -> list[int]:
        """counts[r] this rank sends to rank r -> how many each rank sends to this one."""
        t = torch.tensor(counts, dtype=torch.int64, device=self.device)
        return self.all_to_all_single(t, [1] * self.world_size, [1] * self.world_size).tolist()

    def all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's `tensor` (all the same shape and dtype), in rank order."""
        out = [torch.empty_like(tensor) for _ in range(self.world_size)]
        self._run("all_gather", lambda: dist.all_gather(out, tensor.contiguous(), async_op=True))
        return out

    def barrier(self) -> None:
        self._run("barrier", lambda: dist.barrier(async_op=True))

    # ---- python objects on the control group ------------------------------------------------
    def broadcast_object(self, obj: Any = None, src: int = 0, timeout_s: float | None = None) -> Any:
        """rank src's `obj` on every rank. timeout_s None: wait as long as src takes (an idle
        engine); a dead src still ends the wait at once."""
        wait = IDLE_WAIT if timeout_s is None else timedelta(seconds=timeout_s)
        data = pickle.dumps(obj) if self.rank == src else b""
        size = torch.tensor([len(data)], dtype=torch.int64)
        self._run("broadcast", lambda: dist.broadcast(size, src, group=self.control, async_op=True), wait)
        buf = (torch.frombuffer(bytearray(data), dtype=torch.uint8) if self.rank == src
               else torch.empty(int(size.item()), dtype=torch.uint8))
        self._run("broadcast", lambda: dist.broadcast(buf, src, group=self.control, async_op=True), wait)
        return obj if self.rank == src else pickle.loads(buf.numpy().tobytes())

    # ---- errors -----------------------------------------------------------------------------
    def _run(self, what: str, start: Callable[[], Any], timeout: timedelta | None = None) -> None:
        if self.broken is not None:
            raise self.broken
        try:
            work = start()
            work.wait(timeout or self.timeout)
        except Exception as e:       # gloo/NCCL raise RuntimeError subclasses with transport text
            self.broken = self._failure(what, e)
            raise self.broken from e

    def _failure(self, what: str, cause: Exception) -> RuntimeError:
        dead = dead_peers(self.peers, self.rank)
        if dead:
            names = ", ".join(f"rank {p.rank} (pid {p.pid})" for p in dead)
            return RankDiedError(f"expert-parallel group: {names} died; rank {self.rank} stopped in "
                                 f"{what} (the group cannot continue: restart all ranks)", dead[0].rank)
        text = str(cause).splitlines()[0] if str(cause) else type(cause).__name__
        if "timed out" in text.lower() or "timeout" in text.lower():
            return CollectiveTimeoutError(
                f"expert-parallel group: {what} on rank {self.rank} timed out after {self.timeout_s:g} s "
                f"waiting for a peer (every same-host rank is alive; one is stuck or slow): {text}")
        if "closed by peer" in text.lower() or "connection reset" in text.lower():
            return RankDiedError(f"expert-parallel group: a peer rank closed its connection during {what} "
                                 f"on rank {self.rank} (a rank on another host died?): {text}", None)
        return RuntimeError(f"expert-parallel group: {what} failed on rank {self.rank}: {text}")

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
