"""An expert rank (1..N-1) of expert parallelism: `python -m everybyte.engine.ep_worker --model PATH
--rank R --world N --port P ...`, started by engine/ep on rank 0. Loads its experts, prints
{"ready": R} on stdout, joins the group and follows rank 0's step headers until told to stop:
a forward (each MoE layer's all-to-all with zero tokens of its own: it runs the experts the
others send it) or a placement (a rebalance moving experts). A dead peer or a timeout ends it
with the group's error on stderr and exit code 1."""
from __future__ import annotations

import argparse
import gc
import json
import sys

import torch

from everybyte.dist import ProcessGroup
from everybyte.engine.config import set_threads
from everybyte.engine.ep import moe_blocks, placements
from everybyte.models.expert_moves import move_experts
from everybyte.models.loader import load_config_and_tokenizer, load_model, resolve_model_path
from everybyte.models.moe_dispatch import AllToAllDispatcher


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m everybyte.engine.ep_worker")
    p.add_argument("--model", required=True)
    for name in ("--rank", "--world", "--port"):
        p.add_argument(name, type=int, required=True)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--weights-dtype", default="auto")
    p.add_argument("--device", default="cpu")
    p.add_argument("--timeout", type=float, default=60.0)
    return p.parse_args(argv)


def serve(group: ProcessGroup, blocks: dict, hidden_size: int, dtype: torch.dtype) -> int:
    """Follow rank 0's headers; returns the number of forwards taken part in."""
    dispatcher = AllToAllDispatcher(group)
    device = group.device
    forwards = 0
    while True:
        header = group.broadcast_object(None, src=0)
        if header[0] == "stop":
            return forwards
        if header[0] == "placement":
            _, layer, p2l, slots = header
            move_experts(group, blocks[layer], p2l, slots)
            continue
        forwards += 1
        for block in blocks.values():
            k = block.top_k
            dispatcher.forward(block, torch.empty(0, hidden_size, dtype=dtype, device=device),
                               torch.empty(0, k, dtype=torch.long, device=device),
                               torch.empty(0, k, dtype=torch.float32, device=device))


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    set_threads()
    path = resolve_model_path(args.model)
    config = load_config_and_tokenizer(path)[0]
    loaded = load_model(path, dtype=args.dtype, device=args.device, weights_dtype=args.weights_dtype,
                        placements=placements(config, args.world, args.rank, str(path)))
    # only the MoE blocks stay: attention, dense MLPs, embedding and head run on rank 0 alone
    blocks, dtype = moe_blocks(loaded.model), loaded.model.dtype
    del loaded
    gc.collect()
    print(json.dumps({"ready": args.rank}), flush=True)
    group = ProcessGroup(args.rank, args.world, args.port, device=args.device, timeout_s=args.timeout)
    try:
        with torch.inference_mode():
            serve(group, blocks, config.hidden_size, dtype)
    except RuntimeError as e:
        print(f"everybyte expert rank {args.rank}: {e}", file=sys.stderr)
        return 1
    finally:
        group.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
