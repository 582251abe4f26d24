"""`everybyte bench sim-speed` on a small trace: its JSON, and the same simulated run (requests,
steps, events, simulated seconds) with the compiled prefix cache and the Python reference."""
import json

import pytest

from everybyte.bench import sim_speed
from everybyte.kv.prefix_core import native_prefix_cache_class


def run(tmp_path, monkeypatch, native: str) -> dict:
    monkeypatch.setenv("EVERYBYTE_NATIVE_KV", native)
    out = tmp_path / f"speed{native}.json"
    assert sim_speed.main(["--sessions", "40", "--workers", "2", "--json", str(out)]) == 0
    return json.loads(out.read_text())


def test_sim_speed_same_run_both_caches(tmp_path, monkeypatch):
    if native_prefix_cache_class() is None:
        pytest.skip("the compiled prefix cache does not build here")
    py, c = run(tmp_path, monkeypatch, "0"), run(tmp_path, monkeypatch, "1")
    assert py["prefix_cache"] == "PrefixCache" and c["prefix_cache"] == "NativePrefixCache"
    assert py["requests"] > 40 and py["goal"] == 20_000 and c["sim_requests_per_wall_s"] > 0
    for key in ("requests", "steps", "events", "simulated_seconds"):
        assert py[key] == c[key], key


def test_sim_speed_names_its_interpreter(tmp_path, monkeypatch):
    import os
    import sys
    if not os.path.exists("/proc/self/maps"):
        pytest.skip("no /proc: the field is None here")
    it = run(tmp_path, monkeypatch, "1")["interpreter"]
    assert it["version"] == sys.version.split()[0] and it["executable"] == sys.executable
    with open("/proc/self/maps") as f:                  # this process: the same interpreter
        assert it["libpython_shared"] == any("libpython" in line for line in f)


def test_sim_speed_bad_flag(capsys):
    with pytest.raises(SystemExit) as e:
        sim_speed.main(["--sessions", "4", "--", "--kv-format", "nope"])
    assert e.value.code == 2 and "invalid choice: 'nope'" in capsys.readouterr().err


def test_sim_speed_arrival_spacing_loads_the_workers(tmp_path, monkeypatch, capsys):
    """--arrival-s: denser session starts keep the workers busier (the field says how loaded the
    measured run was); a spacing that is not positive is refused."""
    def busy(spacing: str) -> dict:
        out = tmp_path / f"busy{spacing}.json"
        assert sim_speed.main(["--sessions", "40", "--workers", "2", "--arrival-s", spacing, "--json", str(out)]) == 0
        return json.loads(out.read_text())
    sparse, dense = busy("0.5"), busy("0.0001")
    assert "arrival_s=0.0001," in dense["trace"]
    assert 0 < sparse["worker_busy_fraction"] < dense["worker_busy_fraction"] <= 1
    with pytest.raises(SystemExit) as e:
        sim_speed.main(["--arrival-s", "0"])
    assert e.value.code == 2 and "--arrival-s must be > 0" in capsys.readouterr().err
