"""Tier links under contention: each direction of a link is a FIFO lane. A transfer holds its lane
for bytes / bandwidth after the transfers queued before it; its latency is added to its end but
does not hold the lane (requests pipeline). A worker has its own lanes per tier level (the host
link, its drives, its NIC towards the pod tiers), reads and writes apart (the links are full
duplex); a pod-wide lane (a shared store's aggregate bandwidth, `--pod-flash-bandwidth`,
`--shared-storage-bandwidth`) is one object every worker's transfers queue on, after their own.
Workers keep their own virtual clocks, so a pod-wide lane serves transfers in the order the
simulator reaches them, which may be a little out of virtual-time order: a transfer can queue
behind one that starts slightly later (pessimistic by at most a step)."""
from __future__ import annotations

from typing import Any, Callable

Seconds = Callable[[str, int], float]          # (level, bytes) -> latency + bytes / bandwidth


class Lane:
    def __init__(self, seconds: Callable[[int], float]):
        self.seconds = seconds
        self.latency_s = seconds(0)
        self.free_at = 0.0
        self.transfers = self.nbytes = 0
        self.busy_s = self.queued_s = 0.0

    def reserve(self, now: float, nbytes: int, not_before: float = 0.0) -> float:
        """Queue a transfer that may start at max(now, not_before); returns when its bytes have arrived."""
        ready = max(now, not_before)
        start = max(ready, self.free_at)
        hold = self.seconds(nbytes) - self.latency_s
        self.free_at = start + hold
        self.transfers += 1
        self.nbytes += nbytes
        self.busy_s += hold
        self.queued_s += start - ready
        return self.free_at + self.latency_s

    def stats(self) -> dict[str, Any]:
        return {"transfers": self.transfers, "bytes": self.nbytes, "busy_s": self.busy_s, "queued_s": self.queued_s}


def aggregate_lane(bytes_per_s: float) -> Lane:
    """A pod-wide lane of a shared store's aggregate bandwidth (no latency of its own: the worker's link has it)."""
    if bytes_per_s <= 0:
        raise ValueError(f"an aggregate bandwidth must be positive, got {bytes_per_s}")
    return Lane(lambda nbytes: nbytes / bytes_per_s)


class Lanes:
    """A worker's lanes by (level, direction), made on first use, and the pod-wide ones it shares.
    write_seconds None: writes are not charged (they ran beside compute for free before lanes)."""

    def __init__(self, read_seconds: Seconds, write_seconds: Seconds | None = None,
                 pod: dict[tuple[str, str], Lane] | None = None):
        self.read_seconds, self.write_seconds = read_seconds, write_seconds
        self.pod = pod or {}
        self.own: dict[tuple[str, str], Lane] = {}

    def _own(self, level: str, direction: str, seconds: Seconds) -> Lane:
        lane = self.own.get((level, direction))
        if lane is None:
            lane = self.own[(level, direction)] = Lane(lambda nbytes: seconds(level, nbytes))
        return lane

    def read(self, level: str, now: float, nbytes: int, not_before: float = 0.0) -> float:
        end = self._own(level, "read", self.read_seconds).reserve(now, nbytes, not_before)
        shared = self.pod.get((level, "read"))
        return end if shared is None else max(end, shared.reserve(now, nbytes, not_before))

    def write(self, level: str, now: float, nbytes: int) -> float | None:
        """When a write of nbytes to `level` has landed, or None when writes are not charged."""
        if self.write_seconds is None:
            return None
        end = self._own(level, "write", self.write_seconds).reserve(now, nbytes)
        shared = self.pod.get((level, "write"))
        return end if shared is None else max(end, shared.reserve(now, nbytes))

    def stats(self) -> dict[str, dict[str, Any]]:
        return {f"{level} {direction}": lane.stats() for (level, direction), lane in sorted(self.own.items())}


def merge_stats(per_worker: list[dict[str, dict[str, Any]]], pod: dict[tuple[str, str], Lane]) -> dict[str, Any]:
    """Every worker's lanes summed by level and direction, and the pod-wide lanes as they are."""
    out: dict[str, Any] = {}
    for stats in per_worker:
        for key, s in stats.items():
            into = out.setdefault(key, dict.fromkeys(s, 0))
            for k, v in s.items():
                into[k] += v
    for (level, direction), lane in sorted(pod.items()):
        out[f"{level} {direction} (pod-wide)"] = lane.stats()
    return out
