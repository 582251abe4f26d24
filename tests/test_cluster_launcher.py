"""`everybyte cluster` (cluster/launcher): real worker processes, locally and as Ray actors on a
local Ray head; they come up healthy on free ports with their threads split, describe themselves
on /v1/kv/info, a worker that dies is reported, and SIGTERM stops them all. The router half is
tested with the router (`--no-router` here)."""
from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

import httpx
import pytest
from serve_fixtures import free_port

from everybyte.cluster.launcher import plan_workers

SMALL = ["--kv-cache", "16MiB", "--max-num-seqs", "4", "--max-model-len", "256", "--kv-tiers", "none",
         "--log-level", "warning"]


def test_plan_workers():
    specs = plan_workers(None, 1, 2, ["--kv-cache", "16MiB"], cores=7)
    assert [s.role for s in specs] == ["prefill", "decode", "decode"] and {s.threads for s in specs} == {2}
    assert [s.role for s in plan_workers(4, None, None, [], cores=2)] == ["both"] * 4
    assert {s.threads for s in plan_workers(4, None, None, [], cores=2)} == {1}
    argv = specs[0].argv("127.0.0.1", 1, 2, 3)
    assert argv[argv.index("--role") + 1] == "prefill" and argv[-2:] == ["--kv-cache", "16MiB"]
    assert specs[0].env({})["OMP_NUM_THREADS"] == specs[0].env({})["EVERYBYTE_NUM_THREADS"] == "2"
    for bad, match in [((3, 1, 1, []), "differs"), ((None, 1, None, []), "both"),
                       ((0, None, None, []), ">= 1"), ((2, None, None, ["--port", "9"]), "--port")]:
        with pytest.raises(ValueError, match=match):
            plan_workers(*bad)


class Launcher:
    def __init__(self, *args: str, router: bool = False):
        cmd = [sys.executable, "-m", "everybyte.cli", "cluster", "--log-level", "warning", *args,
               *([] if router else ["--no-router"])]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)

    def next_event(self) -> dict:
        while True:
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError(f"launcher exited ({self.proc.wait()}) before its next event")
            if line.startswith("{"):
                return json.loads(line)

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(120)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()


def _check_workers(ready: dict, roles: list[str]) -> list[dict]:
    assert ready["event"] == "ready"
    infos = []
    for w in ready["workers"]:
        info = httpx.get(w["url"] + "/v1/kv/info", timeout=5).json()
        assert info["kv_events"] == w["kv_events"] and info["kv_events"]["endpoint"].startswith("tcp://127.0.0.1:")
        infos.append(info)
    assert [i["role"] for i in infos] == roles
    assert len({w["url"] for w in ready["workers"]}) == len(roles)
    assert len({i["namespace_digest"] for i in infos}) == 1          # same model and format: one namespace
    return infos


def test_local_cluster_workers_roles_threads_death_and_stop():
    launcher = Launcher("--prefill", "1", "--decode", "1", *SMALL)
    try:
        ready = launcher.next_event()
        _check_workers(ready, ["prefill", "decode"])
        assert ready["router"] is None
        threads = str(max(1, (os.cpu_count() or 1) // 2))
        for w in ready["workers"]:
            with open(f"/proc/{w['pid']}/environ", "rb") as f:
                env = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
            assert env[b"OMP_NUM_THREADS"] == threads.encode() and w["threads"] == int(threads)
        r = httpx.post(ready["workers"][1]["url"] + "/v1/completions",
                       json={"prompt": "Hello", "max_tokens": 2}, timeout=60)
        assert r.status_code == 200
        dead = ready["workers"][0]
        os.kill(dead["pid"], signal.SIGKILL)
        exited = launcher.next_event()
        assert exited == {"event": "worker_exited", "index": 0, "url": dead["url"], "returncode": -9}
        assert launcher.stop() == 0
        assert launcher.next_event()["event"] == "stopped"
        with pytest.raises(ProcessLookupError):
            os.kill(ready["workers"][1]["pid"], 0)                       # stopped and reaped
    finally:
        launcher.stop()


def test_bad_arguments_are_refused():
    for args, msg in [(["--workers", "2", "--prefill", "1", "--decode", "2"], "differs"),
                      (["--workers", "2", "--port", "1", "--role", "x"], "--role"),
                      (["--launcher", "ray"], "--address")]:
        p = subprocess.run([sys.executable, "-m", "everybyte.cli", "cluster", *args], capture_output=True,
                           text=True, timeout=60)
        assert p.returncode == 2 and msg in p.stderr, p.stderr


@pytest.fixture
def ray_head():
    """A local Ray head of our own: `ray start --head --block` in the foreground, stopped by
    signalling that one process (it takes its own Ray processes down; others' stay)."""
    pytest.importorskip("ray", reason="ray is not installed (pip install everybyte[cluster])")
    ray_bin = shutil.which("ray") or os.path.join(os.path.dirname(sys.executable), "ray")
    port, temp = free_port(), tempfile.mkdtemp(prefix="ray", dir="/tmp")   # short: unix socket paths
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
    head = subprocess.Popen([ray_bin, "start", "--head", "--block", "--node-ip-address", "127.0.0.1",
                             "--include-dashboard=false", "--port", str(port), "--num-cpus", "2",
                             "--disable-usage-stats", f"--temp-dir={temp}"], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and head.poll() is None:
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", port)) == 0:
                    break
            time.sleep(0.5)
        assert head.poll() is None, "ray start --head exited"
        yield f"127.0.0.1:{port}"
    finally:
        head.send_signal(signal.SIGTERM)
        try:
            head.wait(120)
        except subprocess.TimeoutExpired:
            head.kill()
            head.wait()
        shutil.rmtree(temp, ignore_errors=True)


def test_ray_launcher_places_workers_as_actors(ray_head):
    launcher = Launcher("--workers", "2", "--launcher", "ray", "--address", ray_head,
                        "--worker-host", "127.0.0.1", *SMALL)   # one machine: stay on loopback
    try:
        ready = launcher.next_event()
        _check_workers(ready, ["both", "both"])
        assert launcher.stop() == 0
        assert launcher.next_event()["event"] == "stopped"
        for w in ready["workers"]:
            with pytest.raises(httpx.HTTPError):
                httpx.get(w["url"] + "/health", timeout=2)
    finally:
        launcher.stop()


def test_cluster_with_its_router():
    port = free_port()
    launcher = Launcher("--workers", "2", "--port", str(port), *SMALL, router=True)
    try:
        ready = launcher.next_event()                 # after the router answers /health
        assert ready["router"] == f"http://127.0.0.1:{port}"
        _check_workers(ready, ["both", "both"])
        r = httpx.post(ready["router"] + "/v1/completions", json={"prompt": "Hello", "max_tokens": 2}, timeout=60)
        assert r.status_code == 200 and r.json()["choices"]
        assert launcher.stop() == 0
        assert launcher.next_event()["event"] == "stopped"
    finally:
        launcher.stop()
