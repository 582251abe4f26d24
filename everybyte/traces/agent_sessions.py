"""kv-cache-tester / AgentX session files: one JSON object per recorded agent session.

{id, block_size, hash_id_scope, requests: [{t, type: "n"|"s", in, out, hash_ids, think_time, ...}]}
`hash_ids` has one id per full block of the input (chained); type "s" is a sub-agent request.
"""
from __future__ import annotations

import json
import os

from everybyte.traces.errors import Records, need_ids, need_int, need_num
from everybyte.traces.model import Session, Trace, Turn, assign_agents, link_session


def looks_like(path: str) -> bool:
    if not path.endswith(".json"):
        return False
    with open(path, "rb") as f:
        head = f.read(4096)
    return b'"requests"' in head and b'"hash_ids"' in head


def load_session(path: str, records: Records) -> Session | None:
    try:
        with open(path) as f:
            doc = json.load(f)
    except json.JSONDecodeError as e:
        records.bad(f"{path}:{e.lineno}", f"invalid JSON: {e.msg} (column {e.colno})")
        return None
    if not isinstance(doc, dict) or not isinstance(doc.get("requests"), list):
        records.bad(f"{path}:1", "not a session object with a 'requests' list")
        return None
    block_size = doc.get("block_size", 64)
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        records.bad(f"{path}:1", f"block_size must be a positive integer, got {block_size!r}")
        return None
    turns, is_sub = [], []
    for i, rec in enumerate(doc["requests"]):
        where = f"{path}:1 (requests[{i}])"
        try:
            if not isinstance(rec, dict):
                raise ValueError("not an object")
            kind = rec.get("type", "n")
            if kind not in ("n", "s"):
                raise ValueError(f"'type' must be 'n' or 's', got {kind!r}")
            turn = Turn(index=len(turns), t=need_num(rec, "t"), input_tokens=need_int(rec, "in", 1),
                        output_tokens=need_int(rec, "out"), hash_ids=need_ids(rec, "hash_ids"),
                        gap_s=need_num(rec, "think_time", 0.0), stop=rec.get("stop"),
                        api_time=rec.get("api_time"), ttft=rec.get("ttft"))
            if len(turn.hash_ids) > -(-turn.input_tokens // block_size):
                raise ValueError(f"{len(turn.hash_ids)} hash ids for {turn.input_tokens} input tokens "
                                 f"of {block_size}-token blocks")
        except ValueError as e:
            records.bad(where, str(e))
            continue
        turns.append(turn)
        is_sub.append(kind == "s")
    if not turns:
        records.bad(f"{path}:1", "no usable requests")
        return None
    scope = doc.get("hash_id_scope", "local")
    session = Session(id=str(doc.get("id") or os.path.splitext(os.path.basename(path))[0]), turns=turns,
                      block_size=block_size, hash_scope="global" if scope == "global" else "local",
                      source=path)
    link_session(session)
    assign_agents(session, is_sub)
    return session


def load(paths: list[str], records: Records, name: str) -> Trace:
    sessions = [s for s in (load_session(p, records) for p in paths) if s is not None]
    return Trace(name=name, format="agent_sessions", sessions=sessions, files=list(paths))
