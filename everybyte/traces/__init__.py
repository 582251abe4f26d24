"""Traces of agent (and other LLM) workloads: import, generate, scale and turn into tokens.

load_trace(PATH) detects the format: a directory of (or one) kv-cache-tester/AgentX session .json
file(s), a Mooncake .jsonl, an Azure LLM inference .csv, or `synthetic[:key=value,...]`.
"""
from __future__ import annotations

import glob
import os

from everybyte.traces import agent_sessions, azure, mooncake
from everybyte.traces.errors import Records, TraceError
from everybyte.traces.model import Session, Trace, Turn
from everybyte.traces.synthetic import SyntheticSpec, generate

FORMATS = ("agent_sessions", "mooncake", "azure", "synthetic")

__all__ = ["FORMATS", "Session", "Trace", "TraceError", "Turn", "detect_format", "load_trace"]


def detect_format(path: str) -> str:
    if path == "synthetic" or path.startswith("synthetic:"):
        return "synthetic"
    if os.path.isdir(path):
        return "agent_sessions"
    if not os.path.isfile(path):
        raise TraceError(f"trace {path!r}: no such file or directory")
    for fmt, mod in (("agent_sessions", agent_sessions), ("mooncake", mooncake), ("azure", azure)):
        if mod.looks_like(path):
            return fmt
    raise TraceError(f"trace {path!r}: cannot tell its format; expected a session .json (kv-cache-tester/"
                     f"AgentX), a Mooncake .jsonl, an Azure .csv or 'synthetic[:k=v,...]' (or pass --trace-format)")


def load_trace(path: str, skip_bad: bool = False, fmt: str | None = None) -> Trace:
    fmt = fmt or detect_format(path)
    if fmt not in FORMATS:
        raise TraceError(f"unknown trace format {fmt!r}; choose from {', '.join(FORMATS)}")
    records = Records(skip_bad)
    if fmt == "synthetic":
        return generate(SyntheticSpec.parse(path.partition(":")[2]))
    name = os.path.basename(os.path.normpath(path))
    if fmt == "agent_sessions":
        files = sorted(glob.glob(os.path.join(path, "*.json"))) if os.path.isdir(path) else [path]
        if not files:
            raise TraceError(f"trace directory {path!r} has no session .json files")
        trace = agent_sessions.load(files, records, name)
    elif fmt == "mooncake":
        trace = mooncake.load(path, records, name)
    else:
        trace = azure.load(path, records, name)
    trace.skipped = records.skipped
    if not trace.sessions:
        raise TraceError(f"trace {path!r} has no usable records" +
                         (f" ({len(records.skipped)} skipped; first: {records.skipped[0]})" if records.skipped else ""))
    return trace
