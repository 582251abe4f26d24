"""Shared fixtures: a real redis-server on a free port (the pod-shared KV tier's store)."""
from __future__ import annotations

import os
import shutil
import subprocess
import time

import pytest
from serve_fixtures import free_port


class RedisServer:
    def __init__(self):
        self.port = free_port()
        self.proc = None

    def start(self):
        self.proc = subprocess.Popen(["redis-server", "--port", str(self.port), "--bind", "127.0.0.1",
                                      "--save", "", "--appendonly", "no"],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        import redis
        r = redis.Redis(port=self.port)
        deadline = time.monotonic() + 120          # a generous bound: a busy machine starts it late
        while time.monotonic() < deadline:
            try:
                r.ping()
                return self
            except redis.exceptions.ConnectionError:
                time.sleep(0.02)
        raise RuntimeError("redis-server did not start")

    def stop(self):
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None

    @property
    def url(self):
        return f"redis://127.0.0.1:{self.port}"


@pytest.fixture
def redis_server():
    if shutil.which("redis-server") is None:
        if os.environ.get("CI"):
            pytest.fail("redis-server is not installed; .ci/run must install it")
        pytest.skip("redis-server not installed (.ci/run installs it)")
    pytest.importorskip("redis", reason="the redis client is a dependency of everybyte (pip install -e .)")
    srv = RedisServer().start()
    yield srv
    srv.stop()
