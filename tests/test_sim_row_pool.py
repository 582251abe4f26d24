"""`sim whatif --jobs`: rows in worker processes give the table one process gives, in order; a
worker that dies is a clear error; the default count fits the CPUs, the rows and free memory; a bad
count is refused."""
import json
import os
import time

import pytest

from everybyte.sim import row_pool
from everybyte.sim.cli import main as sim_main
from everybyte.sim.row_pool import default_jobs, run_rows

TRACE = "synthetic:sessions=4,turns=2,system_tokens=4096,first_tokens=4096,append_tokens=2048,output_tokens=16,seed=2"


def _slow_first(scale, i):
    time.sleep(0.3 if i == 0 else 0.0)          # the first row finishes last
    return {"i": i, "pid": os.getpid(), "value": scale * i}


def _started(i):
    started = time.monotonic()
    time.sleep(0.2)
    return {"i": i, "started": started}


def _dies_at_two(i):
    if i == 2:
        os._exit(3)                             # as a worker killed for memory would
    return {"i": i}


def test_rows_keep_their_order_whatever_finishes_first():
    seen = []
    rows = run_rows(_slow_first, (10,), [(i,) for i in range(4)], jobs=2, progress=seen.append)
    assert [r["value"] for r in rows] == [0, 10, 20, 30]
    assert seen[-1]["i"] == 0 and len(seen) == 4            # progress as each is done
    assert os.getpid() not in {r["pid"] for r in rows}      # in worker processes
    assert run_rows(_slow_first, (10,), [(1,)], jobs=1)[0]["pid"] == os.getpid()


def test_the_heaviest_rows_start_first():
    rows = run_rows(_started, (), [(i,) for i in range(3)], jobs=2, weights=[0, 0, 1])
    assert [r["i"] for r in rows] == [0, 1, 2]                    # in the tasks' order
    started = [r["started"] for r in rows]
    # the last row given, the heaviest, is taken first; the third taken waits for a process to be free
    assert started[1] - started[2] > 0.1


def test_a_dead_worker_is_a_clear_error():
    with pytest.raises(RuntimeError, match=r"worker process died.*--jobs 1"):
        run_rows(_dies_at_two, (), [(i,) for i in range(4)], jobs=2)
    with pytest.raises(ValueError, match="at least 1"):
        run_rows(_dies_at_two, (), [(0,)], jobs=0)


def test_whatif_in_two_processes_is_the_table_of_one(tmp_path):
    def table(jobs):
        out = tmp_path / f"jobs{jobs}.json"
        assert sim_main(["whatif", "--hardware", "H200,GB300-NVL72", "--levers", "baseline,nvfp4_weights,ep32",
                         "--sessions-per-gpu", "1", "--max-sessions-per-gpu", "1", "--turns", "2", "--trace", TRACE,
                         "--token-scale", "64", "--jobs", str(jobs), "--json", str(out)]) == 0
        rows = json.loads(out.read_text())["rows"]
        for row in rows:
            for p in row.get("points", []):
                p.pop("wall_s")                 # the only field that is not a simulated figure
        return rows

    one, two = table(1), table(2)
    assert [(r["hardware"], r["lever"]) for r in two] == [(h, lv) for h in ("H200", "GB300-NVL72")
                                                         for lv in ("baseline", "nvfp4_weights", "ep32")]
    assert sum(r["simulated"] for r in one) >= 5 and two == one


@pytest.mark.parametrize("cpus, free, tasks, jobs", [(16, 64 << 30, 48, 16), (16, 64 << 30, 5, 5),
                                                      (16, 10 << 30, 48, 4), (16, 1 << 30, 48, 1),
                                                      (16, None, 48, 16), (2, 64 << 30, 48, 2)])
def test_the_default_count_fits_the_cpus_the_rows_and_free_memory(monkeypatch, cpus, free, tasks, jobs):
    monkeypatch.setattr(row_pool, "usable_cpus", lambda: cpus)
    monkeypatch.setattr(row_pool, "available_memory_bytes", lambda: free)
    assert default_jobs(tasks, 5 << 29) == jobs                     # 2.5 GiB a process


@pytest.mark.parametrize("value", ["0", "-2", "two"])
def test_a_bad_job_count_is_refused(value, capsys):
    with pytest.raises(SystemExit) as e:
        sim_main(["whatif", "--jobs", value])
    assert e.value.code == 2 and "needs a whole number of processes, at least 1" in capsys.readouterr().err
