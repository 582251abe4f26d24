"""Each running sequence's last, still-filling KV span also kept unquantized (lossy KV formats).

Why: with 4-bit KV most of the perplexity cost comes from a token's nearest neighbours, which
get the most attention. Positions are grouped into aligned spans of SPAN_BLOCKS pool blocks.
Every query attends to the keys of its own span up to itself in full precision and to every
earlier span as stored in the pool; the pool still holds every token quantized, so tiers,
prefix blocks and bytes are unchanged. The rule is the same in prefill and decode: a token sees
the same keys however its context was batched or chunked. Measured on SmolLM2-135M (2,048
tokens, nvfp4, ppl cost over fp32 KV): argparse.py +3.9% without, +1.9% with 16-token spans,
+1.6% with 32; GPL-3 +3.0% with 16, +1.6% with 32.

The slots live here, one per running sequence, in the compute dtype, in the pool's stored
(rotated) space: [slots, span tokens, kv heads, head_dim] per layer for K and V. A sequence
(re)starts at a span boundary (the memory manager rounds prefix hits and tier loads down to
whole spans), so a slot only has to survive between the sequence's own steps; if it was lost,
the span's earlier tokens are copied from the pool (the quantized values) so the step still runs.

What the rest of the engine sees is one small interface, which NoExactTail (lossless KV, or the
lever off) also implements: `restart_blocks` (the memory manager restarts reuse there), `layer(i)`
(the tail stores of layer i for its LayerKVCache), `begin_step(seqs)` (each sequence's slot for
the AttentionMetadata, and whether the stores grew so the caches must be rebuilt) and
`end_step(seqs, num_new_tokens)`. `exact_tail_for` picks one from the pool's format.
"""
from __future__ import annotations

from collections import OrderedDict

import torch

SPAN_BLOCKS = 2


class NoExactTail:
    """Every query reads its whole context from the pool."""
    restart_blocks = 1

    def layer(self, i: int) -> tuple[None, None]:
        return None, None

    def begin_step(self, seqs) -> tuple[None, bool]:
        return None, False

    def end_step(self, seqs, num_new_tokens) -> None:
        pass


def exact_tail_for(pool, dtype: torch.dtype, device, enabled: bool = True) -> ExactTail | NoExactTail:
    """The lever for this pool: exact tails when its format is lossy and the lever is on."""
    return ExactTail(pool, dtype, device) if enabled and pool.fmt.lossy else NoExactTail()


class ExactTail:
    def __init__(self, pool, dtype: torch.dtype, device, capacity: int = 8, span_blocks: int = SPAN_BLOCKS):
        self.pool, self.dtype, self.device = pool, dtype, torch.device(device)
        self.block_size = pool.block_size
        self.span = span_blocks * pool.block_size                    # tokens a slot holds
        self.slot_of: OrderedDict[int, list[int]] = OrderedDict()    # seq_id -> [slot, span index]
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []
        self._free: list[int] = []
        self._grow(capacity)

    @property
    def capacity(self) -> int:
        return self.k[0].shape[0]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)

    @property
    def restart_blocks(self) -> int:
        return self.span // self.block_size

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k[i], self.v[i]

    def begin_step(self, seqs) -> tuple[list[int], bool]:
        """(the batch's slots in order, whether the stores grew: their tensors are new)."""
        capacity = self.capacity
        slots = self.assign(seqs, {seq.seq_id for seq in seqs})
        return slots, self.capacity != capacity

    def end_step(self, seqs, num_new_tokens) -> None:
        self.advance(seqs, num_new_tokens)

    def _grow(self, capacity: int) -> None:
        old = len(self.k) and self.capacity
        fresh = []
        for (heads, dim), i in zip(self.pool.layer_shapes, range(self.pool.num_layers)):
            for store in (self.k, self.v):
                t = torch.zeros(capacity, self.span, heads, dim, dtype=self.dtype, device=self.device)
                if old:
                    t[:old] = store[i]
                fresh.append(t)
        self.k, self.v = fresh[0::2], fresh[1::2]
        self._free = list(range(old, capacity)) + self._free

    def assign(self, seqs, batch_ids: set[int]) -> list[int]:
        """A slot per sequence for this step (a new sequence takes a free slot, else the least
        recently used one outside the batch, else the store grows); refills lost ones."""
        slots = []
        for seq in seqs:
            start = seq.num_computed_tokens
            entry = self.slot_of.pop(seq.seq_id, None)
            if entry is None:
                entry = [self._take(batch_ids), -1]
            self.slot_of[seq.seq_id] = entry
            span = start // self.span
            if start % self.span and entry[1] != span:
                self._refill(entry[0], seq.block_table, span * self.span, start % self.span)
            slots.append(entry[0])
        return slots

    def advance(self, seqs, num_new_tokens) -> None:
        for seq, n in zip(seqs, num_new_tokens):
            self.slot_of[seq.seq_id][1] = (seq.num_computed_tokens + n - 1) // self.span

    def _take(self, batch_ids: set[int]) -> int:
        if self._free:
            return self._free.pop()
        for seq_id in self.slot_of:                    # oldest first
            if seq_id not in batch_ids:
                return self.slot_of.pop(seq_id)[0]
        self._grow(2 * self.capacity)
        return self._free.pop()

    def _refill(self, slot: int, table: list[int], first: int, count: int) -> None:
        """Slot positions [0, count) from the pool's tokens [first, first + count)."""
        bs, p = self.block_size, self.pool
        ids = torch.tensor(table[first // bs:(first + count - 1) // bs + 1], device=self.device)
        for i in range(p.num_layers):
            for tails, stores, scales in ((self.k, p.k, p.k_scales), (self.v, p.v, p.v_scales)):
                blocks = p.fmt.read(stores[i], ids, scales[i], self.dtype)
                tails[i][slot, :count] = blocks.reshape(-1, *tails[i].shape[2:])[:count]
