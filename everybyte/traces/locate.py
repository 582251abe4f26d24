"""Where the shared agent-session traces are on this machine."""
from __future__ import annotations

import os
from pathlib import Path


def default_trace() -> str:
    """The shared agent sessions next to the repository (../shared/data/traces), else synthetic."""
    env = os.environ.get("EVERYBYTE_TRACES")
    roots = [Path(env)] if env else []
    roots += [Path(__file__).resolve().parents[2].parent / "shared", Path.cwd().parent / "shared", Path.cwd() / "shared"]
    for root in roots:
        for cand in (root / "data/traces/agent_sessions", root / "agent_sessions", root):
            if cand.is_dir() and any(cand.glob("*.json")):
                return str(cand)
    return "synthetic"
