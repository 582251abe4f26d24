"""The control plane's per-request path compiled with mypyc: the same source files, typed (mypy
strict), built into C extension modules and imported in their place. Nothing is forked: a module
left out, or a build that fails, runs as Python with the same behaviour.

Opt-in (EVERYBYTE_COMPILED=1, read by the CLI before it imports anything else): the build (about
a minute, once) goes to the kernel cache keyed by the sources, mypy's version, the
interpreter, so a changed source is never served a stale binary; a second process asking for the
same build waits for the first one's.
activate() must run before any of MODULES is imported; the simulator is what gains from it
(bench sim-speed --compiled measures both side by side)."""
from __future__ import annotations

import fcntl
import hashlib
import importlib.abc
import importlib.machinery
import importlib.metadata
import importlib.util
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path
from types import ModuleType
from typing import Callable, Sequence

from everybyte.native.loader import cache_dir

MODULES = (
    "everybyte.engine.sequence", "everybyte.engine.scheduler", "everybyte.engine.core",
    "everybyte.engine.decode_run", "everybyte.kv.clock", "everybyte.kv.name_memo",
    "everybyte.kv.sessions", "everybyte.kv.session_ops", "everybyte.kv.memory_manager",
    "everybyte.sim.cost_model", "everybyte.sim.executor", "everybyte.sim.runner",
    "everybyte.kv.seq_state", "everybyte.engine.outputs", "everybyte.traces.tokens", "everybyte.kv.block_id",
    "everybyte.kv.ledger", "everybyte.sim.routes", "everybyte.sim.mover", "everybyte.kv.block_manager",
    "everybyte.sim.worker", "everybyte.traces.scaling",
)
PACKAGE = Path(__file__).resolve().parents[1]           # everybyte/
# Only our modules (and numpy, which traces/tokens types against) are read for types; every other
# import is Any. Under the options mypyc sets (export_types, preserve_asts) mypy read 132 of our
# modules instead of 60 and went on into transformers, ray, moto and torch: 7.7 minutes of an
# 8.7-minute build, for a binary of the same size to the byte (the same decisions and speed).
MYPY_CONFIG = """[mypy]
python_version = 3.11
follow_imports = skip
ignore_missing_imports = True

[mypy-everybyte.*,numpy.*]
follow_imports = silent
"""


def _source(module: str) -> Path:
    return PACKAGE.parent / (module.replace(".", "/") + ".py")


def build_dir(modules: Sequence[str] = MODULES) -> Path:
    """Where the build of these modules' current sources lives (whether or not it exists yet)."""
    h = hashlib.sha256("\0".join([importlib.metadata.version("mypy"), sys.version, sysconfig.get_config_var("SOABI") or "",
                                  MYPY_CONFIG]).encode())
    for m in modules:
        h.update(m.encode() + b"\0" + _source(m).read_bytes())
    return cache_dir() / f"control_plane_{h.hexdigest()[:16]}"


def build(modules: Sequence[str] = MODULES, announce: Callable[[], None] | None = None) -> Path:
    """Compile the modules (cached); the directory holding their extension modules. announce()
    runs first when this process is the one that builds. Raises RuntimeError with mypyc's errors
    when the build fails."""
    target = build_dir(modules)
    if (target / "MODULES").exists():
        return target
    with open(target.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)            # one build; the others wait for it
        if not (target / "MODULES").exists():
            if announce is not None:
                announce()
            _build(modules, target)
    return target


def _build(modules: Sequence[str], target: Path) -> None:
    with tempfile.TemporaryDirectory(dir=cache_dir()) as tmp:
        work = Path(tmp)
        shutil.copytree(PACKAGE, work / "everybyte", ignore=shutil.ignore_patterns("*.so", "__pycache__", "csrc"))
        (work / "mypy.ini").write_text(MYPY_CONFIG)
        paths = [m.replace(".", "/") + ".py" for m in modules]
        done = subprocess.run([sys.executable, "-m", "mypyc", "--config-file", "mypy.ini", *paths], cwd=work,
                              capture_output=True, text=True)
        if done.returncode != 0:
            lines = (done.stdout + done.stderr).splitlines()
            raise RuntimeError("mypyc failed:\n" + "\n".join(ln for ln in lines if "error" in ln)[-4000:])
        staged = work / "out"
        for so in [p for p in work.rglob("*.so") if p.relative_to(work).parts[0] != "build"]:
            dest = staged / so.relative_to(work)
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.move(str(so), dest)
        (staged / "MODULES").write_text("\n".join(modules))
        if target.exists():                         # a partial build of a killed process
            shutil.rmtree(target)
        os.replace(staged, target)


class _Finder(importlib.abc.MetaPathFinder):
    """Imports the listed modules (and mypyc's shared library) from the build directory."""

    def __init__(self, root: Path, modules: Sequence[str]):
        self.root, self.modules = root, set(modules)

    def find_spec(self, fullname: str, path: object = None, target: ModuleType | None = None
                  ) -> importlib.machinery.ModuleSpec | None:
        if fullname in self.modules:
            base = self.root / fullname.replace(".", "/")
        elif fullname.endswith("__mypyc") and "." not in fullname:
            base = self.root / fullname
        else:
            return None
        found = list(base.parent.glob(base.name + ".*.so"))
        if not found:
            return None
        loader = importlib.machinery.ExtensionFileLoader(fullname, str(found[0]))
        return importlib.util.spec_from_file_location(fullname, str(found[0]), loader=loader)


_active: Path | None = None


def active() -> bool:
    """Whether this process imports the compiled control plane."""
    return _active is not None


def activate(modules: Sequence[str] = MODULES, announce: Callable[[], None] | None = None) -> Path:
    """Build if needed and import the modules compiled from now on. RuntimeError when one of
    them is already imported (it would be a different class than its compiled twin) or the build fails."""
    global _active
    loaded = [m for m in modules if m in sys.modules]
    if loaded:
        raise RuntimeError(f"activate the compiled control plane before importing {', '.join(loaded)}")
    root = build(modules, announce)
    sys.meta_path.insert(0, _Finder(root, modules))
    _active = root
    return root
