"""KV cache events: what a worker's G1 prefix cache stored and removed, for a KV-aware router.

The schema is vLLM's (`BlockStored`, `BlockRemoved`, `AllBlocksCleared`), with block names (the
16-byte chained hashes of kv/block_id) as the block hashes. `medium` is the tier the event is
about: G1 (the device pool's prefix cache), G2 host, G3 disk, G3.5 pod-shared, G4; a block
written down from G1 to G2 is a BlockRemoved(G1) and a BlockStored(G2). A G1 BlockStored carries
the block's token ids and its parent's name (None for a first block); lower tiers' may not.
A worker states its KV namespace digest next to its events (`namespace` on each batch): two
workers whose digests are equal compute the same bytes for the same tokens, so a block one of
them names the other may reuse. Pure data, no torch; the log is thread-safe (tier writes finish
on I/O threads).
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Callable, Union


@dataclass(frozen=True)
class BlockStored:
    block_hashes: list[bytes]
    block_size: int
    parent_block_hash: bytes | None = None
    medium: str = "G1"
    token_ids: list[int] = field(default_factory=list)
    lora_id: int | None = None


@dataclass(frozen=True)
class BlockRemoved:
    block_hashes: list[bytes]
    medium: str = "G1"


@dataclass(frozen=True)
class AllBlocksCleared:
    medium: str = "G1"


KVEvent = Union[BlockStored, BlockRemoved, AllBlocksCleared]


@dataclass
class KVEventBatch:
    namespace: bytes                 # the worker's KVNamespace digest
    events: list[KVEvent] = field(default_factory=list)


class EventLog:
    """Collects a cache's events; `drain()` hands over the batch so far (a router polls it, or a
    listener gets each event as it happens)."""

    def __init__(self, namespace: bytes, listener: Callable[[KVEvent], None] | None = None):
        self.namespace, self.listener = namespace, listener
        self.pending: list[KVEvent] = []             # not drained yet (read it to see whether any wait)
        self._lock = threading.Lock()

    def __call__(self, event: KVEvent) -> None:
        with self._lock:
            self.pending.append(event)
        if self.listener is not None:
            self.listener(event)

    def drain(self) -> KVEventBatch:
        with self._lock:
            batch, self.pending = KVEventBatch(self.namespace, self.pending), []
        return batch


def coalesce(events: list[KVEvent]) -> list[KVEvent]:
    """Merge runs as vLLM sends them: a BlockStored whose parent is the last block of the one
    before it (same medium, same block size) extends it (hashes and token ids appended), and
    consecutive BlockRemoved of one medium become one. Order and meaning are kept; the events
    given are not changed (a merged event is a new one, extended in place: linear in the blocks)."""
    out: list[KVEvent] = []
    made: KVEvent | None = None                  # out[-1] when made here: its lists are ours to extend
    for e in events:
        prev = out[-1] if out else None
        if isinstance(e, BlockStored) and isinstance(prev, BlockStored) and prev.medium == e.medium \
                and prev.block_size == e.block_size and prev.lora_id == e.lora_id \
                and e.parent_block_hash == prev.block_hashes[-1] \
                and bool(prev.token_ids) == bool(e.token_ids):
            if prev is not made:
                prev = out[-1] = made = BlockStored(list(prev.block_hashes), prev.block_size, prev.parent_block_hash,
                                                    prev.medium, list(prev.token_ids), prev.lora_id)
            prev.block_hashes.extend(e.block_hashes)
            prev.token_ids.extend(e.token_ids)
        elif isinstance(e, BlockRemoved) and isinstance(prev, BlockRemoved) and prev.medium == e.medium:
            if prev is not made:
                prev = out[-1] = made = BlockRemoved(list(prev.block_hashes), prev.medium)
            prev.block_hashes.extend(e.block_hashes)
        else:
            out.append(e)
    return out
