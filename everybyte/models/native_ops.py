"""The model ops' C library (native/csrc: nvfp4_simd.h, nvfp4_gemm.c, decode_attention.c), built
once by the native loader; None (and a warning saying why) where it cannot be built, and the
callers then take their torch reference paths."""
from __future__ import annotations

import ctypes
import warnings

from everybyte.native import loader

SOURCES = ("nvfp4_simd.h", "nvfp4_gemm.c", "decode_attention.c")
FLAGS = loader.FLAGS                 # tests swap in other -march targets
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
    lib.nvfp4_init()
    return lib


def lib() -> ctypes.CDLL | None:
    global _lib, _error
    if _lib is None and _error is None:
        try:
            _lib = build()
        except Exception as e:  # noqa: BLE001 - any failure means: the torch reference paths
            _error = f"{type(e).__name__}: {e}"
            warnings.warn(f"everybyte model C kernels unavailable, using the torch reference ({_error})")
    return _lib


def error() -> str | None:
    lib()
    return _error
