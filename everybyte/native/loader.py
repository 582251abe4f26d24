"""Builds C sources with the system compiler into a shared library, once, and loads it.

Flags: -O3 -march=native (so AVX-512, AVX2 or portable paths are chosen by what this CPU has),
no FMA contraction and no fast-math (kernels that promise the torch reference's bytes depend on
it), OpenMP when the compiler has it. The library goes to $EVERYBYTE_HOME/kernels (default
~/.cache/everybyte/kernels), keyed by a hash of source, flags, compiler and the CPU's flags, so a
cache shared between machines never hands one CPU another's binary. Callers treat a failure
(no compiler, a build error) as "use the torch reference" and say why.
"""
from __future__ import annotations

import ctypes
import hashlib
import importlib.machinery
import importlib.util
import os
import platform
import shutil
import subprocess
import sysconfig
import tempfile
import warnings
from pathlib import Path
from types import ModuleType
from typing import Callable, TypeVar

T = TypeVar("T")

CSRC = Path(__file__).resolve().parent / "csrc"
FLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-fno-fast-math", "-shared", "-fPIC", "-Wno-psabi"]


def cache_dir() -> Path:
    home = Path(os.environ.get("EVERYBYTE_HOME") or "~/.cache/everybyte").expanduser() / "kernels"
    try:
        home.mkdir(parents=True, exist_ok=True)
        if os.access(home, os.W_OK):
            return home
    except OSError:
        pass
    return Path(tempfile.gettempdir()) / f"everybyte-kernels-{os.getuid()}"


def cpu_id() -> str:
    """-march=native binaries are only valid on this kind of CPU: key the cache by its flags."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith(("flags", "Features"))), platform.processor())
    except OSError:
        return platform.machine() + platform.processor()


def compiler() -> str:
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not cc:
        raise RuntimeError("no C compiler (cc/gcc) on PATH")
    return cc


def build(name: str, source: str, openmp: bool = True, flags: list[str] | None = None) -> Path:
    """The path of `source` compiled (cached); CalledProcessError/OSError when it does not build."""
    cc = compiler()
    flags = (flags or FLAGS) + (["-fopenmp"] if openmp else [])
    key = hashlib.sha256("\0".join([source, cc, *flags, cpu_id()]).encode()).hexdigest()[:16]
    target = cache_dir() / f"{name}_{key}.so"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            src, lib = Path(tmp) / f"{name}.c", Path(tmp) / f"{name}.so"
            src.write_text(source)
            subprocess.run([cc, *flags, "-o", str(lib), str(src)], check=True, capture_output=True, timeout=180)
            os.replace(lib, target)
    return target


def load(name: str, source: str, flags: list[str] | None = None) -> ctypes.CDLL:
    """Build (with OpenMP, else without) and load; raises what the build or the load raised."""
    try:
        return ctypes.CDLL(str(build(name, source, openmp=True, flags=flags)))
    except (subprocess.CalledProcessError, OSError):
        return ctypes.CDLL(str(build(name, source, openmp=False, flags=flags)))


def load_module(name: str, source: str) -> ModuleType:
    """Build `source` as the CPython extension module `name` (PyInit_<name>) against this
    interpreter's headers, and import it; raises what the build or the import raised."""
    inc = sysconfig.get_paths()["include"]
    if not os.path.exists(os.path.join(inc, "Python.h")):
        raise OSError(f"no Python.h in {inc} (install the Python development headers)")
    flags = ["-O2", "-shared", "-fPIC", "-fno-strict-aliasing", "-I", inc]
    path = build(name, source, openmp=False, flags=flags)
    loader = importlib.machinery.ExtensionFileLoader(name, str(path))
    spec = importlib.util.spec_from_file_location(name, str(path), loader=loader)
    if spec is None:
        raise ImportError(f"cannot import {path}")
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


def csrc(*files: str) -> str:
    """The text of csrc/FILE... joined, as one translation unit."""
    return "\n".join((CSRC / f).read_text() for f in files)


def try_build(what: str, fallback: str, build: Callable[[], T]) -> tuple[T | None, str | None]:
    """(build(), None), or (None, why) with a warning that callers use `fallback` instead of `what`."""
    try:
        return build(), None
    except Exception as e:  # noqa: BLE001 - any failure means: the fallback
        why = f"{type(e).__name__}: {e}"
        warnings.warn(f"everybyte {what} unavailable, using {fallback} ({why})")
        return None, why


def try_module(name: str, what: str, fallback: str,
               headers: tuple[str, ...] = ()) -> tuple[ModuleType | None, str | None]:
    """csrc/<name>.c (after csrc/<headers>, joined in front) as the extension module `name`
    (load_module), or (None, why) as try_build says."""
    return try_build(what, fallback, lambda: load_module(name, csrc(*headers, f"{name}.c")))
