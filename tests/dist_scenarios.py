"""Rank processes for tests/test_dist.py: `python tests/dist_scenarios.py SCENARIO RANK WORLD PORT`
joins a real gloo group on 127.0.0.1, runs one scenario and prints one JSON line with its result."""
from __future__ import annotations

import json
import sys
import time

import torch

from everybyte.dist import ProcessGroup


def collectives(g: ProcessGroup) -> dict:
    r, n = g.rank, g.world_size
    send = [(r + 1) * d for d in range(n)]              # uneven, and zero rows to rank 0
    x = torch.cat([torch.full((c, 3), float(100 * r + d)) for d, c in enumerate(send)])
    recv = g.exchange_counts(send)
    got = g.all_to_all_single(x, recv, send)
    gathered = g.all_gather(torch.tensor([r * 10.0, r + 0.5]))
    header = g.broadcast_object({"op": "forward", "from": r, "ids": list(range(r, r + 3))} if r == 0 else None)
    g.barrier()
    return {"recv": recv, "rows": got[:, 0].tolist(), "gathered": [t.tolist() for t in gathered], "header": header}


def wait_in(g: ProcessGroup, op: str) -> dict:
    """Rank 0 waits in `op` for the others; the test kills the last rank meanwhile."""
    print(json.dumps({"ready": g.rank}), flush=True)
    if g.rank == g.world_size - 1:
        time.sleep(600)
    try:
        if op == "all_to_all":
            g.all_to_all_single(torch.zeros(g.world_size, 4), [1] * g.world_size, [1] * g.world_size)
        else:
            g.broadcast_object(None, src=g.world_size - 1)
    except RuntimeError as e:
        again = ""
        try:
            g.barrier()
        except RuntimeError as e2:
            again = str(e2)
        return {"error": type(e).__name__, "message": str(e), "dead_rank": getattr(e, "rank", None), "again": again}
    return {"error": None}


def stuck_peer(g: ProcessGroup) -> dict:
    if g.rank == 1:
        time.sleep(30)
        return {}
    try:
        g.all_to_all_single(torch.zeros(2, 2), [1, 1], [1, 1])
    except RuntimeError as e:
        return {"error": type(e).__name__, "message": str(e)}
    return {"error": None}


if __name__ == "__main__":
    scenario, rank, world, port = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    group = ProcessGroup(rank, world, port, timeout_s=float(sys.argv[5]) if len(sys.argv) > 5 else 60.0)
    if scenario == "collectives":
        result = collectives(group)
    elif scenario == "stuck":
        result = stuck_peer(group)
    else:
        result = wait_in(group, scenario)
    print(json.dumps({"rank": rank, **result}), flush=True)
