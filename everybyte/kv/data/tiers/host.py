"""G2: host memory, within a byte capacity. A batch put as one [N, block bytes] tensor (pinned
when CUDA is present, so loads into the device pool are async DMA) is kept as that one contiguous
buffer, each block a row of it, so a later load of those blocks is one strided copy per pool field.
LRU over such buffers (see UnitIndex). `get` hands back a view of the stored bytes: read it, do
not write it; the bytes stay valid as long as the caller holds the view, even after eviction."""
from __future__ import annotations

import torch

from everybyte.kv.data.tiers.buffers import as_uint8_tensor
from everybyte.kv.data.tiers.units import Unit, UnitIndex
from everybyte.kv.tiers.base import TierBackend


class HostTier(TierBackend):
    kind = "host"

    def __init__(self, capacity_bytes: int, level: str = "G2", pin_memory: bool | None = None,
                 on_evict=None):
        super().__init__(capacity_bytes, level, on_evict)
        self.pin_memory = torch.cuda.is_available() if pin_memory is None else pin_memory
        self._index = UnitIndex()

    def _ownable(self, data) -> bool:
        return isinstance(data, torch.Tensor) and data.dtype == torch.uint8 and not data.is_cuda \
            and data.is_contiguous() and (data.is_pinned() or not self.pin_memory)

    def _own(self, data) -> torch.Tensor:
        if self._ownable(data):
            return data.reshape(-1)
        src = data if isinstance(data, torch.Tensor) else as_uint8_tensor(memoryview(data).cast("B"))
        out = torch.empty(src.numel() * src.element_size(), dtype=torch.uint8, pin_memory=self.pin_memory)
        out.copy_(src.reshape(-1).view(torch.uint8))
        return out

    def put(self, name, data) -> bool:
        return self.put_many([name], [data])[0]

    def put_many(self, names, datas) -> list[bool]:
        """A 2-D uint8 tensor (one block per row) is kept as one buffer; a list, one buffer a block."""
        if isinstance(datas, torch.Tensor) and datas.dim() == 2:
            buf = datas if self._ownable(datas) else self._own(datas).view(datas.shape)
            units = [Unit({n: buf[i] for i, n in enumerate(names)}, buf.numel())]
        else:
            units = [Unit({n: t}, t.numel()) for n, t in zip(names, map(self._own, datas))]
        ok = []
        for unit in units:
            new = {n: t for n, t in unit.blocks.items() if self._index.find(n) is None}
            ok += [True] * (len(unit.blocks) - len(new))
            if unit.nbytes > self.capacity_bytes:
                self.stats.add("rejected", len(new))
                ok += [False] * len(new)
                continue
            if not new:
                continue
            unit.blocks = new
            evicted = []
            with self._index.lock:
                while self._index.used + unit.nbytes > self.capacity_bytes and (old := self._index.pop_lru()):
                    evicted.append(old)
                self._index.add(unit)
            self.stats.add("puts", len(new))
            self.stats.add("bytes_written", sum(t.numel() for t in new.values()))
            ok += [True] * len(new)
            for old in evicted:
                self._evicted(list(old.blocks), list(old.blocks.values()))
        return ok

    def get(self, name):
        return self.get_many([name])[0]

    def get_many(self, names) -> list:
        out = []
        for name in names:
            found = self._index.find(name)
            out.append(None if found is None else found[1])
        hits = [t for t in out if t is not None]
        self.stats.add("hits", len(hits))
        self.stats.add("misses", len(out) - len(hits))
        self.stats.add("bytes_read", sum(t.numel() for t in hits))
        return out

    def contains(self, name) -> bool:
        return name in self._index

    def delete(self, name) -> bool:
        with self._index.lock:
            if name not in self._index:
                return False
            self._index.remove(name)
        self.stats.add("deletes")
        return True

    def lru_names(self) -> list[bytes]:
        return self._index.names()

    @property
    def used_bytes(self) -> int:
        return self._index.used

    def __len__(self):
        return len(self._index)
