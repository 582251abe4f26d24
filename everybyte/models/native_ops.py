"""The model ops' C library (native/csrc: the NVFP4 GEMM, decode attention and the fused decode
step, with the KV codec and layer ops they call), built
once by the native loader; None (and a warning saying why) where it cannot be built, and the
callers then take their torch reference paths."""
from __future__ import annotations

import ctypes

import torch

from everybyte.native import loader

SOURCES = ("nvfp4_simd.h", "nvfp4_codec.c", "nvfp4_kv.c", "layer_ops.c", "nvfp4_gemm.c", "decode_attention.c",
           "decode_step.c")
FLAGS = loader.FLAGS                 # tests swap in other -march targets
PARALLEL_MIN = 1 << 16
_lib: ctypes.CDLL | None = None
_error: str | None = None


def build(flags: list[str] | None = None) -> ctypes.CDLL:
    lib = loader.load("nvfp4_ops", loader.csrc(*SOURCES), flags=flags or FLAGS)
    lib.nvfp4_init.restype = lib.nvfp4_linear.restype = lib.nvfp4_decode_attention.restype = None
    # declared, so a call converts plain ints without building ctypes objects (~120 calls a decode step)
    p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    lib.nvfp4_linear.argtypes = [p, i32, i64, i64, i64, p, p, p, p, p, p, i32, i32]
    f32 = ctypes.c_float
    lib.nvfp4_decode_attention.argtypes = [p, p, i32, i64, i64, i64, i64, p, p, p, p, f32, f32, i64, p, i64, p, p, p,
                                           p, p, i64, p, f32, i32]
    lib.init_tables.restype = lib.silu_mul_f32.restype = lib.rotate_rows_f32.restype = None
    lib.silu_mul_f32.argtypes = [p, i64, i64, p, i32]
    lib.add_rmsnorm_f32.restype = lib.rope_f32.restype = None
    lib.add_rmsnorm_f32.argtypes = [p, p, p, p, i64, i64, ctypes.c_float, i32]
    lib.rope_f32.argtypes = [p, i64, i64, p, i64, i64, i64, i64, p, p, p, p, i32]
    lib.rotate_rows_f32.argtypes = [p, i64, p, i64, p, i32]
    lib.nvfp4_init()
    lib.init_tables()
    return lib


def lib() -> ctypes.CDLL | None:
    global _lib, _error
    if _lib is None and _error is None:
        _lib, _error = loader.try_build("model C kernels", "the torch reference", build)
    return _lib


def error() -> str | None:
    lib()
    return _error


def f32_cpu(*ts: torch.Tensor) -> bool:
    """Whether every tensor is float32, on CPU and contiguous (what the model-op kernels take)."""
    return all(t.dtype is torch.float32 and t.device.type == "cpu" and t.is_contiguous() for t in ts)


def add_rmsnorm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """float32 CPU, contiguous [rows, n]: residual += x in place (when given), returns the RMS-normed
    (residual or x) * weight. Callers check available()."""
    rows, n = x.shape
    out = torch.empty_like(x)
    _lib.add_rmsnorm_f32(x.data_ptr(), None if residual is None else residual.data_ptr(), weight.data_ptr(),
                         out.data_ptr(), rows, n, eps, _threads(rows * n))
    return out


def rope(q: torch.Tensor, k: torch.Tensor, table: torch.Tensor, positions: torch.Tensor
         ) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, Hq, D], k [T, Hkv, D] float32 CPU, each row contiguous ([H, D] dense, any row stride);
    table [max_pos, D] (cos then sin halves); positions int64 [T]. -> contiguous rotated q, k."""
    T, hq, d = q.shape
    hk = k.shape[1]
    q_out, k_out = torch.empty(T, hq, d), torch.empty(T, hk, d)
    _lib.rope_f32(q.data_ptr(), q.stride(0), hq, k.data_ptr(), k.stride(0), hk, T, d, table.data_ptr(),
                  positions.data_ptr(), q_out.data_ptr(), k_out.data_ptr(), _threads(T * (hq + hk) * d))
    return q_out, k_out


def available() -> bool:
    return lib() is not None


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor | None:
    """silu(gate) * up of [rows, 2 * inter] ([gate | up]) float32 CPU rows; None: not applicable."""
    if gate_up.dim() != 2 or not f32_cpu(gate_up) or lib() is None:
        return None
    rows, inter = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(rows, inter)
    _lib.silu_mul_f32(gate_up.data_ptr(), rows, inter, out.data_ptr(), _threads(rows * inter))
    return out


def rotate_rows(x: torch.Tensor, h: torch.Tensor) -> torch.Tensor | None:
    """x @ h over the last dim (D <= 256, a multiple of 16) for float32 CPU tensors; None: not applicable."""
    D = h.shape[0]
    if not f32_cpu(x, h) or x.shape[-1] != D or D % 16 or D > 256 or lib() is None:
        return None
    out = torch.empty_like(x)
    n = x.numel() // D
    _lib.rotate_rows_f32(x.data_ptr(), n, h.data_ptr(), D, out.data_ptr(), _threads(n * D * D // 16))
    return out


def _threads(work: int) -> int:
    """All torch threads for at least PARALLEL_MIN (multiply-adds or elements), else one."""
    return torch.get_num_threads() if work >= PARALLEL_MIN else 1
