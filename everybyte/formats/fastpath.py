"""Which implementation a codec call uses: the eager torch reference, or a fused fast path.

Fast paths: on CPU the NVFP4 C kernels (`cpu_kernels`, built once with the system compiler);
elsewhere (CUDA) and for FP8, `torch.compile` of the codec's elementwise formulation. Compiling
costs seconds, so `auto` (the default) compiles only for inputs of at least `AUTO_MIN_NUMEL`
elements; "always" forces the fast path, "never" the reference. Set with `set_mode` or the
EVERYBYTE_FORMATS_FAST environment variable (auto/always/never, or 1/0). A fast path that fails
to build or run warns once and is replaced by the reference for the rest of the process.
"""
from __future__ import annotations

import os
import warnings
from typing import Callable

import torch

AUTO_MIN_NUMEL = 1 << 20
_ALIASES = {"auto": "auto", "always": "always", "never": "never", "1": "always", "0": "never"}
_mode = _ALIASES.get(os.environ.get("EVERYBYTE_FORMATS_FAST", "auto").lower(), "auto")


def set_mode(mode: str) -> None:
    global _mode
    if mode not in ("auto", "always", "never"):
        raise ValueError(f"fast path mode must be 'auto', 'always' or 'never', not {mode!r}")
    _mode = mode


def get_mode() -> str:
    return _mode


def resolve(fast: str | None) -> str:
    mode = fast or _mode
    if mode not in ("auto", "always", "never"):
        raise ValueError(f"fast must be None, 'auto', 'always' or 'never', not {fast!r}")
    return mode


class Compiled:
    """`torch.compile(fn)` on first use (automatic dynamic shapes), falling back to `reference` for good on failure."""

    def __init__(self, fn: Callable, reference: Callable):
        self.fn, self.reference = fn, reference
        self.compiled: Callable | None = None
        self.failed: str | None = None

    def wanted(self, numel: int, fast: str | None) -> bool:
        mode = resolve(fast)
        return self.failed is None and (mode == "always" or (mode == "auto" and numel >= AUTO_MIN_NUMEL))

    def __call__(self, *args, numel: int, fast: str | None = None):
        if self.wanted(numel, fast):
            try:
                if self.compiled is None:
                    self.compiled = torch.compile(self.fn)
                return self.compiled(*args)
            except Exception as e:  # noqa: BLE001 - no compiler, unsupported backend...: stay correct
                self.failed = f"{type(e).__name__}: {e}"
                warnings.warn(f"everybyte.formats fast path disabled, using the eager reference ({self.failed})")
        return self.reference(*args)
