"""Which peer rank died: every rank publishes (host, pid) at init, and after a failed collective
a rank looks at its same-host peers' processes (/proc/PID/stat: gone, zombie or dead) to name the
one that is gone. A peer on another host cannot be looked at and is reported as unknown."""
from __future__ import annotations

import socket
import time
from dataclasses import dataclass


@dataclass(frozen=True)
class Peer:
    rank: int
    host: str
    pid: int


def me(rank: int, pid: int) -> Peer:
    return Peer(rank, socket.gethostname(), pid)


def process_alive(pid: int) -> bool:
    """False when the process is gone or a zombie (killed, not yet reaped by its parent)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rpartition(")")[2].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X", "x")


def dead_peers(peers: list[Peer], self_rank: int, grace_s: float = 2.0) -> list[Peer]:
    """Same-host peers whose process is gone; waits up to grace_s for one to finish dying (a peer
    that raised closes its sockets a moment before its process exits)."""
    host = socket.gethostname()
    local = [p for p in peers if p.rank != self_rank and p.host == host]
    deadline = time.monotonic() + grace_s
    while True:
        dead = [p for p in local if not process_alive(p.pid)]
        if dead or time.monotonic() >= deadline:
            return dead
        time.sleep(0.05)
