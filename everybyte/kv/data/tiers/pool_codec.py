"""Many blocks of one pool at once, between the pool and encoded buffers (codec.py's format).

A pool's blocks all have the same header but for the name, so encoding a batch is: one template
copy for every header, one copy per field segment and run of consecutive block ids (the pool's
fields are stacked, see pool.py), and a checksum per block. Loading checks each header by comparing
bytes against the template, then copies every run of blocks that lie at a fixed stride in one
buffer (a host tier's batch, a disk pack read at once) into consecutive pool blocks with one copy
per segment; what is left goes one block at a time, all in one `torch._foreach_copy_` call.
"""
from __future__ import annotations

import ctypes
import threading
import weakref

import torch

from everybyte.formats import cpu_kernels
from everybyte.kv.data.tiers.buffers import as_uint8_tensor
from everybyte.kv.data.tiers.codec import (
    CHECKSUM,
    PREFIX,
    CorruptBlock,
    FormatMismatch,
    decode_block,
    pack_header,
    plan_segments,
    seal,
)
from everybyte.kv.tiers.frame import checksum

_CODECS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
NAME = slice(PREFIX.size, PREFIX.size + 16)


def block_tensors(pool, block_id: int) -> dict[str, torch.Tensor]:
    """The tensors of one pool block (views, on the pool's device), in payload order."""
    return {f"{kv}.{layer}.{st.key}": st.tensor[row, block_id]
            for st in pool.stacks for row, (kv, layer) in enumerate(st.members)}


def block_scales(pool) -> dict[str, float]:
    return {**{f"k.{i}": float(s) for i, s in enumerate(pool.k_scales)},
            **{f"v.{i}": float(s) for i, s in enumerate(pool.v_scales)}}


def runs(a: list[int], b: list[int]) -> list[tuple[int, int, int]]:
    """(i, j, n): maximal runs where a[i:i+n] and b[j:j+n] both count up by one."""
    out, i = [], 0
    while i < len(a):
        n = 1
        while i + n < len(a) and a[i + n] == a[i] + n and b[i + n] == b[i] + n:
            n += 1
        out.append((a[i], b[i], n))
        i += n
    return out


class PoolCodec:
    def __init__(self, pool):
        self.pool = pool
        entries, where = [], {}
        for st in pool.stacks:
            for row, (kv, layer) in enumerate(st.members):
                entries.append((kv, layer, st.key, st.tensor.dtype, tuple(st.tensor.shape[2:])))
                where[(kv, layer, st.key)] = (st, row)
        self.segments, self.payload = plan_segments(entries)
        self.views = []    # (pool bytes [rows, num_blocks, chunk], first row, rows, payload offset, chunk)
        for s in self.segments:
            st, row = where[(s.kv, s.first, s.key)]
            t = st.tensor.view(torch.uint8).view(st.tensor.shape[0], st.tensor.shape[1], -1)
            if self.views:            # K then V of one field, back to back: one copy for both
                pt, r0, n, off, chunk = self.views[-1]
                if pt.data_ptr() == t.data_ptr() and r0 + n == row and off + n * chunk == s.offset and chunk == s.chunk:
                    self.views[-1] = (pt, r0, n + s.count, off, chunk)
                    continue
            self.views.append((t, row, s.count, s.offset, s.chunk))
        self._scales = None
        self._local = threading.local()     # per loading thread: a staging buffer
        self._refresh()

    def _refresh(self) -> None:
        scales = (tuple(self.pool.k_scales), tuple(self.pool.v_scales))
        if scales == self._scales:
            return
        self._scales = scales
        self.header = pack_header(self.pool.kv_cache_dtype, self.segments, self.payload,
                                  [float(s) for s in scales[0]], [float(s) for s in scales[1]], name=bytes(16))
        self.start = len(self.header)
        self.nbytes = self.start + self.payload
        self._header_t = torch.frombuffer(bytearray(self.header), dtype=torch.uint8)
        ends = sorted((s.offset, s.offset + s.count * s.chunk) for s in self.segments)
        self.gaps = [(a, b) for (_, a), (b, _) in zip(ends, ends[1:] + [(self.payload, 0)]) if b > a]

    def _staging(self, nbytes: int) -> torch.Tensor:
        """A reused buffer (fresh allocations of this size cost page faults on every load)."""
        buf = getattr(self._local, "buf", None)
        if buf is None or buf.numel() < nbytes:
            buf = self._local.buf = torch.empty(nbytes, dtype=torch.uint8)
        return buf[:nbytes]

    # ---- pool -> buffers ---------------------------------------------------------------------
    def store(self, block_ids: list[int], names: list[bytes], pin_memory: bool = False) -> torch.Tensor:
        """Encode pool blocks into one [N, nbytes] uint8 CPU tensor, row i = block_ids[i] named names[i]."""
        self._refresh()
        n, size, start = len(block_ids), self.nbytes, self.start
        out = torch.empty((n, size), dtype=torch.uint8, pin_memory=pin_memory)
        if n == 0:
            return out
        out[:, :start] = self._header_t
        out[:, NAME] = torch.frombuffer(bytearray(b"".join(names)), dtype=torch.uint8).view(n, 16)
        for a, b in self.gaps:
            out[:, start + a:start + b] = 0
        dst, src = [], []
        for row, block, k in runs(list(range(n)), list(block_ids)):
            for pool_bytes, first, rows, off, chunk in self.views:
                dst.append(out.as_strided((rows, k, chunk), (chunk, size, 1), row * size + start + off))
                src.append(pool_bytes[first:first + rows, block:block + k])
        cuda = self.views[0][0].is_cuda
        _copy_all(dst, src, non_blocking=pin_memory and cuda)
        if pin_memory and cuda:
            torch.cuda.current_stream().synchronize()
        mv = memoryview(out.view(-1).numpy())
        for i in range(n):
            seal(mv[i * size:(i + 1) * size])
        return out

    # ---- buffers -> pool ---------------------------------------------------------------------
    def check(self, buf, name: bytes | None = None, verify: bool = False) -> torch.Tensor:
        """The block as a 1-D uint8 tensor if it fits this pool (and is `name`); else raises
        CorruptBlock, or FormatMismatch naming what differs."""
        self._refresh()
        t = as_uint8_tensor(buf)
        h = self.header
        if t.numel() != self.nbytes:
            self._explain(t, verify)
        head = ctypes.string_at(t.data_ptr(), self.start)       # t is a CPU tensor of nbytes bytes
        if head[:CHECKSUM.start] != h[:CHECKSUM.start] or head[NAME.stop:] != h[NAME.stop:]:
            self._explain(t, verify)
        if name is not None and head[NAME] != name:
            raise CorruptBlock(f"block is named {head[NAME].hex()}, expected {name.hex()}")
        if verify and checksum(memoryview(t.numpy())[PREFIX.size:]) != int.from_bytes(head[CHECKSUM], "little"):
            raise CorruptBlock("block checksum mismatch")
        return t

    def _explain(self, t: torch.Tensor, verify: bool) -> None:
        block = decode_block(t, verify, expect_format=self.pool.kv_cache_dtype)
        mine = {k: (v.dtype, tuple(v.shape)) for k, v in block_tensors(self.pool, 0).items()}
        theirs = {k: (v.dtype, tuple(v.shape)) for k, v in block.tensors.items()}
        if mine != theirs:
            bad = sorted(mine.keys() ^ theirs.keys()) or [k for k in mine if mine[k] != theirs[k]]
            raise FormatMismatch(f"block's tensors do not match the pool's layers (first: {bad[0]})")
        if block.scales != block_scales(self.pool):
            raise FormatMismatch("block was written with other K/V scales")
        raise FormatMismatch("block's header does not match the pool's")

    def check_many(self, bufs: list, names: list[bytes], verify: bool = False) -> tuple[int, Exception | None]:
        """How many leading blocks fit this pool under their names, and why the next one does not:
        each block's header bytes are compared against the template (its payload checksum only
        with verify)."""
        bufs = [as_uint8_tensor(b) for b in bufs]
        return self._check_pieces(bufs, _pieces(bufs, self.nbytes), names, verify)

    def _check_pieces(self, bufs: list[torch.Tensor], pieces, names: list[bytes], verify: bool):
        self._refresh()
        h, start, i = self.header, self.start, 0
        pre, post = h[:CHECKSUM.start], h[NAME.stop:]
        for first, stride, n in pieces:
            good = 0
            if not verify:                   # header bytes against the template: ~2 us a block
                base = first.data_ptr()
                while good < n and bufs[i + good].numel() == self.nbytes:
                    head = ctypes.string_at(base + good * stride, start)
                    if head[:CHECKSUM.start] != pre or head[NAME.stop:] != post or head[NAME] != names[i + good]:
                        break
                    good += 1
            for j in range(i + good, i + n):  # the first that differs (or all, verified): say why
                try:
                    self.check(bufs[j], names[j], verify)
                except CorruptBlock as e:
                    return j, e
            i += n
        return i, None

    def load(self, bufs: list[torch.Tensor], block_ids: list[int], non_blocking: bool = False) -> None:
        """Copy checked blocks (see check) into the pool at block_ids."""
        if not bufs:
            return
        order = sorted(range(len(bufs)), key=block_ids.__getitem__)
        bufs, ids = [as_uint8_tensor(bufs[i]) for i in order], [block_ids[i] for i in order]
        self._load_pieces(bufs, ids, _pieces(bufs, self.nbytes, ids), non_blocking)

    def load_checked(self, bufs: list, names: list[bytes], block_ids: list[int],
                     non_blocking: bool = False) -> tuple[int, Exception | None]:
        """check_many, then load the good leading blocks; the buffers' layout is worked out once."""
        if not bufs:                  # e.g. every block of a batch came back corrupt (a miss each)
            return 0, None
        bufs = [as_uint8_tensor(b) for b in bufs]
        pieces = list(_pieces(bufs, self.nbytes, block_ids))
        good, err = self._check_pieces(bufs, pieces, names, verify=False)
        if good == len(bufs) and len(pieces) <= max(4, good // 4):      # a few runs: copy them as they are
            self._load_pieces(bufs, list(block_ids), pieces, non_blocking)
        elif good:                                                     # scattered: load() sorts them first
            self.load(bufs[:good], block_ids[:good], non_blocking)
        return good, err

    def _load_pieces(self, bufs: list[torch.Tensor], ids: list[int], runs_in: list, non_blocking: bool) -> None:
        """Copy bufs into the pool at ids, given their runs (see _pieces, split on ids)."""
        nb, pieces, i = self.nbytes, [], 0
        for first, stride, n in runs_in:
            pieces.append((first, first.storage_offset(), stride, ids[i], n))
            i += n
        dst, src = [], []
        if len(pieces) > max(4, len(bufs) // 4):          # scattered: stage them in block order first
            staged = torch.cat(bufs, out=self._staging(len(bufs) * nb))
            blocks = runs(list(range(len(ids))), ids)
            if len(blocks) > max(4, len(bufs) // 4):       # scattered pool blocks too: one indexed copy
                index = torch.tensor(ids, device=self.views[0][0].device)
                for pool_bytes, row, rows, off, chunk in self.views:
                    w = next(w for w in (8, 4, 2, 1) if chunk % w == 0 and (self.start + off) % w == 0)
                    dt = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}[w]
                    part = staged.view(dt).as_strided((rows, len(ids), chunk // w), (chunk // w, nb // w, 1),
                                                      (self.start + off) // w)
                    pool_bytes.view(dt)[row:row + rows].index_copy_(1, index, part.to(index.device))
                return
            pieces = [(staged, r * nb, nb, b, k) for r, b, k in blocks]
        for t, base, stride, block, n in pieces:
            for pool_bytes, row, rows, off, chunk in self.views:
                src.append(t.as_strided((rows, n, chunk), (chunk, stride, 1), base + self.start + off))
                dst.append(pool_bytes[row:row + rows, block:block + n])
        _copy_all(dst, src, non_blocking=non_blocking)


def _copy_all(dst: list[torch.Tensor], src: list[torch.Tensor], non_blocking: bool = False) -> None:
    """Copy [rows, n, chunk] byte views. On the CPU: the C chunk copy with streaming stores (~2x
    torch's strided copy_). Else one foreach copy, each pair reinterpreted as the widest integer
    word its chunks, strides and offsets allow: torch copies such strided chunks element by element,
    so 8-byte elements move the same bytes ~1.3x faster than bytes."""
    if not dst:
        return
    if not dst[0].is_cuda and not src[0].is_cuda and cpu_kernels.available():
        rest = [(d, s) for d, s in zip(dst, src) if not cpu_kernels.copy_chunks(d, s)]
        if not rest:
            return
        dst, src = [d for d, _ in rest], [s for _, s in rest]
    pairs = [_as_words(d, s) for d, s in zip(dst, src)]
    torch._foreach_copy_([d for d, _ in pairs], [s for _, s in pairs], non_blocking=non_blocking)


def _as_words(*views: torch.Tensor) -> tuple[torch.Tensor, ...]:
    for w, dtype in ((8, torch.int64), (4, torch.int32), (2, torch.int16)):
        if all(t.shape[2] % w == 0 and t.stride(0) % w == 0 and t.stride(1) % w == 0 and t.storage_offset() % w == 0
               and t.untyped_storage().data_ptr() % w == 0 for t in views):
            return tuple(torch.empty(0, dtype=dtype, device=t.device).set_(t.untyped_storage()).as_strided(
                (t.shape[0], t.shape[1], t.shape[2] // w), (t.stride(0) // w, t.stride(1) // w, 1),
                t.storage_offset() // w) for t in views)
    return views


def _pieces(bufs: list[torch.Tensor], nbytes: int, ids: list[int] | None = None) -> list:
    """Split bufs (in order) into (first, stride, n): runs lying at one stride >= nbytes inside the
    first one's storage (and, given ids, going to consecutive ids)."""
    ptrs, out, i = [b.data_ptr() for b in bufs], [], 0        # read once: a C call each
    while i < len(bufs):
        n, stride = 1, nbytes
        if i + 1 < len(bufs):
            storage = bufs[i].untyped_storage()
            end = storage.data_ptr() + storage.nbytes()          # live allocations never overlap
            while i + n < len(bufs):
                gap = ptrs[i + n] - ptrs[i]
                if n == 1:
                    stride = gap
                if stride < nbytes or gap != n * stride or ptrs[i + n] + nbytes > end \
                        or (ids is not None and ids[i + n] != ids[i] + n):
                    break
                n += 1
        out.append((bufs[i], stride if n > 1 else nbytes, n))
        i += n
    return out


def pool_codec(pool) -> PoolCodec:
    codec = _CODECS.get(pool)
    if codec is None:
        codec = _CODECS[pool] = PoolCodec(pool)
    return codec


def encode_pool_block(pool, block_id: int, name: bytes | None = None, pin_memory: bool = False) -> torch.Tensor:
    return pool_codec(pool).store([block_id], [name or bytes(16)], pin_memory)[0]


def load_pool_block(pool, block_id: int, buf, verify: bool = True, non_blocking: bool = False) -> None:
    """Check `buf` fits `pool` exactly and copy it into `pool` at `block_id`."""
    codec = pool_codec(pool)
    codec.load([codec.check(buf, verify=verify)], [block_id], non_blocking)
