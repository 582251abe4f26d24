"""Self-describing flat buffers for quantized tensors, and the input checks the codecs share.

Layout (little-endian): magic b"EBQT", u16 version, u8 format id, u8 tensor count, u8 ndim,
3 pad bytes, ndim x u64 original shape; per stored tensor: u8 dtype code, u8 ndim, ndim x u64
shape; u32 CRC-32 of the payload; then the payload: each tensor's bytes in order. `unpack`
raises ValueError on a bad magic, an unknown version or format, a truncated or overlong buffer
and a checksum mismatch, so a corrupt block can only become a miss, never wrong values.
"""
from __future__ import annotations

import math
import struct
import zlib

import torch

MAGIC = b"EBQT"
VERSION = 1
FORMAT_IDS = {"nvfp4": 1, "fp8_e4m3": 2}
DTYPES = {1: torch.uint8, 2: torch.float8_e4m3fn, 3: torch.float32, 4: torch.int64}
DTYPE_CODES = {v: k for k, v in DTYPES.items()}
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_HEAD = struct.Struct("<4sHBBB3x")


def pack(fmt: str, shape, tensors: list[torch.Tensor]) -> bytes:
    head = [_HEAD.pack(MAGIC, VERSION, FORMAT_IDS[fmt], len(tensors), len(shape)),
            struct.pack(f"<{len(shape)}Q", *shape)]
    payload = []
    for t in tensors:
        head.append(struct.pack(f"<BB{t.dim()}Q", DTYPE_CODES[t.dtype], t.dim(), *t.shape))
        payload.append(t.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy().tobytes())
    body = b"".join(payload)
    return b"".join(head) + struct.pack("<I", zlib.crc32(body)) + body


def _take(buf: memoryview, pos: int, fmt: str):
    size = struct.calcsize(fmt)
    if pos + size > len(buf):
        raise ValueError(f"truncated buffer: need {pos + size} bytes, have {len(buf)}")
    return struct.unpack_from(fmt, buf, pos), pos + size


def unpack(buf, fmt: str) -> tuple[tuple[int, ...], list[torch.Tensor]]:
    buf = memoryview(bytes(buf) if not isinstance(buf, (bytes, bytearray, memoryview)) else buf).cast("B")
    (magic, version, fmt_id, count, ndim), pos = _take(buf, 0, _HEAD.format)
    if magic != MAGIC:
        raise ValueError(f"not an everybyte quantized buffer (magic {bytes(magic)!r}, expected {MAGIC!r})")
    if version != VERSION:
        raise ValueError(f"unsupported buffer version {version} (this build reads {VERSION})")
    if fmt_id != FORMAT_IDS[fmt]:
        names = {v: k for k, v in FORMAT_IDS.items()}
        raise ValueError(f"buffer holds format {names.get(fmt_id, fmt_id)!r}, expected {fmt!r}")
    shape, pos = _take(buf, pos, f"<{ndim}Q")
    specs = []
    for _ in range(count):
        (code, tdim), pos = _take(buf, pos, "<BB")
        tshape, pos = _take(buf, pos, f"<{tdim}Q")
        if code not in DTYPES:
            raise ValueError(f"unknown dtype code {code} in buffer")
        specs.append((DTYPES[code], tshape))
    (crc,), pos = _take(buf, pos, "<I")
    sizes = [math.prod(s) * d.itemsize for d, s in specs]
    if len(buf) - pos != sum(sizes):
        raise ValueError(f"buffer payload is {len(buf) - pos} bytes, header says {sum(sizes)} (truncated or corrupt)")
    if zlib.crc32(buf[pos:]) != crc:
        raise ValueError("buffer checksum mismatch (corrupt payload)")
    tensors = []
    for (dtype, tshape), size in zip(specs, sizes):
        raw = torch.frombuffer(bytearray(buf[pos:pos + size]), dtype=torch.uint8) if size else torch.empty(0, dtype=torch.uint8)
        tensors.append(raw.view(dtype).reshape(tshape))
        pos += size
    return tuple(shape), tensors


def check_float(x) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"expected a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in FLOAT_DTYPES:
        raise TypeError(f"expected a floating-point tensor ({', '.join(map(str, FLOAT_DTYPES))}), got {x.dtype}")


def check_finite(x: torch.Tensor, amax: torch.Tensor | None = None) -> None:
    """ValueError naming the first (row-major) NaN/Inf index; `amax` (if given) short-cuts the check."""
    if x.numel() == 0 or (amax is not None and bool(torch.isfinite(amax).all())):
        return
    bad = (~torch.isfinite(x)).nonzero()
    if len(bad):
        idx = tuple(int(i) for i in bad[0])
        raise ValueError(f"input has a non-finite value {x[idx].item()} at index {idx}")


def abs_max(x: torch.Tensor) -> torch.Tensor:
    """max |x| as a float32 0-d tensor in one pass (NaN or Inf in x make it non-finite); 0 if empty."""
    if x.numel() == 0:
        return torch.zeros((), dtype=torch.float32, device=x.device)
    lo, hi = torch.aminmax(x)
    return torch.maximum(-lo, hi).float()
