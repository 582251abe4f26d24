"""Azure LLM inference trace CSV: TIMESTAMP, ContextTokens, GeneratedTokens; no sessions, no reuse.

Each row is a one-turn session with content of its own (no hash ids), arriving at its timestamp.
"""
from __future__ import annotations

import csv
from datetime import datetime

from everybyte.traces.errors import Records, need_int
from everybyte.traces.model import Session, Trace, Turn

COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")


def looks_like(path: str) -> bool:
    with open(path, "r", errors="replace") as f:
        head = f.readline()
    return all(c in head for c in COLUMNS)


def _time(s: str) -> float:
    s = s.strip()
    if "." in s:                               # 7 fractional digits: more than %f takes
        whole, frac = s.split(".", 1)
        s = f"{whole}.{frac[:6]}"
    return datetime.fromisoformat(s).timestamp()


def load(path: str, records: Records, name: str) -> Trace:
    sessions, t0 = [], None
    with open(path, newline="") as f:
        reader = csv.reader(f)
        header = next(reader, None)
        if header is None or any(c not in header for c in COLUMNS):
            records.bad(f"{path}:1", f"header must name {', '.join(COLUMNS)}, got {header!r}")
            return Trace(name=name, format="azure", sessions=[], files=[path], skipped=records.skipped)
        col = {c: header.index(c) for c in COLUMNS}
        for lineno, row in enumerate(reader, 2):
            if not row or not any(x.strip() for x in row):
                continue
            try:
                if len(row) != len(header):
                    raise ValueError(f"{len(row)} fields, the header has {len(header)}")
                ts = _time(row[col["TIMESTAMP"]])
                rec = {"in": int(row[col["ContextTokens"]]), "out": int(row[col["GeneratedTokens"]])}
                turn = Turn(index=0, t=0.0, input_tokens=need_int(rec, "in", 1), output_tokens=need_int(rec, "out"))
            except ValueError as e:
                records.bad(f"{path}:{lineno}", str(e))
                continue
            t0 = ts if t0 is None else t0
            sessions.append(Session(id=f"az{lineno}", turns=[turn], block_size=64, hash_scope="local",
                                    arrival_s=ts - t0, source=path))
    return Trace(name=name, format="azure", sessions=sessions, files=[path], skipped=records.skipped)
