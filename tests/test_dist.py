"""dist/: real rank processes in a real gloo group on 127.0.0.1 (tests/dist_scenarios.py)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from everybyte.dist import ProcessGroup, free_port

SCRIPT = str(Path(__file__).with_name("dist_scenarios.py"))


def start(scenario: str, world: int, *extra: str) -> list[subprocess.Popen]:
    port = str(free_port())
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return [subprocess.Popen([sys.executable, SCRIPT, scenario, str(r), str(world), port, *extra],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
            for r in range(world)]


def last_json(proc: subprocess.Popen, timeout: float) -> dict:
    out, err = proc.communicate(timeout=timeout)
    lines = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    assert lines and "rank" in lines[-1], f"no result (rc {proc.returncode}): {err[-2000:]}"
    return lines[-1]


def wait_ready(proc: subprocess.Popen, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    assert proc.stdout is not None
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if line.startswith('{"ready"'):
            return
        assert line, f"rank exited before it was ready: {proc.stderr.read()[-2000:] if proc.stderr else ''}"
    raise AssertionError("rank not ready")


def test_collectives_uneven_all_to_all_gather_broadcast():
    world = 3
    res = sorted((last_json(p, 120) for p in start("collectives", world)), key=lambda r: r["rank"])
    for r, out in enumerate(res):
        assert out["recv"] == [(s + 1) * r for s in range(world)]        # rank s sent (s+1)*r rows here
        assert out["rows"] == [float(100 * s + r) for s in range(world) for _ in range((s + 1) * r)]
        assert out["gathered"] == [[s * 10.0, s + 0.5] for s in range(world)]
        assert out["header"] == {"op": "forward", "from": 0, "ids": [0, 1, 2]}


@pytest.mark.parametrize("op", ["all_to_all", "broadcast"])
def test_killed_rank_is_named_by_the_others_without_hanging(op):
    world = 3
    procs = start(op, world)
    for p in procs:
        wait_ready(p)
    victim = procs[-1]
    time.sleep(0.5)
    t0 = time.monotonic()
    victim.send_signal(signal.SIGKILL)
    results = [last_json(p, 30) for p in procs[:-1]]       # far below the 60 s collective timeout
    assert time.monotonic() - t0 < 30
    victim.wait()
    for out in results:
        assert out["error"] == "RankDiedError", out
        assert out["dead_rank"] == world - 1
        assert f"rank {world - 1} (pid {victim.pid}) died" in out["message"]
        assert out["again"] == out["message"]          # a broken group fails at once, never waits


def test_stuck_peer_times_out_with_a_clear_error():
    procs = start("stuck", 2, "2")
    out = last_json(procs[0], 60)
    procs[1].kill()
    procs[1].wait()
    assert out["error"] == "CollectiveTimeoutError", out
    assert "timed out after 2 s" in out["message"] and "rank 0" in out["message"]


def test_bad_rank_and_timeout():
    with pytest.raises(ValueError, match="rank 2 is outside a group of world_size 2"):
        ProcessGroup(2, 2, free_port())
    with pytest.raises(ValueError, match="timeout_s must be > 0"):
        ProcessGroup(0, 1, free_port(), timeout_s=0)
