"""Servers a benchmark starts and stops: a free 127.0.0.1 port, a server subprocess in its own
session (its log in a file, ready when GET /v1/models answers), and the peer servers described in
bench/peers/NAME.py (PeerError says what to install when one is absent)."""
from __future__ import annotations

import importlib.util
import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import httpx

PEERS_DIR = Path(__file__).resolve().parents[2] / "bench" / "peers"


class PeerError(Exception):
    """A peer cannot be used (not installed, failed to start); the message says what to do."""


def load_peer(name: str, peers_dir: Path | None = None):
    """bench/peers/NAME.py as a module; PeerError when it is unknown or not installed (its missing() names
    what is absent: Python modules, an interpreter, a binary)."""
    peers_dir = Path(peers_dir or PEERS_DIR)
    path = Path(peers_dir) / f"{name}.py"
    if not path.is_file():
        known = sorted(p.stem for p in Path(peers_dir).glob("*.py") if not p.stem.startswith("_"))
        raise PeerError(f"unknown peer {name!r} (no {path}); known peers: {', '.join(known) or 'none'}")
    spec = importlib.util.spec_from_file_location(f"everybyte_peer_{name}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    gone = mod.missing()
    if gone:
        raise PeerError(f"peer {name} ({mod.NAME}) is not installed: {', '.join(gone)} not found. "
                        f"Install it once with:\n    {mod.INSTALL}\n({mod.INSTALL_NOTE})")
    return mod


def threading_main() -> bool:
    import threading
    return threading.current_thread() is threading.main_thread()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """A server started as a subprocess, its log in a file; ready when GET /v1/models answers 200."""

    def __init__(self, name: str, cmd: list[str], port: int, log_path: str, env: dict | None = None):
        self.name, self.cmd, self.port, self.log_path = name, cmd, port, log_path
        self.url = f"http://127.0.0.1:{port}"
        self._log = open(log_path, "wb")
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True)

    def wait_ready(self, timeout_s: float) -> float:
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout_s:
            if self.proc.poll() is not None:
                raise PeerError(f"{self.name} server exited with code {self.proc.returncode} before it was "
                                f"ready; log {self.log_path}:\n{self.log_tail()}")
            try:
                if httpx.get(self.url + "/v1/models", timeout=2.0).status_code == 200:
                    return time.monotonic() - t0
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.stop()
        raise PeerError(f"{self.name} server not ready after {timeout_s:.0f}s; log {self.log_path}:\n"
                        f"{self.log_tail()}")

    def log_tail(self, n: int = 20) -> str:
        try:
            return "\n".join(Path(self.log_path).read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def stop(self, timeout_s: float = 30.0) -> None:
        """SIGTERM to the server's process group (its own session: engine subprocesses included), SIGKILL
        to what is left after timeout_s."""
        if self.proc.poll() is None:
            self._signal_group(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                pass
        self._signal_group(signal.SIGKILL)
        self.proc.wait()
        self._log.close()

    def _signal_group(self, sig) -> None:
        try:
            os.killpg(self.proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass
