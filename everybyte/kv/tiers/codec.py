"""One KV block as a self-describing buffer, identical in every tier.

Layout: a 16-byte prefix (magic b"EBKV", version u16, flags u16, header length u32, crc32 u32 of
everything after the prefix), a JSON header (format, block name, per-tensor key/dtype/shape/offset,
per-layer scales, meta, payload size), then the tensors' raw bytes, each 64-byte aligned. The
block keeps its KV format: an NVFP4 block is packed nibbles + E4M3 scales here too.
A block of a pool is `{"k.<layer>.<field>": pool.k[layer][field][block_id], "v...": ...}`.
"""
from __future__ import annotations

import json
import math
import struct
import zlib
from dataclasses import dataclass, field

import torch

from everybyte.kv.tiers.base import as_uint8_tensor

MAGIC = b"EBKV"
VERSION = 1
PREFIX = struct.Struct("<4sHHII")
ALIGN = 64


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


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def _dtype(name: str) -> torch.dtype:
    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        raise CorruptBlock(f"unknown dtype {name!r}")
    return dt


def block_tensors(pool, block_id: int) -> dict[str, torch.Tensor]:
    """The tensors of one pool block (views, on the pool's device)."""
    out = {}
    for kv, stores in (("k", pool.k), ("v", pool.v)):
        for layer, store in enumerate(stores):
            for key, t in store.items():
                out[f"{kv}.{layer}.{key}"] = t[block_id]
    return out


def block_scales(pool) -> dict[str, float]:
    return {**{f"k.{i}": float(s) for i, s in enumerate(pool.k_scales)},
            **{f"v.{i}": float(s) for i, s in enumerate(pool.v_scales)}}


def encode_block(tensors: dict[str, torch.Tensor], fmt: str, scales: dict[str, float] | None = None,
                 name: bytes | None = None, meta: dict | None = None,
                 pin_memory: bool = False) -> torch.Tensor:
    """Serialize one block into a 1-D uint8 CPU tensor (pinned if asked)."""
    specs, off = [], 0
    for key, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        specs.append([key, str(t.dtype).removeprefix("torch."), list(t.shape), off, nbytes])
        off = _align(off + nbytes)
    header = json.dumps({"format": fmt, "name": None if name is None else name.hex(), "tensors": specs,
                         "scales": dict(scales or {}), "meta": dict(meta or {}), "payload_nbytes": off},
                        separators=(",", ":")).encode()
    start = _align(PREFIX.size + len(header))
    buf = torch.zeros(start + off, dtype=torch.uint8, pin_memory=pin_memory)
    on_cuda = False
    for (key, _, _, o, n), t in zip(specs, tensors.values()):
        if n:
            buf[start + o:start + o + n].view(t.dtype).view(t.shape).copy_(t, non_blocking=pin_memory)
            on_cuda |= t.is_cuda
    if on_cuda:
        torch.cuda.current_stream().synchronize()
    mv = memoryview(buf.numpy())
    mv[PREFIX.size:PREFIX.size + len(header)] = header
    crc = zlib.crc32(mv[PREFIX.size:])
    mv[:PREFIX.size] = PREFIX.pack(MAGIC, VERSION, 0, len(header), crc)
    return buf


def encode_pool_block(pool, block_id: int, name: bytes | None = None, pin_memory: bool = False,
                      meta: dict | None = None) -> torch.Tensor:
    return encode_block(block_tensors(pool, block_id), pool.kv_cache_dtype, block_scales(pool), name,
                        meta, pin_memory)


def peek_header(buf) -> dict:
    """The JSON header of an encoded block, checked for magic and length but not checksum."""
    return _parse(as_uint8_tensor(buf), verify=False)[0]


def _parse(t: torch.Tensor, verify: bool) -> tuple[dict, int]:
    mv = memoryview(t.numpy())
    if len(mv) < PREFIX.size:
        raise CorruptBlock(f"truncated block: {len(mv)} bytes")
    magic, version, _, hlen, crc = PREFIX.unpack(mv[:PREFIX.size])
    if magic != MAGIC:
        raise CorruptBlock(f"bad magic {bytes(magic)!r}")
    if version != VERSION:
        raise CorruptBlock(f"unsupported block version {version}")
    if PREFIX.size + hlen > len(mv):
        raise CorruptBlock("truncated block header")
    try:
        header = json.loads(bytes(mv[PREFIX.size:PREFIX.size + hlen]))
        start = _align(PREFIX.size + hlen)
        total = start + int(header["payload_nbytes"])
    except (ValueError, KeyError, TypeError) as e:
        raise CorruptBlock(f"unreadable block header: {e}") from None
    if total != len(mv):
        raise CorruptBlock(f"block is {len(mv)} bytes, header says {total}")
    if verify and zlib.crc32(mv[PREFIX.size:]) != crc:
        raise CorruptBlock("block checksum mismatch")
    return header, start


def decode_block(buf, verify: bool = True, expect_format: str | None = None) -> DecodedBlock:
    """Parse an encoded block; its tensors are views into `buf` (copy before reusing it)."""
    t = as_uint8_tensor(buf)
    header, start = _parse(t, verify)
    tensors = {}
    try:
        for key, dtype, shape, off, nbytes in header["tensors"]:
            dt = _dtype(dtype)
            if nbytes != math.prod(shape) * dt.itemsize or off < 0 or off + nbytes > header["payload_nbytes"]:
                raise CorruptBlock(f"tensor {key} does not fit its header")
            tensors[key] = t[start + off:start + off + nbytes].view(dt).view(shape)
        fmt, scales, meta = header["format"], header["scales"], header["meta"]
        name = None if header["name"] is None else bytes.fromhex(header["name"])
    except (KeyError, TypeError, ValueError) as e:
        if isinstance(e, CorruptBlock):
            raise
        raise CorruptBlock(f"malformed block header: {e}") from None
    if expect_format is not None and fmt != expect_format:
        raise FormatMismatch(f"block is {fmt}, expected {expect_format}")
    return DecodedBlock(fmt, tensors, {k: float(v) for k, v in scales.items()}, name, meta)


def load_pool_block(pool, block_id: int, buf, verify: bool = True, non_blocking: bool = False) -> DecodedBlock:
    """Decode `buf` and copy it into `pool` at `block_id`, after checking it fits the pool exactly."""
    block = decode_block(buf, verify, expect_format=pool.kv_cache_dtype)
    dst = block_tensors(pool, block_id)
    if dst.keys() != block.tensors.keys():
        raise FormatMismatch("block's tensors do not match the pool's layers")
    for key, d in dst.items():
        s = block.tensors[key]
        if s.dtype != d.dtype or s.shape != d.shape:
            raise FormatMismatch(f"{key}: block has {s.dtype}{list(s.shape)}, pool {d.dtype}{list(d.shape)}")
    if block.scales and block.scales != block_scales(pool):
        raise FormatMismatch("block was written with other K/V scales")
    for key, d in dst.items():
        d.copy_(block.tensors[key], non_blocking=non_blocking)
    return block
