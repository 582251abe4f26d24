"""Moving named KV blocks between G1 and the tiers below it.

Local tiers (G2 host, G3 disk) form a write-back chain: a block evicted from G1 goes to the
first tier, and what that tier evicts spills to the next. Shared tiers (G3.5 Redis or a
shared directory) get every newly computed full block written through asynchronously, so
other nodes can reuse it. On admission the longest run of missing blocks is located across
tiers (first tier that has each block) and fetched, one streamed batch read per tier (get_stream). A tier whose
measured load speed is slower than recomputing the same tokens is skipped. Batches move down
the chain as batches (on_evict_many -> put_many), so a host buffer becomes one disk pack.
`on_event` (kv/events) hears every block a tier stores or drops, with the tier's level as medium.
A remote source (kv/connector.RemoteBlocks: another worker's blocks) is searched after the local
tiers and before the shared ones; what it fails to deliver is asked of the shared tiers.
"""
from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future
from typing import Any, Callable, Collection, Iterator, Sequence

from everybyte.kv.events import BlockRemoved, BlockStored, KVEvent
from everybyte.kv.tiers.base import TierBackend, io_executor

log = logging.getLogger(__name__)
SHARED_LEVELS = ("G3.5",)
REMOTE_LEVELS = ("remote",)
# an encoded block as the backends hold it (bytes-like, or a uint8 tensor on the data side): this
# module only passes it on, so it stays opaque here
Block = Any
Scratch = Callable[..., Any] | None            # TierBackend.get_stream's buffer provider
Arrivals = Iterator[tuple[TierBackend, list[tuple[int, Block | None]]]]


def held_run(tiers: list[TierBackend], names: list[bytes]) -> list[TierBackend]:
    """For the longest run of leading names each held by one of `tiers`: the first tier holding
    each (one contains_many per tier, not one contains per name and tier)."""
    if not names or not tiers:
        return []
    present = list(zip(tiers, (t.contains_many(names) for t in tiers)))
    out: list[TierBackend] = []
    for i in range(len(names)):
        for tier, held in present:
            if held[i]:
                out.append(tier)
                break
        else:
            break
    return out


class TierSet:
    def __init__(self, tiers: list[TierBackend]):
        self.tiers = list(tiers)
        local = [t for t in self.tiers if t.level not in SHARED_LEVELS + REMOTE_LEVELS]
        self.first = local[0] if local else (self.tiers[0] if self.tiers else None)
        for i, upper in enumerate(local):        # the last local tier drops what it evicts
            lower = local[i + 1] if i + 1 < len(local) else None
            upper.on_evict = lambda name, data, u=upper, lo=lower: self._spill(u, lo, [name], [data])
            upper.on_evict_many = lambda names, datas, u=upper, lo=lower: self._spill(u, lo, names, datas)
        self.on_event: Callable[[KVEvent], None] | None = None
        self.block_size = 0                           # for the events' block_size
        self.local = local
        for t in self.tiers:                          # shared tiers only drop what they evict
            if t not in local:
                t.on_evict_many = lambda names, datas, u=t: self._spill(u, None, names, datas)
        self.write_through = [t for t in self.tiers if t.level in SHARED_LEVELS]
        self.remote = [t for t in self.tiers if t.level in REMOTE_LEVELS]
        self.bandwidth: dict[str, float] = {}         # level -> measured load bytes/s (EMA)
        self.prefill_tok_s: float | None = None       # the engine's measured prefill speed
        self.bytes_per_token = 0
        self._recent_puts: OrderedDict[bytes, None] = OrderedDict()
        self._during_put = threading.local()          # removals a put causes, reported after it
        self._pending: list[Future[list[bool]]] = []

    def speeds(self) -> dict[str, Any]:
        """What a router weighs a load against a recompute with (`/v1/kv/info` "speeds"): the
        measured prefill tokens/s and each tier's measured load tokens/s (None until measured)."""
        per_token = self.bytes_per_token
        load: dict[str, float | None] = {}
        for t in self.tiers:
            bw = self.bandwidth.get(t.level)
            load[t.level] = bw / per_token if bw and per_token else None
        return {"prefill_tok_s": self.prefill_tok_s, "load_tok_s": load}

    def __len__(self) -> int:
        return len(self.tiers)

    def add_remote(self, tier: TierBackend) -> None:
        """A source of other workers' blocks: searched before the shared tiers, never written to."""
        at = next((i for i, t in enumerate(self.tiers) if t.level in SHARED_LEVELS), len(self.tiers))
        self.tiers.insert(at, tier)
        self.remote.append(tier)

    # ---- load or recompute --------------------------------------------------------------------
    def worth_loading(self, tier: TierBackend) -> bool:
        bw = self.bandwidth.get(tier.level)
        if bw is None or not self.prefill_tok_s or not self.bytes_per_token:
            return True      # measure first
        return self.bytes_per_token / bw < 1.0 / self.prefill_tok_s

    def observe(self, tier: TierBackend, nbytes: int, seconds: float) -> None:
        if seconds <= 0 or nbytes <= 0:
            return
        bw = nbytes / seconds
        old = self.bandwidth.get(tier.level)
        self.bandwidth[tier.level] = bw if old is None else 0.7 * old + 0.3 * bw

    def may_hold(self, names: list[bytes]) -> int:
        """How many leading names a load might find without asking a remote tier: the run held by
        local tiers, or all of them when a usable shared tier could have any."""
        if not self.tiers:
            return 0
        if any(self.worth_loading(t) for t in self.write_through):
            return len(names)
        return len(held_run([t for t in self.local + self.remote if self.worth_loading(t)], names))

    def locate(self, names: list[bytes]) -> list[TierBackend]:
        """For the longest run of names each held by some usable tier: the tier to load it from."""
        return held_run([t for t in self.tiers if self.worth_loading(t)], names)

    def stream(self, found: list[TierBackend], names: list[bytes], scratch: Scratch = None) -> Arrivals:
        """Get the located blocks, one get_stream per tier: yields (tier, [(index, buffer or None)])
        as they arrive (read into scratch, see TierBackend.get_stream); a tier failing mid-read
        answers None for the rest of its blocks. The time
        spent inside each tier's reads gives its measured load bandwidth."""
        for tier in dict.fromkeys(found):
            idx = [i for i, t in enumerate(found) if t is tier]
            if tier in self.remote:
                yield from self._remote_stream(tier, idx, names, scratch)
            else:
                yield from self._tier_stream(tier, idx, names, scratch)

    def _remote_stream(self, tier: TierBackend, idx: list[int], names: list[bytes], scratch: Scratch) -> Arrivals:
        """A remote source's blocks; those it did not deliver come from a shared tier holding them."""
        missed: list[int] = []
        for _, batch in self._tier_stream(tier, idx, names, scratch):
            missed += [i for i, b in batch if b is None]
            if got := [(i, b) for i, b in batch if b is not None]:
                yield tier, got
        for shared in self.write_through:
            if not missed or not self.worth_loading(shared):
                continue
            held = [i for i, ok in zip(missed, shared.contains_many([names[i] for i in missed])) if ok]
            if held:
                yield from self._tier_stream(shared, held, names, scratch)
                missed = [i for i in missed if i not in held]
        if missed:
            yield tier, [(i, None) for i in missed]

    def _tier_stream(self, tier: TierBackend, idx: list[int], names: list[bytes], scratch: Scratch) -> Arrivals:
        answered: set[int] = set()
        nbytes, busy = 0, 0.0
        reads = tier.get_stream([names[i] for i in idx], scratch)
        try:
            while True:
                t0 = time.perf_counter()
                try:
                    batch = next(reads, None)
                except Exception as e:       # a tier failing mid-read is a miss
                    log.warning("%s tier read failed: %r", tier.level, e)
                    batch = [(j, None) for j in range(len(idx)) if j not in answered]
                    reads = iter(())
                busy += time.perf_counter() - t0
                if batch is None:
                    break
                answered.update(j for j, _ in batch)
                nbytes += sum(_nbytes(b) for _, b in batch if b is not None)
                yield tier, [(idx[j], b) for j, b in batch]
        finally:                             # also when the reader stops early
            self.observe(tier, nbytes, busy)

    # ---- writes ------------------------------------------------------------------------------
    def _report(self, event: KVEvent) -> None:
        """A removal during a put waits for the put's BlockStored (_put); anything else goes now."""
        deferred = getattr(self._during_put, "events", None)
        if deferred is not None and isinstance(event, BlockRemoved):
            deferred.append(event)
        else:
            self._emit(event)

    def _emit(self, event: KVEvent) -> None:
        if self.on_event is not None and getattr(event, "block_hashes", True):
            self.on_event(event)

    def _put(self, tier: TierBackend, names: list[bytes], datas: Sequence[Block]) -> list[bool]:
        """tier.put_many, reported as a BlockStored and then the removals the put caused (a put
        may evict blocks of its own batch), so a subscriber that applies them in order ends with
        what the tier holds. A put inside a put (a synchronous spill one tier down, as the
        simulator's SyncTierSet does it) reports its own events and leaves the outer put's
        removals deferred."""
        deferred: list[BlockRemoved] = []
        outer = getattr(self._during_put, "events", None)
        self._during_put.events = deferred
        try:
            ok = tier.put_many(names, datas)
        finally:
            self._during_put.events = outer
        self._emit(BlockStored([n for n, good in zip(names, ok) if good], self.block_size, medium=tier.level))
        for event in deferred:
            self._emit(event)
        return ok

    def _put_async(self, tier: TierBackend, names: list[bytes], datas: Sequence[Block]) -> Future[list[bool]]:
        return io_executor().submit(self._put, tier, names, datas)

    def _spill(self, upper: TierBackend, lower: TierBackend | None, names: Sequence[bytes],
               datas: Sequence[Block]) -> None:
        """A tier evicted a batch: it leaves that tier, and goes one local tier down if any."""
        self._report(BlockRemoved(list(names), medium=upper.level))
        if lower is not None:
            self._put_async(lower, list(names), datas)

    def put_down(self, names: list[bytes], datas: Sequence[Block]) -> None:
        """Store blocks evicted from G1 in the first tier (synchronously: one batch)."""
        if self.first is not None:
            self._put(self.first, names, datas)

    def write_through_blocks(self, names: list[bytes], datas: Sequence[Block]) -> None:
        """Put newly computed blocks (rows of datas) to the shared tiers, asynchronously."""
        keep = [i for i, n in enumerate(names) if n not in self._recent_puts]
        for i in keep:
            self._recent_puts[names[i]] = None
        while len(self._recent_puts) > 65536:
            self._recent_puts.popitem(last=False)
        self._pending = [f for f in self._pending if not f.done()]
        if keep:
            for t in self.write_through:
                self._pending.append(self._put_async(t, [names[i] for i in keep], [datas[i] for i in keep]))

    def pending_writes(self) -> list[Future[list[bool]]]:
        """Write-through puts still in flight (futures; safe to read from another thread)."""
        return [f for f in list(self._pending) if not f.done()]

    def flush(self, timeout: float = 30.0) -> None:
        """Wait for asynchronous write-through puts (e.g. before a process exits)."""
        for f in self._pending:
            try:
                f.result(timeout)
            except Exception as e:
                log.warning("write-through failed: %r", e)
        self._pending = []

    def delete_everywhere(self, names: Collection[bytes]) -> None:
        for t in self.tiers:
            gone = [n for n in names if t.delete(n)]
            self._report(BlockRemoved(gone, medium=t.level))
        for n in names:
            self._recent_puts.pop(n, None)

    def count_present(self, names: list[bytes]) -> dict[str, int]:
        return {t.level: sum(t.contains_many(names)) for t in self.tiers}

    def describe(self) -> dict[str, dict[str, Any]]:
        return {t.level: {**t.describe(), "load_bytes_per_s": self.bandwidth.get(t.level)} for t in self.tiers}


def _nbytes(buf: Block) -> int:
    return buf.numel() * buf.element_size() if hasattr(buf, "numel") else len(buf)
