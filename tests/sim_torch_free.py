"""`everybyte sim run` with torch unimportable (sys.modules["torch"] = None): the simulator is the
control plane + a cost model, no tensor anywhere. Run by tests/test_sim.py; prints the run's JSON."""
import sys

sys.modules["torch"] = None

from everybyte.sim.cli import main  # noqa: E402

if __name__ == "__main__":
    rc = main(["run", *sys.argv[1:]])
    print(f"torch_loaded={sys.modules.get('torch') is not None}", file=sys.stderr)
    sys.exit(rc)
