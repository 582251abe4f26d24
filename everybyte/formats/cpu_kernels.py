"""Fused CPU kernels for the NVFP4 block codec: one pass over the data, C built on first use.

The eager torch reference (nvfp4_blocks) makes a dozen passes over memory; these kernels
(source in native/csrc: nvfp4_codec.c, nvfp4_kv.c) do each block of 16 in registers with the same IEEE float32 steps (no FMA
contraction, no fast-math; E4M3 and E2M1 rounding on the bit patterns, nearest, ties to even),
so their bytes are the reference's (tests/test_nvfp4.py checks it). Built by the native loader
(everybyte/native/loader.py: system compiler, -march=native, OpenMP if it works, cached). `available()`
is False when that fails (a warning says why); callers then use the reference.
"""
from __future__ import annotations

import ctypes

import torch

from everybyte.native import loader

SOURCES = ("nvfp4_codec.c", "nvfp4_kv.c", "block_copy.c")     # native/csrc

FLAGS = loader.FLAGS                # tests swap in other -march targets
PARALLEL_MIN_BLOCKS = 1 << 14      # below this (256K values) one thread: no OpenMP wake-up latency
_lib: ctypes.CDLL | None = None
_error: str | None = None
_e4m3: torch.Tensor | None = None


def _build() -> ctypes.CDLL:
    global _e4m3
    lib = loader.load("nvfp4", loader.csrc(*SOURCES), flags=FLAGS)
    for name in ("init_tables", "quantize_f32", "quantize_bf16", "dequantize_f32", "dequantize_bf16",
                 "kv_write", "kv_gather", "copy_chunks"):
        getattr(lib, name).restype = None
    lib.absmax_f32.restype = lib.absmax_bf16.restype = ctypes.c_uint32
    lib.init_tables()
    _e4m3 = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).float()
    return lib


def _load() -> ctypes.CDLL | None:
    global _lib, _error
    if _lib is None and _error is None:
        _lib, _error = loader.try_build("NVFP4 CPU kernels", "the torch reference", _build)
    return _lib


def available() -> bool:
    return _load() is not None


def error() -> str | None:
    _load()
    return _error


def _require() -> ctypes.CDLL:
    lib = _load()
    if lib is None:
        raise RuntimeError(f"NVFP4 CPU kernels unavailable: {_error}")
    return lib


def _ptr(t: torch.Tensor) -> ctypes.c_void_p:
    return ctypes.c_void_p(t.data_ptr())


def _scale_arg(s: torch.Tensor) -> tuple[torch.Tensor, int]:
    s = s.to(torch.float32).contiguous()
    return s, (0 if s.numel() == 1 else 1)


def _threads(units: int, minimum: int = PARALLEL_MIN_BLOCKS) -> ctypes.c_int:
    """All torch threads for at least `minimum` units of work (16-value blocks by default), else one."""
    return ctypes.c_int(torch.get_num_threads() if units >= minimum else 1)


def abs_max(x: torch.Tensor) -> torch.Tensor | None:
    """max |x| of a contiguous float32/bfloat16 CPU tensor as a float32 0-d tensor (NaN/Inf
    if any element is not finite); None for other tensors."""
    if x.dtype not in (torch.float32, torch.bfloat16) or not x.is_contiguous() or x.device.type != "cpu":
        return None
    lib = _require()
    fn = lib.absmax_f32 if x.dtype == torch.float32 else lib.absmax_bf16
    bits = fn(_ptr(x), ctypes.c_int64(x.numel()), _threads(x.numel() // 16))
    return torch.tensor([bits], dtype=torch.int64).to(torch.int32).view(torch.float32).reshape(())


def quantize(x: torch.Tensor, s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [N, 16] (float32 or bfloat16, else converted to float32), s 0-d or [N] -> (uint8 [N, 8], e4m3 [N])."""
    lib = _require()
    if x.dtype not in (torch.float32, torch.bfloat16):
        x = x.float()
    x = x.contiguous()
    nb = x.shape[0]
    out = torch.empty(nb, 8, dtype=torch.uint8)
    scales = torch.empty(nb, dtype=torch.uint8)
    s, ss = _scale_arg(s)
    fn = lib.quantize_f32 if x.dtype == torch.float32 else lib.quantize_bf16
    fn(_ptr(x), ctypes.c_int64(nb), _ptr(s), ctypes.c_int64(ss), _ptr(out), _ptr(scales), _threads(nb))
    return out, scales.view(torch.float8_e4m3fn)


def dequantize(packed: torch.Tensor, scales: torch.Tensor, s: torch.Tensor, dtype: torch.dtype,
               out: torch.Tensor | None = None) -> torch.Tensor:
    """packed [N, 8], scales [N] -> [N, 16] in dtype (computed in float32, rounded to nearest even).
    `out` (contiguous, N*16 elements of dtype) is written in place when given."""
    lib = _require()
    packed, scales = packed.contiguous(), scales.contiguous().view(torch.uint8)
    nb = packed.shape[0]
    native = dtype if dtype in (torch.float32, torch.bfloat16) else torch.float32
    direct = out is not None and out.dtype == native and out.is_contiguous() and out.numel() == nb * 16
    dst = out.view(nb, 16) if direct else torch.empty(nb, 16, dtype=native)
    s, ss = _scale_arg(s)
    fn = lib.dequantize_f32 if native == torch.float32 else lib.dequantize_bf16
    fn(_ptr(packed), _ptr(scales), ctypes.c_int64(nb), _ptr(s), ctypes.c_int64(ss), _ptr(_e4m3), _ptr(dst), _threads(nb))
    if direct:
        return out
    result = dst if native == dtype else dst.to(dtype)
    return result if out is None else out.copy_(result.view(out.shape))


def kv_write(data: torch.Tensor, scales: torch.Tensor, slots: torch.Tensor, x: torch.Tensor, s: float,
             divisors: torch.Tensor) -> None:
    """Encode x [T, ..., n] (float32/bfloat16, n % 16 == 0) with the best of `divisors` per block
    of 16 (nvfp4_kv.quantize_blocks_best_scale) into pool slots: data [slots, T's n/2 bytes],
    scales [slots, n/16] (contiguous). Negative slots are skipped."""
    kv_write_pairs([(data, scales, x, s)], slots, divisors)


def kv_write_pairs(stores: list, slots: torch.Tensor, divisors: torch.Tensor) -> None:
    """kv_write for several (data, scales, x, s) sharing one slot list (a layer's K and V): the
    per-call preparation, which costs more than the encoding at decode, is done once."""
    lib = _require()
    slots = slots.to(torch.int64).contiguous()
    slot_ptr, divs, nd = _ptr(slots), _ptr(divisors), ctypes.c_int(divisors.numel())
    for data, scales, x, s in stores:
        if x.dtype not in (torch.float32, torch.bfloat16):
            x = x.float()
        x = x.contiguous()
        nt, bpt = x.shape[0], x.numel() // max(x.shape[0], 1) // 16
        lib.kv_write(_ptr(x), ctypes.c_int(x.dtype == torch.bfloat16), ctypes.c_int64(nt), ctypes.c_int64(bpt),
                     slot_ptr, ctypes.c_float(s), divs, nd, _ptr(data), _ptr(scales.view(torch.uint8)),
                     _threads(nt * bpt * 4))


def kv_gather(data: torch.Tensor, scales: torch.Tensor, block_ids: torch.Tensor, s: float,
              dtype: torch.dtype) -> torch.Tensor | None:
    """The blocks data[block_ids], scales[block_ids] (pool tensors, first dim = block) dequantized:
    [n, values per block] in dtype (float32 or bfloat16; None for other dtypes)."""
    out = kv_gather_pairs([(data, scales, s)], block_ids, dtype)
    return None if out is None else out[0]


def kv_gather_pairs(stores: list, block_ids: torch.Tensor, dtype: torch.dtype) -> list[torch.Tensor] | None:
    """kv_gather for several (data, scales, s) read at the same block ids (a layer's K and V)."""
    if dtype not in (torch.float32, torch.bfloat16):
        return None
    lib = _require()
    ids = block_ids.reshape(-1).to(torch.int64).contiguous()
    n, id_ptr, bf16 = ids.numel(), _ptr(ids), ctypes.c_int(dtype == torch.bfloat16)
    outs = []
    for data, scales, s in stores:
        per = scales.numel() // max(scales.shape[0], 1)
        out = torch.empty(n, per * 16, dtype=dtype)
        lib.kv_gather(_ptr(data), _ptr(scales.view(torch.uint8)), id_ptr, ctypes.c_int64(n), ctypes.c_int64(per),
                      ctypes.c_float(s), _ptr(_e4m3), _ptr(out), bf16, _threads(n * per))
        outs.append(out)
    return outs


def copy_chunks(dst: torch.Tensor, src: torch.Tensor) -> bool:
    """dst.copy_(src) for [rows, n, chunk] uint8 CPU views whose chunks are contiguous, with
    streaming stores (block_copy_c); False, copying nothing, when the kernels are unavailable or
    the views are not of that kind."""
    lib = _load()
    if lib is None or dst.dtype != torch.uint8 or src.dtype != torch.uint8 or dst.dim() != 3 \
            or dst.shape != src.shape or dst.stride(2) != 1 or src.stride(2) != 1 or dst.is_cuda or src.is_cuda:
        return False
    rows, n, chunk = dst.shape
    i64 = ctypes.c_int64
    lib.copy_chunks(_ptr(dst), i64(dst.stride(0)), i64(dst.stride(1)), _ptr(src), i64(src.stride(0)),
                    i64(src.stride(1)), i64(rows), i64(n), i64(chunk), _threads(rows * n * chunk, 1 << 20))
    return True
