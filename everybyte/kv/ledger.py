"""The byte ledger: where every device byte is, what each tier holds, and what moved.

G1 bytes split into weights, KV of running requests, KV of parked sessions, reusable cached KV,
free, and waste (unfilled slots of partial blocks plus pool padding); they add up to `total`.
Tiers registered with `add_tier` report their own used/capacity and counters (hits, misses,
corrupt, evictions, bytes read/written). The engine records prefill tokens computed vs reused per
tier, bytes moved per tier and direction, and block events (evicted, parked, prestaged, corrupt).
`to_dict()` is what `llm.stats()["memory"]` returns.
"""
from __future__ import annotations

import threading
import time
from collections import defaultdict, deque
from typing import TYPE_CHECKING, Iterable, Protocol, TypedDict

if TYPE_CHECKING:
    from everybyte.kv.prefix_core import G1Cache

G1_CATEGORIES = ("weights", "running_kv", "parked_kv", "cached_kv", "free", "waste")
EVENTS = ("evicted", "parked", "prestaged", "loaded", "stored", "corrupt", "dropped")
DIRECTIONS = ("read", "write")      # relative to the tier: read = bytes out of it, write = into it


class HoldsBlocks(Protocol):
    block_table: list[int]

    def __len__(self) -> int: ...


class TierLike(Protocol):
    """What the ledger reads of a tier backend (kv/tiers): describe() gives kind and level (str),
    capacity, used bytes, blocks and the counters (int)."""
    level: str
    kind: str

    def describe(self) -> dict[str, int | str]: ...


class PrefillTokens(TypedDict):
    computed: int
    reused: dict[str, int]
    reused_total: int
    reuse_fraction: float


class LedgerReport(TypedDict):
    g1: dict[str, int]
    tiers: dict[str, dict[str, int | str]]
    prefill_tokens: PrefillTokens
    bytes_moved: dict[str, dict[str, int]]
    blocks: dict[str, int]
    blocks_by_tier: dict[str, dict[str, int]]


def _counter(d: dict[str, int | str], key: str) -> int:
    n = d.get(key, 0)
    assert isinstance(n, int), f"tier counter {key!r} is {n!r}"
    return n


def waste_bytes(seqs: Iterable[HoldsBlocks], block_size: int, bytes_per_token: int) -> int:
    """Unfilled slots in the blocks held by `seqs` (anything with len() and a block_table)."""
    return sum(max(len(s.block_table) * block_size - len(s), 0) for s in seqs) * bytes_per_token


class ByteLedger:
    def __init__(self, block_bytes: int = 0, weights_bytes: int = 0, history: int = 4096) -> None:
        self.block_bytes = block_bytes
        self.weights_bytes = weights_bytes
        self._lock = threading.Lock()
        self.g1 = dict.fromkeys(G1_CATEGORIES, 0)
        self.g1["weights"] = weights_bytes
        self.tiers: dict[str, TierLike] = {}
        self.prefill_computed = 0
        self.prefill_reused: dict[str, int] = defaultdict(int)
        self.moved: dict[str, dict[str, int]] = defaultdict(lambda: dict.fromkeys(DIRECTIONS, 0))
        self.events: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
        self.history: deque[dict[str, float]] = deque(maxlen=history)

    # ---- G1 --------------------------------------------------------------------------------
    def update_g1(self, *, running_blocks: int, parked_blocks: int, cached_blocks: int, free_blocks: int,
                  waste_bytes: int = 0, padding_bytes: int = 0, weights_bytes: int | None = None) -> dict[str, int]:
        """Set the G1 split from block counts; waste (unfilled slots) is carved out of running KV."""
        bb = self.block_bytes
        if weights_bytes is not None:
            self.weights_bytes = weights_bytes
        running = running_blocks * bb
        if waste_bytes > running:
            raise ValueError(f"waste {waste_bytes} B exceeds running KV {running} B")
        with self._lock:
            self.g1 = {"weights": self.weights_bytes, "running_kv": running - waste_bytes,
                       "parked_kv": parked_blocks * bb, "cached_kv": cached_blocks * bb,
                       "free": free_blocks * bb, "waste": waste_bytes + padding_bytes}
            return dict(self.g1)

    def update_g1_from_cache(self, prefix_cache: G1Cache, waste_bytes: int = 0,
                             padding_bytes: int = 0) -> dict[str, int]:
        """Same, from a prefix cache's counts() (running / parked / cached / empty blocks)."""
        c = prefix_cache.counts()
        return self.update_g1(running_blocks=c["running"], parked_blocks=c["parked"], cached_blocks=c["cached"],
                              free_blocks=c["empty"], waste_bytes=waste_bytes, padding_bytes=padding_bytes)

    def sample(self, t: float | None = None) -> dict[str, float]:
        """Append the current G1 split to the history (for G1-bytes-over-time plots)."""
        with self._lock:
            row = {"t": time.time() if t is None else t, **self.g1}
            self.history.append(row)
        return row

    # ---- tiers and counters ----------------------------------------------------------------
    def add_tier(self, tier: TierLike) -> None:
        """Register a tier backend; its level (G2, G3, ...) or kind keys it in reports."""
        self.tiers[tier.level or tier.kind] = tier

    def record_prefill(self, computed: int, reused: dict[str, int] | None = None) -> None:
        """Prefill tokens computed on the device, and tokens reused from each tier ("G1", "G2", ...)."""
        if not computed and not reused:         # a turn with no hit: nothing to add, no lock to take
            return
        with self._lock:
            self.prefill_computed += computed
            for tier, n in (reused or {}).items():
                self.prefill_reused[tier] += n

    def record_move(self, tier: str, direction: str, nbytes: int) -> None:
        if direction not in DIRECTIONS:
            raise ValueError(f"direction must be one of {DIRECTIONS}, got {direction!r}")
        with self._lock:
            self.moved[tier][direction] += nbytes

    def count(self, event: str, n: int = 1, tier: str = "G1") -> None:
        if event not in EVENTS:
            raise ValueError(f"unknown ledger event {event!r}; one of {EVENTS}")
        with self._lock:
            self.events[event][tier] += n

    def set_count(self, event: str, n: int, tier: str = "G1") -> None:
        """An event counted by its owner (the prefix cache counts G1 evictions), read at report time."""
        if event not in EVENTS:
            raise ValueError(f"unknown ledger event {event!r}; one of {EVENTS}")
        with self._lock:
            self.events[event][tier] = n

    # ---- report ----------------------------------------------------------------------------
    def to_dict(self) -> LedgerReport:
        with self._lock:
            g1 = dict(self.g1)
            reused = dict(self.prefill_reused)
            moved = {t: dict(d) for t, d in self.moved.items()}
            events = {e: dict(d) for e, d in self.events.items()}
        tiers: dict[str, dict[str, int | str]] = {}
        for key, tier in self.tiers.items():
            d = tier.describe()
            tiers[key] = d
            moved.setdefault(key, dict.fromkeys(DIRECTIONS, 0))
            moved[key]["read"] += _counter(d, "bytes_read")
            moved[key]["write"] += _counter(d, "bytes_written")
            for event, stat in (("corrupt", "corrupt"), ("evicted", "evictions")):
                if n := _counter(d, stat):
                    events.setdefault(event, {})[key] = events.get(event, {}).get(key, 0) + n
        g1["total"] = sum(g1[c] for c in G1_CATEGORIES)
        reused_total = sum(reused.values())
        return {
            "g1": g1,
            "tiers": tiers,
            "prefill_tokens": {"computed": self.prefill_computed, "reused": reused,
                               "reused_total": reused_total,
                               "reuse_fraction": reused_total / max(reused_total + self.prefill_computed, 1)},
            "bytes_moved": moved,
            "blocks": {e: sum(events.get(e, {}).values()) for e in EVENTS},
            "blocks_by_tier": events,
        }
