"""Mooncake JSONL: one request a line, {timestamp (ms), input_length, output_length, hash_ids}.

`hash_ids` name 512-token blocks (the last one may be partial), chained and global: equal ids in
different requests are equal content. No session ids: each request is a one-turn session; the
sharing shows only as equal hash ids, which give equal tokens at replay.
"""
from __future__ import annotations

import json

from everybyte.traces.errors import Records, need_ids, need_int, need_num
from everybyte.traces.model import Session, Trace, Turn

BLOCK_SIZE = 512


def looks_like(path: str) -> bool:
    with open(path, "rb") as f:
        head = f.readline(65536)
    return b'"input_length"' in head and b'"hash_ids"' in head


def load(path: str, records: Records, name: str, block_size: int = BLOCK_SIZE) -> Trace:
    sessions = []
    t0 = None
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
                if not isinstance(rec, dict):
                    raise ValueError("not a JSON object")
                ts = need_num(rec, "timestamp") / 1000.0
                turn = Turn(index=0, t=0.0, input_tokens=need_int(rec, "input_length", 1),
                            output_tokens=need_int(rec, "output_length"), hash_ids=need_ids(rec, "hash_ids"))
                if len(turn.hash_ids) > -(-turn.input_tokens // block_size):
                    raise ValueError(f"{len(turn.hash_ids)} hash ids for {turn.input_tokens} input tokens")
            except json.JSONDecodeError as e:
                records.bad(f"{path}:{lineno}", f"invalid JSON: {e.msg}")
                continue
            except ValueError as e:
                records.bad(f"{path}:{lineno}", str(e))
                continue
            t0 = ts if t0 is None else t0
            sessions.append(Session(id=f"mc{lineno}", turns=[turn], block_size=block_size,
                                    hash_scope="global", arrival_s=ts - t0, source=path))
    return Trace(name=name, format="mooncake", sessions=sessions, files=[path], skipped=records.skipped)
