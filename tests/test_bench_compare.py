"""`everybyte bench compare` without any peer installed: the missing-peer error and the table/JSON
assembly from two fake agentic results."""
from __future__ import annotations

import importlib.util
import json
import os
import sys
import time
from pathlib import Path

import pytest

from everybyte import cli
from everybyte.bench import compare


def _fake_result(out_tok_s: float, ttft: float, prompt_mode: str, short: int = 0) -> dict:
    turns = [{"ok": True, "warmup": False, "completion_tokens": 8 - (1 if i < short else 0), "max_tokens": 8}
             for i in range(4)]
    summary = {"output_tok_s": out_tok_s, "total_tok_s": out_tok_s * 10, "goodput_tok_s": out_tok_s / 2,
               "ttft_p50_s": ttft, "ttft_p90_s": ttft * 2, "ttft_p99_s": None, "tpot_p50_s": 0.05,
               "tok_s_per_user_p50": 20.0, "prefix_hit_rate": 0.5, "errors": 0, "turns_ok": 4}
    return {"summary": summary, "turns": turns,
            "assumptions": {"tokens": {"prompt_mode": prompt_mode, "output_join": "server_ids"},
                            "target": {"target": "http://x"}}}


def test_missing_llamacpp_is_a_clear_error(monkeypatch, capsys):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "llama_cpp" else real(name, *a))
    rc = cli.main(["bench", "compare", "--peers", "llamacpp"])
    err = capsys.readouterr().err
    assert rc == 2
    assert "llama_cpp" in err and 'pip install "llama-cpp-python[server]"' in err


def test_missing_peer_module_and_unknown_peer(tmp_path, monkeypatch, capsys):
    (tmp_path / "fakepeer.py").write_text(
        "NAME = 'fake'\nINSTALL = 'pip install fake-peer'\nINSTALL_NOTE = 'once'\n"
        "def missing():\n    return ['surely_not_installed_xyz']\n")
    monkeypatch.setattr(compare, "PEERS_DIR", tmp_path)
    assert compare.main(["--peers", "fakepeer"]) == 2
    err = capsys.readouterr().err
    assert "surely_not_installed_xyz" in err and "pip install fake-peer" in err
    assert compare.main(["--peers", "nosuchpeer"]) == 2
    assert "unknown peer 'nosuchpeer'" in capsys.readouterr().err


def test_table_and_json_from_two_summaries():
    servers = {"everybyte": compare.server_entry(_fake_result(40.0, 0.5, "ids")),
               "llama.cpp": compare.server_entry(_fake_result(20.0, 1.0, "text", short=2))}
    result = compare.assemble(servers, {"model": "m.gguf"})
    json.dumps(result)                                   # one JSON object
    assert set(result) >= {"servers", "ratios", "assumptions"}
    r = result["ratios"]["llama.cpp"]
    assert r["output_tok_s"] == pytest.approx(2.0) and r["ttft_p50_s"] == pytest.approx(0.5)
    assert "ttft_p99_s" not in r                         # None on both sides: no ratio
    assert servers["everybyte"]["prompt_mode"] == "ids" and servers["llama.cpp"]["prompt_mode"] == "text"
    assert servers["everybyte"]["output_length_match"] == 1.0
    assert servers["llama.cpp"]["output_length_match"] == 0.5
    md = compare.table(servers, {k: v for k, v in result["ratios"].items() if k != "rule"})
    head = md.splitlines()[0]
    assert "everybyte" in head and "llama.cpp" in head and "everybyte / llama.cpp" in head
    row = next(line for line in md.splitlines() if line.startswith("| output tok/s"))
    assert row.split("|")[2:5] == [" 40 ", " 20 ", " 2 "]
    assert "prompts as text" in md


def test_a_failed_server_is_reported_not_dropped():
    servers = {"everybyte": compare.server_entry(_fake_result(40.0, 0.5, "ids")),
               "llama.cpp": {"error": "llama.cpp server exited with code 1", "summary": {}}}
    result = compare.assemble(servers, {})
    assert result["ratios"]["llama.cpp"] == {}
    md = compare.table(servers, {"llama.cpp": {}})
    assert "ERROR llama.cpp server exited" in md


def _running(pid: int) -> bool:
    """Alive and not a zombie waiting for init to reap it."""
    try:
        return "State:\tZ" not in Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False


def test_stopping_a_server_stops_its_subprocesses(tmp_path):
    """vLLM's API server runs its engine in child processes: stop() ends the whole process group."""
    pidfile = tmp_path / "child.pid"
    srv = compare.ServerProcess("sh", ["sh", "-c", f"sleep 300 & echo $! > {pidfile}; wait"], 1,
                                str(tmp_path / "sh.log"))
    for _ in range(200):
        if pidfile.is_file() and pidfile.read_text().strip():
            break
        time.sleep(0.02)
    child = int(pidfile.read_text())
    srv.stop(timeout_s=5)
    for _ in range(100):
        if not _running(child):
            break
        time.sleep(0.05)
    else:
        pytest.fail(f"child {child} of the stopped server is still running")
