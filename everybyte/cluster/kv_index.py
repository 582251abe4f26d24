"""The router's KV index: which workers hold which block, in which tier.

Per tier, a dict maps a block name to a bitset (a Python int) of the worker slots that hold it, so
one prefix walk answers for every worker at once: `overlap` follows the request's chained block
names until no worker has the next one, and for each worker records how deep the prefix reaches in
G1, in G1+G2, in G1+G2+G3 and with the pod-shared tier (G3.5) added. A G3.5 block stored by one
worker is reachable by every worker of the same namespace digest (the pod-shared store is keyed
by content). Pure Python, no torch; not thread-safe (cluster/routing holds a lock around it).
"""
from __future__ import annotations

from dataclasses import dataclass
from itertools import repeat
from typing import Iterable, Sequence

from everybyte.kv.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent

TIERS = ("G1", "G2", "G3", "G3.5")
_TIER_INDEX = {t: i for i, t in enumerate(TIERS)}
_SHARED = _TIER_INDEX["G3.5"]


@dataclass(frozen=True)
class Overlap:
    """Prefix depths in blocks, cumulative by tier: g1 <= g12 <= g123 <= total (G3.5 included)."""
    g1: int = 0
    g12: int = 0
    g123: int = 0
    total: int = 0

    def by_tier(self) -> dict[str, int]:
        """Blocks of the prefix each tier serves best: G1 first, then G2, G3, the pod-shared tier."""
        return {"G1": self.g1, "G2": self.g12 - self.g1, "G3": self.g123 - self.g12, "G3.5": self.total - self.g123}


class KVIndex:
    def __init__(self) -> None:
        self._holders: list[dict[bytes, int]] = [{} for _ in TIERS]
        self._slots: dict[str, int] = {}
        self._free_slots: list[int] = []
        self._held: dict[str, list[set[bytes]]] = {}          # worker -> per tier, the names it holds
        self._group_of: dict[str, str] = {}                   # worker -> namespace digest
        self._group_masks: dict[str, int] = {}                # digest -> bitset of its workers
        self._at: dict[int, str] = {}                         # slot -> worker
        self._masks: dict[tuple[str, ...], int] = {}          # a group of workers -> its bitset
        self.events_applied = 0

    # ---- workers ---------------------------------------------------------------------------
    def add_worker(self, worker: str, namespace_digest: str = "") -> int:
        if worker not in self._slots:
            slot = self._free_slots.pop() if self._free_slots else len(self._slots)
            self._slots[worker] = slot
            self._at[slot] = worker
            self._held[worker] = [set() for _ in TIERS]
            self._masks.clear()
        old = self._group_of.get(worker)
        if old != namespace_digest:
            if old is not None:
                self._group_masks[old] &= ~self.bit(worker)
            self._group_of[worker] = namespace_digest
            self._group_masks[namespace_digest] = self._group_masks.get(namespace_digest, 0) | self.bit(worker)
        return self._slots[worker]

    def bit(self, worker: str) -> int:
        return 1 << self._slots[worker]

    @property
    def workers(self) -> list[str]:
        return list(self._slots)

    def drop_worker(self, worker: str) -> None:
        """Forget everything `worker` holds and free its slot (it stopped answering, or resyncs)."""
        if worker not in self._slots:
            return
        for tier in range(len(TIERS)):
            self._clear(worker, tier)
        group = self._group_of.pop(worker)
        self._group_masks[group] &= ~self.bit(worker)
        if not self._group_masks[group]:
            del self._group_masks[group]
        slot = self._slots.pop(worker)
        del self._at[slot], self._held[worker]
        self._free_slots.append(slot)
        self._masks.clear()

    def held(self, worker: str, tier: str) -> int:
        """Blocks the worker holds in one tier (0 for an unknown worker)."""
        sets = self._held.get(worker)
        return len(sets[TIERS.index(tier)]) if sets is not None else 0

    def counts(self, worker: str) -> dict[str, int]:
        return {t: len(s) for t, s in zip(TIERS, self._held[worker])} if worker in self._held else {}

    # ---- events ----------------------------------------------------------------------------
    def apply(self, worker: str, events: Iterable[KVEvent]) -> None:
        """One batch of a worker's events, in order (unknown tiers, e.g. G4, are ignored)."""
        if worker not in self._slots:
            self.add_worker(worker)
        bit, held, holders, tiers = self.bit(worker), self._held[worker], self._holders, _TIER_INDEX
        n = 0
        for e in events:                     # one name per event is common (a block committed): kept lean
            n += 1
            tier = tiers.get(e.medium or "G1")
            if tier is None:
                continue
            if isinstance(e, BlockStored):
                d = holders[tier]
                for h in e.block_hashes:
                    d[h] = d.get(h, 0) | bit
                held[tier].update(e.block_hashes)
            elif isinstance(e, BlockRemoved):
                self._remove(worker, tier, e.block_hashes)
            elif isinstance(e, AllBlocksCleared):
                self._clear(worker, tier)
        self.events_applied += n

    def _remove(self, worker: str, tier: int, names: Iterable[bytes]) -> None:
        d, mine, keep = self._holders[tier], self._held[worker][tier], ~self.bit(worker)
        for h in names:
            m = d.get(h)
            if m is None:
                continue
            m &= keep
            if m:
                d[h] = m
            else:
                del d[h]
            mine.discard(h)

    def _clear(self, worker: str, tier: int) -> None:
        mine = self._held[worker][tier]
        self._remove(worker, tier, list(mine))
        mine.clear()

    # ---- queries ---------------------------------------------------------------------------
    def overlap(self, block_hashes: Sequence[bytes], workers: Sequence[str] | None = None) -> dict[str, Overlap]:
        """Per worker, how deep the request's chained blocks reach in each cumulative tier set."""
        names = self._known(workers)
        reached = self._walk(block_hashes, names)
        return {w: reached.get(w) or Overlap() for w in names}

    def reached(self, block_hashes: Sequence[bytes], workers: Sequence[str] | None = None) -> dict[str, Overlap]:
        """overlap() of only the workers that hold at least the first block in some tier (the
        others reach nothing): what a router needs from one walk, without one entry per worker."""
        return self._walk(block_hashes, self._known(workers))

    def _walk(self, block_hashes: Sequence[bytes], names: list[str]) -> dict[str, Overlap]:
        if not names or not block_hashes:
            return {}
        everyone = self._mask(names)
        g1, g2, g3, g35 = self._holders
        alive = [everyone] * 4                   # still matching: G1, +G2, +G3, +G3.5
        g1_only, widest = everyone, everyone     # alive[0], alive[3]: alive[0] <= alive[1] <= ... <= alive[3]
        ended: list[list[tuple[int, int]]] = [[], [], [], []]   # per tier: (workers whose walk ended, depth)
        for i, m1 in enumerate(map(g1.get, block_hashes, repeat(0))):
            if not widest & ~m1:                 # all still matching have it in G1 (the tiers nest): no change
                continue
            h = block_hashes[i]
            m12 = m1 | g2.get(h, 0)
            if not widest & ~m12 and not g1_only & ~m1:   # G1's walks go on, and every wider one (a prefix in G2)
                continue
            m123 = m12 | g3.get(h, 0)
            shared = g35.get(h, 0)
            masks = (m1, m12, m123, m123 | self._expand_shared(shared) if shared else m123)
            for k in range(4):
                gone = alive[k] & ~masks[k]
                if gone:
                    ended[k].append((gone, i))
                    alive[k] &= masks[k]
            g1_only, widest = alive[0], alive[3]
            if not widest:                       # the tiers nest, so every worker's walk has ended
                break
        # a worker's walk ends at most once per tier; those whose walk in the widest tier set
        # ended at block 0 reach nothing in any tier. The rest fall into a few groups of equal
        # depths (a prompt prefix most workers hold): one Overlap per group.
        some = everyone & ~(ended[3][0][0] if ended[3] and ended[3][0][1] == 0 else 0)
        n = len(block_hashes)
        groups = [(some, [n, n, n, n])]
        for k in range(4):
            for mask, depth in ended[k]:
                split = []
                for g, depths in groups:
                    part = g & mask
                    if part == g:
                        depths[k] = depth
                    elif part:
                        split.append((part, depths[:k] + [depth] + depths[k + 1:]))
                        g &= ~mask
                    split.append((g, depths))
                groups = split
        out, at = {}, self._at
        for g, depths in groups:
            o = Overlap(*depths)
            while g:
                low = g & -g
                g ^= low
                out[at[low.bit_length() - 1]] = o
        return out

    def _known(self, workers: Sequence[str] | None) -> list[str]:
        return self.workers if workers is None else [w for w in workers if w in self._slots]

    def _mask(self, names: list[str]) -> int:
        """The bitset of these workers' slots (cached: a router asks for the same group each time)."""
        key = tuple(names)
        mask = self._masks.get(key)
        if mask is None:
            if len(self._masks) >= 64:
                self._masks.clear()
            mask = 0
            for w in names:
                mask |= self.bit(w)
            self._masks[key] = mask
        return mask

    def _expand_shared(self, holders: int) -> int:
        """Every worker whose namespace matches a worker that put the block in the pod-shared tier."""
        out = 0
        for mask in self._group_masks.values():
            if holders & mask:
                out |= mask
        return out
