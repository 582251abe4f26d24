"""EngineCore is the control plane the real engine, the server, a cluster worker and the
simulator share: it must run with torch unimportable, on a fake executor and a virtual clock."""
import json
import subprocess
import sys
from pathlib import Path

import pytest


@pytest.fixture(scope="module")
def report():
    script = Path(__file__).with_name("engine_core_sim.py")
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_control_plane_imports_no_torch(report):
    assert report["torch_loaded"] is False


def test_requests_finish_and_leave_the_executor(report):
    assert report["turn1"] == [21, 22, 23, 24, 25, 26]          # the fake executor's tokens, in order
    assert report["turn2_finish"] == "length"
    assert report["others_finish"] == ["length"] * 3 and report["others_len"] == [6] * 3
    assert report["aborted_finish"] == "abort"
    assert report["released"] == ["turn1", "turn2", "aborted", "r0", "r1", "r2"]
    assert report["requests_left"] == 0


def test_add_rejects_a_used_id_and_a_request_the_pool_cannot_hold(report):
    used, huge = report["rejected"]
    assert "request_id 'aborted' is already in use" in used
    assert "more than the whole pool" in huge


def test_park_resume_moves_the_session_through_the_mover(report):
    assert report["parked_blocks"]["G2"] == 6 and report["parked_blocks"]["G1"] == 0
    assert report["resume_loading"] == 6 and report["prestaged"] == 6
    assert report["turn2_cached"] == 24                             # the 6 prestaged blocks, reused
    assert report["mover_loaded"] >= 6 and report["mover_stored"] >= 6
    assert report["hit_tokens"] >= 24


def test_ledger_balances_and_blocks_come_back(report):
    g1 = report["g1"]
    assert g1["total"] == 24 * 4 * 100
    assert sum(v for k, v in g1.items() if k != "total") == g1["total"]
    assert g1["running_kv"] == 0 and g1["parked_kv"] == 0
    assert report["free_blocks"] == 24 and report["used_blocks"] == 0
    assert report["prefill"]["computed"] + report["prefill"]["reused_total"] > 0


def test_time_advances_only_by_what_the_executor_and_mover_say(report):
    assert report["elapsed"] == pytest.approx(report["executor_s"] + report["load_wait_s"], abs=1e-9)
    assert report["steps"] > 0 and report["load_wait_s"] > 0
