"""The control plane compiled with mypyc (native/compiled) makes exactly the simulator's decisions
of the Python modules: `bench sim-speed --compiled` runs both, each in its own process, on
configurations that reach different paths (multi-step decode and single steps, the KV-aware
router with a host and a pod tier, disaggregated prefill). The build (about a minute, once per
source change, in the kernel cache) is what users get; .ci/run starts it before the tests."""
import json
import subprocess
import sys

import pytest

from everybyte.native import compiled

CONFIGS = {
    "multi-step": ["--workers", "4"],
    "single steps": ["--workers", "4", "--", "--no-multi-step"],
    "kv router, tiers": ["--workers", "4", "--", "--route", "kv", "--host-tier", "8MiB", "--pod-flash", "64MiB"],
    "disaggregated": ["--workers", "4", "--", "--prefill", "2", "--decode", "2", "--disagg-threshold", "256"],
}


@pytest.fixture(scope="module")
def built():
    pytest.importorskip("mypyc", reason="mypyc comes with mypy (pip install -e '.[compiled]' or '.[test]')")
    return compiled.build()


def side_by_side(args: list[str]) -> dict:
    done = subprocess.run([sys.executable, "-m", "everybyte.cli", "bench", "sim-speed", "--compiled",
                           "--sessions", "60", *args], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)


@pytest.mark.parametrize("name", CONFIGS)
def test_compiled_makes_the_same_decisions(built, name):
    out = side_by_side(CONFIGS[name])
    assert out["same_decisions"], out
    assert out["decisions"]["requests"] > 60 and out["decisions"]["steps"] > out["decisions"]["requests"]
    assert out["compiled"]["cpu_s"] > 0 and out["python"]["cpu_s"] > 0


def test_the_compiled_modules_are_the_ones_imported(built):
    code = ("from everybyte.native import compiled; root = compiled.activate(); "
            "import everybyte.engine.scheduler as s, everybyte.sim.runner as r, everybyte.sim.metrics as b; "
            "print(s.__file__); print(r.__file__); print(b.__file__); print(root)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    sched, runner, other, root = done.stdout.split()
    assert root == str(built) and sched.startswith(root) and sched.endswith(".so") and runner.endswith(".so")
    assert other.endswith("metrics.py")              # not listed: stays Python


def test_activate_after_import_is_refused():
    import everybyte.engine.scheduler  # noqa: F401 - imported as Python
    with pytest.raises(RuntimeError, match="before importing .*everybyte.engine.scheduler"):
        compiled.activate()


def test_a_changed_source_is_a_different_build(tmp_path, monkeypatch):
    before = compiled.build_dir()
    for m in compiled.MODULES:
        src = compiled._source(m)
        dest = tmp_path / src.relative_to(compiled.PACKAGE.parent)
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.write_bytes(src.read_bytes())
    (tmp_path / "everybyte/kv/clock.py").write_text(compiled._source("everybyte.kv.clock").read_text() + "\n# edited\n")
    monkeypatch.setattr(compiled, "PACKAGE", tmp_path / "everybyte")
    assert compiled.build_dir() != before
