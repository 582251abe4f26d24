"""Starts a real `everybyte serve` process on 127.0.0.1 for the HTTP tests."""
from __future__ import annotations

import signal
import socket
import subprocess
import sys
import threading
import time

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, *args: str, timeout: float = 180.0, command: str = "serve"):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "everybyte.cli", command, "--port", str(self.port),
               "--log-level", "warning", *args]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.proc.stdout.read()}")
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                time.sleep(0.3)
        self.stop()
        raise RuntimeError("server did not become healthy in time")

    def metric(self, name: str) -> float:
        text = httpx.get(self.url + "/metrics").text
        for line in text.splitlines():
            if line.startswith(name + " ") or line.startswith(name + "{"):
                return float(line.rsplit(" ", 1)[1])
        raise KeyError(name)

    def stop(self, sig=signal.SIGTERM, timeout: float = 60.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def start_servers(*arg_lists: tuple[str, ...] | list[str]) -> list[Server]:
    """Boot `everybyte serve` processes side by side (each loads the model: about 5 s apiece one
    after another on 2 cores, under 4 s apiece together); all or none: a failure stops the others."""
    out: list = [None] * len(arg_lists)

    def boot(i: int) -> None:
        try:
            out[i] = Server(*arg_lists[i])
        except Exception as e:              # raised below, in the caller's thread
            out[i] = e
    threads = [threading.Thread(target=boot, args=(i,)) for i in range(len(arg_lists))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    errors = [s for s in out if isinstance(s, Exception)]
    if errors:
        for s in out:
            if isinstance(s, Server):
                s.stop()
        raise errors[0]
    return out
