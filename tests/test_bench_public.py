"""bench uses public interfaces only (DESIGN.md); bench/micro/ may use internals and says so."""
import ast
import importlib
from pathlib import Path

from everybyte import cli

BENCH = Path(__file__).resolve().parents[1] / "everybyte" / "bench"
INTERNALS = ("everybyte.kv", "everybyte.models", "everybyte.formats", "everybyte.native")


def _imports(path: Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
        elif isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
    return out


def test_bench_outside_micro_imports_no_internals():
    bad = {str(p.relative_to(BENCH)): sorted(m for m in _imports(p) if m.startswith(INTERNALS))
           for p in BENCH.rglob("*.py") if "micro" not in p.relative_to(BENCH).parts}
    assert not {k: v for k, v in bad.items() if v}


def test_micro_says_it_uses_internals():
    assert "micro-benchmarks over internals" in importlib.import_module("everybyte.bench.micro").__doc__.lower()


def test_every_benchmark_module_has_main():
    for name, (module, _) in cli.BENCHMARKS.items():
        assert callable(importlib.import_module(module).main), name
