"""One KV block as a self-describing buffer, identical in every tier.

Layout: a 20-byte prefix (magic b"EBKV", version u16, flags u16, header length u32, xxh3-64 u64
of everything after the prefix), a struct-packed header, then the payload at a 64-byte boundary.
The header holds the block name (16 bytes), the KV format, the payload size, the per-layer K and V
scales (float64), optional JSON meta, and the tensors as segments: a run of layers of one K or V
field (key, dtype, per-layer shape) stored back to back at one payload offset. The block keeps its
KV format: an NVFP4 block is packed nibbles + E4M3 scales here too. All blocks of one pool share
one header except the name, so loaders check a block by comparing bytes (see pool_codec).
"""
from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass, field

import torch

from everybyte.kv.data.tiers.buffers import as_uint8_tensor
from everybyte.kv.tiers.frame import checksum

MAGIC = b"EBKV"
VERSION = 3
PREFIX = struct.Struct("<4sHHIQ")      # magic, version, flags, header length, checksum
CHECKSUM = slice(12, 20)               # where the checksum lies in the prefix
HEAD = struct.Struct("<16s16sQHHHI")   # name, format, payload bytes, segments, k scales, v scales, meta bytes
SEG = struct.Struct("<cBBBHHQ")        # b"k"/b"v", dtype code, ndim, key length, first layer, layers, offset
FLAG_NAME = 1
ALIGN = 64
DTYPES = (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float16, torch.bfloat16,
          torch.float32, torch.float64, torch.float8_e4m3fn, torch.float8_e5m2, torch.bool)


class CorruptBlock(ValueError):
    """The buffer is not an intact encoded block (bad magic, truncated, checksum mismatch)."""


class FormatMismatch(CorruptBlock):
    """An intact block that does not fit the pool it is loaded into (format, shapes or scales)."""


@dataclass
class DecodedBlock:
    format: str
    tensors: dict[str, torch.Tensor]          # CPU views into the buffer
    scales: dict[str, float] = field(default_factory=dict)
    name: bytes | None = None
    meta: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Segment:
    kv: str                    # "k" or "v"
    key: str                   # the format's field
    dtype: torch.dtype
    shape: tuple[int, ...]     # one layer's tensor
    first: int                 # first layer
    count: int                 # layers, stored back to back
    offset: int                # in the payload

    @property
    def chunk(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize

    def keys(self) -> list[str]:
        return [f"{self.kv}.{i}.{self.key}" for i in range(self.first, self.first + self.count)]


def _align(n: int, to: int = ALIGN) -> int:
    return -(-n // to) * to


def plan_segments(entries: list[tuple[str, int, str, torch.dtype, tuple]]) -> tuple[list[Segment], int]:
    """(kv, layer, key, dtype, shape) per tensor -> segments (grouped by field, K before V, layers in
    order) and the payload size."""
    groups: dict[tuple, None] = {}
    for kv, layer, key, dtype, shape in entries:
        if kv not in ("k", "v"):
            raise ValueError(f"block tensor {kv}.{layer}.{key}: expected k.<layer>.<field> or v.<layer>.<field>")
        groups.setdefault((key, dtype, tuple(shape)), None)
    rank = {g: i for i, g in enumerate(groups)}
    ordered = sorted(entries, key=lambda e: (rank[(e[2], e[3], tuple(e[4]))], e[0], e[1]))
    segs, off, cur = [], 0, None
    for kv, layer, key, dtype, shape in ordered:
        if cur and (cur.kv, cur.key, cur.dtype, cur.shape) == (kv, key, dtype, tuple(shape)) \
                and cur.first + cur.count == layer:
            cur = segs[-1] = Segment(kv, key, dtype, cur.shape, cur.first, cur.count + 1, cur.offset)
            off += cur.chunk
            continue
        off = _align(off)
        cur = Segment(kv, key, dtype, tuple(shape), layer, 1, off)
        segs.append(cur)
        off += cur.chunk
    return segs, _align(off)


def pack_header(fmt: str, segs: list[Segment], payload: int, k_scales: list[float], v_scales: list[float],
                name: bytes | None = None, meta: dict | None = None) -> bytes:
    """PREFIX (checksum 0) + header, padded to the payload's start."""
    fmt_b, meta_b = fmt.encode(), json.dumps(meta, separators=(",", ":")).encode() if meta else b""
    if len(fmt_b) > 16 or (name is not None and len(name) != 16):
        raise ValueError(f"format name over 16 bytes ({fmt!r}) or block name not 16 bytes")
    parts = [HEAD.pack(name or bytes(16), fmt_b, payload, len(segs), len(k_scales), len(v_scales), len(meta_b))]
    for s in segs:
        key = s.key.encode()
        parts += [SEG.pack(s.kv.encode(), DTYPES.index(s.dtype), len(s.shape), len(key), s.first, s.count, s.offset),
                  struct.pack(f"<{len(s.shape)}I", *s.shape), key]
    parts += [struct.pack(f"<{len(k_scales) + len(v_scales)}d", *k_scales, *v_scales), meta_b]
    header = b"".join(parts)
    start = _align(PREFIX.size + len(header))
    flags = FLAG_NAME if name is not None else 0
    return PREFIX.pack(MAGIC, VERSION, flags, len(header), 0) + header + bytes(start - PREFIX.size - len(header))


def seal(mv: memoryview) -> None:
    """Write the checksum of one encoded block (a writable byte view) into its prefix."""
    struct.pack_into("<Q", mv, CHECKSUM.start, checksum(mv[PREFIX.size:]))


def _split_key(key: str) -> tuple[str, int, str]:
    try:
        kv, layer, name = key.split(".", 2)
        return kv, int(layer), name
    except ValueError:
        raise ValueError(f"block tensor key {key!r}: expected k.<layer>.<field> or v.<layer>.<field>") from None


def _scale_lists(scales: dict[str, float]) -> tuple[list[float], list[float]]:
    out = {"k": [], "v": []}
    for kv in out:
        while f"{kv}.{len(out[kv])}" in scales:
            out[kv].append(float(scales[f"{kv}.{len(out[kv])}"]))
    if len(out["k"]) + len(out["v"]) != len(scales):
        raise ValueError(f"scales must be keyed k.0.. and v.0.. without gaps, got {sorted(scales)}")
    return out["k"], out["v"]


def encode_block(tensors: dict[str, torch.Tensor], fmt: str, scales: dict[str, float] | None = None,
                 name: bytes | None = None, meta: dict | None = None,
                 pin_memory: bool = False) -> torch.Tensor:
    """Serialize one block into a 1-D uint8 CPU tensor (pinned if asked)."""
    entries = [(*_split_key(k), t.dtype, tuple(t.shape)) for k, t in tensors.items()]
    segs, payload = plan_segments(entries)
    head = pack_header(fmt, segs, payload, *_scale_lists(dict(scales or {})), name, meta)
    buf = torch.zeros(len(head) + payload, dtype=torch.uint8, pin_memory=pin_memory)
    on_cuda = False
    for s in segs:
        for i, key in enumerate(s.keys()):
            t = tensors[key]
            at = len(head) + s.offset + i * s.chunk
            if s.chunk:
                buf[at:at + s.chunk].view(t.dtype).view(t.shape).copy_(t, non_blocking=pin_memory)
                on_cuda |= t.is_cuda
    if on_cuda:
        torch.cuda.current_stream().synchronize()
    mv = memoryview(buf.numpy())
    mv[:len(head)] = head
    seal(mv)
    return buf


def parse(buf, verify: bool = True) -> tuple[dict, list[Segment], int]:
    """(header fields, segments, payload start) of an encoded block, checked for magic, version,
    lengths and (if verify) the checksum."""
    mv = memoryview(as_uint8_tensor(buf).numpy())
    if len(mv) < PREFIX.size + HEAD.size:
        raise CorruptBlock(f"truncated block: {len(mv)} bytes")
    magic, version, flags, hlen, crc = PREFIX.unpack_from(mv)
    if magic != MAGIC:
        raise CorruptBlock(f"bad magic {bytes(magic)!r}")
    if version != VERSION:
        raise CorruptBlock(f"unsupported block version {version}")
    if PREFIX.size + hlen > len(mv):
        raise CorruptBlock("truncated block header")
    try:
        name, fmt, payload, nseg, nk, nv, nmeta = HEAD.unpack_from(mv, PREFIX.size)
        pos, segs = PREFIX.size + HEAD.size, []
        for _ in range(nseg):
            kv, code, ndim, klen, first, count, off = SEG.unpack_from(mv, pos)
            pos += SEG.size
            shape = struct.unpack_from(f"<{ndim}I", mv, pos)
            pos += 4 * ndim
            key = bytes(mv[pos:pos + klen]).decode()
            pos += klen
            segs.append(Segment(kv.decode(), key, DTYPES[code], shape, first, count, off))
        scales = struct.unpack_from(f"<{nk + nv}d", mv, pos)
        pos += 8 * (nk + nv)
        meta = json.loads(bytes(mv[pos:pos + nmeta])) if nmeta else {}
        if pos + nmeta > PREFIX.size + hlen:
            raise ValueError("header overruns its length")
        fmt = fmt.rstrip(b"\0").decode()
    except (struct.error, ValueError, IndexError, UnicodeDecodeError) as e:
        raise CorruptBlock(f"unreadable block header: {e}") from None
    start = _align(PREFIX.size + hlen)
    if start + payload != len(mv):
        raise CorruptBlock(f"block is {len(mv)} bytes, header says {start + payload}")
    if any(s.offset + s.count * s.chunk > payload or s.kv not in ("k", "v") for s in segs):
        raise CorruptBlock("a tensor does not fit the block's payload")
    if verify and checksum(mv[PREFIX.size:]) != crc:
        raise CorruptBlock("block checksum mismatch")
    header = {"format": fmt, "name": name.hex() if flags & FLAG_NAME else None, "payload_nbytes": payload,
              "scales": {**{f"k.{i}": s for i, s in enumerate(scales[:nk])},
                         **{f"v.{i}": s for i, s in enumerate(scales[nk:])}}, "meta": meta,
              "tensors": [[k, str(s.dtype).removeprefix("torch."), list(s.shape)] for s in segs for k in s.keys()]}
    return header, segs, start


def peek_header(buf) -> dict:
    """The header of an encoded block, checked for magic and lengths but not the checksum."""
    return parse(buf, verify=False)[0]


def decode_block(buf, verify: bool = True, expect_format: str | None = None) -> DecodedBlock:
    """Parse an encoded block; its tensors are views into `buf` (copy before reusing it)."""
    t = as_uint8_tensor(buf)
    header, segs, start = parse(t, verify)
    if expect_format is not None and header["format"] != expect_format:
        raise FormatMismatch(f"block is {header['format']}, expected {expect_format}")
    tensors = {}
    for s in segs:
        for i, key in enumerate(s.keys()):
            at = start + s.offset + i * s.chunk
            tensors[key] = t[at:at + s.chunk].view(s.dtype).view(s.shape)
    name = None if header["name"] is None else bytes.fromhex(header["name"])
    return DecodedBlock(header["format"], tensors, header["scales"], name, header["meta"])
