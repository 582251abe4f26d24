"""G2: host memory. Encoded blocks kept as uint8 tensors (pinned when CUDA is present, so loads
into the device pool are async DMA), LRU within a byte capacity. `get` hands back the stored
tensor itself: read it, do not write it."""
from __future__ import annotations

import threading
from collections import OrderedDict

import torch

from everybyte.kv.tiers.base import TierBackend, as_uint8_tensor, nbytes_of


class HostTier(TierBackend):
    kind = "host"

    def __init__(self, capacity_bytes: int, level: str = "G2", pin_memory: bool | None = None,
                 on_evict=None):
        super().__init__(capacity_bytes, level, on_evict)
        self.pin_memory = torch.cuda.is_available() if pin_memory is None else pin_memory
        self._blocks: OrderedDict[bytes, torch.Tensor] = OrderedDict()
        self._used = 0
        self._lock = threading.Lock()

    def _own(self, data) -> torch.Tensor:
        if isinstance(data, torch.Tensor) and data.dtype == torch.uint8 and not data.is_cuda \
                and (data.is_pinned() or not self.pin_memory):
            return data.reshape(-1)
        src = data if isinstance(data, torch.Tensor) else as_uint8_tensor(memoryview(data).cast("B"))
        out = torch.empty(src.numel() * src.element_size(), dtype=torch.uint8, pin_memory=self.pin_memory)
        out.copy_(src.reshape(-1).view(torch.uint8))
        return out

    def put(self, name, data) -> bool:
        n = nbytes_of(data)
        if n > self.capacity_bytes:
            self.stats.add("rejected")
            return False
        with self._lock:
            if name in self._blocks:
                self._blocks.move_to_end(name)
                return True
        t = self._own(data)
        evicted = []
        with self._lock:
            if name in self._blocks:
                return True
            while self._used + n > self.capacity_bytes and self._blocks:
                old, od = self._blocks.popitem(last=False)
                self._used -= od.numel()
                evicted.append((old, od))
            self._blocks[name] = t
            self._used += n
        self.stats.add("puts")
        self.stats.add("bytes_written", n)
        for old, od in evicted:
            self._evicted(old, od)
        return True

    def get(self, name):
        with self._lock:
            t = self._blocks.get(name)
            if t is not None:
                self._blocks.move_to_end(name)
        if t is None:
            self.stats.add("misses")
            return None
        self.stats.add("hits")
        self.stats.add("bytes_read", t.numel())
        return t

    def contains(self, name) -> bool:
        return name in self._blocks

    def delete(self, name) -> bool:
        with self._lock:
            t = self._blocks.pop(name, None)
            if t is None:
                return False
            self._used -= t.numel()
        self.stats.add("deletes")
        return True

    def lru_names(self) -> list[bytes]:
        with self._lock:
            return list(self._blocks)

    @property
    def used_bytes(self) -> int:
        return self._used

    def __len__(self):
        return len(self._blocks)
