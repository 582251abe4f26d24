"""Expert parallelism for the engine: N ranks, this process rank 0.

Rank 0 is the whole engine (EngineCore, scheduler, KV pool, attention and dense layers, sampling)
and holds 1/N of each MoE layer's experts; ranks 1..N-1 are expert processes (engine/ep_worker)
holding the rest. Each forward on rank 0 first broadcasts a step header; in every MoE layer the
ranks then exchange token rows with all-to-all (models/moe_dispatch), rank 0 sending its tokens
and the expert ranks zero (they have no requests of their own). Only rank 0 has KV, so the KV
memory system (tiers, prefix reuse, transfer) needs no change, and expert FLOPs split N ways.
The executor seen by EngineCore is the ordinary ModelExecutor: nothing in the core changes.
"""
from __future__ import annotations

import atexit
import json
import os
import select
import subprocess
import sys
import time

from everybyte.dist import ProcessGroup, free_port
from everybyte.models.config import ModelConfig
from everybyte.models.expert_moves import move_experts, placement_message
from everybyte.models.expert_placement import ExpertPlacement
from everybyte.models.moe import MoEBlock
from everybyte.models.moe_dispatch import AllToAllDispatcher

TIMEOUT_S = float(os.environ.get("EVERYBYTE_EP_TIMEOUT_S", "60"))     # one collective, any rank


def placements(config: ModelConfig, world: int, rank: int, model: str = "the model") -> dict[int, ExpertPlacement]:
    """This rank's identity placement for each MoE layer; clear errors for a dense model or a
    rank count that does not divide the experts."""
    if not isinstance(world, int) or isinstance(world, bool) or world < 1:
        raise ValueError(f"--expert-parallel must be an int >= 1, got {world!r}")
    if not config.is_moe:
        raise ValueError(f"--expert-parallel {world} needs a mixture-of-experts model; {model} is a dense "
                         f"{config.architecture} model (leave --expert-parallel at 1)")
    e = config.num_experts
    if e % world:
        raise ValueError(f"--expert-parallel {world} does not divide the {e} experts of {model}; use one of "
                         f"{[n for n in range(1, e + 1) if e % n == 0]}")
    return {i: ExpertPlacement.identity(e, world, rank) for i in range(config.num_hidden_layers)
            if config.is_moe_layer(i)}


def moe_blocks(lm) -> dict[int, MoEBlock]:
    return {i: layer.mlp for i, layer in enumerate(lm.model.layers) if isinstance(layer.mlp, MoEBlock)}


def rank_threads(world: int) -> int:
    """CPU threads of one expert rank: the engine's own count when one is set (the cluster
    launcher sizes it per rank), else this machine's cores split over the ranks."""
    pinned = os.environ.get("EVERYBYTE_NUM_THREADS")
    return int(pinned) if pinned else max(1, (os.cpu_count() or 1) // world)


class ExpertParallel:
    """Rank 0's side: starts the expert ranks, joins the group, routes the model's MoE layers
    through the dispatcher, and moves experts on a rebalance (apply_placement)."""

    def __init__(self, group: ProcessGroup, lm, workers: list[subprocess.Popen]):
        self.group, self.lm, self.workers = group, lm, workers
        self.blocks = moe_blocks(lm)
        self.dispatcher = AllToAllDispatcher(group)
        for block in self.blocks.values():
            block.dispatcher = self.dispatcher
        self.in_forward, self.closed = False, False
        self.hooks = [lm.register_forward_pre_hook(self._begin), lm.register_forward_hook(self._end)]
        atexit.register(self.close)

    @staticmethod
    def start_ranks(path: str, world: int, dtype: str, weights_dtype: str, device: str) -> tuple[int, list]:
        """Start ranks 1..world-1 (they load their experts meanwhile); returns (port, processes)."""
        port = free_port()
        env = {**os.environ, "EVERYBYTE_NUM_THREADS": str(rank_threads(world))}
        procs = [subprocess.Popen(
            [sys.executable, "-m", "everybyte.engine.ep_worker", "--model", path, "--rank", str(r),
             "--world", str(world), "--port", str(port), "--dtype", dtype, "--weights-dtype", weights_dtype,
             "--device", device, "--timeout", str(TIMEOUT_S)], stdout=subprocess.PIPE, env=env)
            for r in range(1, world)]
        return port, procs

    @classmethod
    def join(cls, lm, port: int, workers: list[subprocess.Popen], device: str,
             load_timeout_s: float = 600.0) -> ExpertParallel:
        try:
            wait_ready(workers, load_timeout_s)
            group = ProcessGroup(0, len(workers) + 1, port, device=device, timeout_s=TIMEOUT_S)
        except BaseException:
            stop_ranks(workers, 0.0)
            raise
        return cls(group, lm, workers)

    # ---- each forward: the expert ranks follow -----------------------------------------------
    def _begin(self, module, args) -> None:
        if self.group.broken is not None:          # the first failure's error, e.g. which rank died
            raise self.group.broken
        if self.in_forward:
            raise RuntimeError("expert parallelism: a forward failed part-way, so the expert ranks are out of "
                               "step; restart the engine")
        if self.closed:
            raise RuntimeError("expert parallelism: the expert ranks were stopped (engine closed)")
        self.group.broadcast_object(("forward",), timeout_s=TIMEOUT_S)
        self.in_forward = True

    def _end(self, module, args, output) -> None:
        self.in_forward = False

    # ---- rebalancing ------------------------------------------------------------------------
    def apply_placement(self, layer: int, placement: ExpertPlacement) -> int:
        """Move layer `layer`'s experts on every rank to `placement` (its physical_to_logical and
        slots_per_rank; its rank field is ignored). Call between steps on the engine thread
        (serving: `await async_engine.call(lambda e: e.expert_parallel.apply_placement(...))`):
        in-flight requests carry on with the new placement from the next step. Returns the
        number of expert modules rank 0 received."""
        if layer not in self.blocks:
            raise ValueError(f"layer {layer} is not a MoE layer; MoE layers: {sorted(self.blocks)}")
        if self.in_forward:
            raise RuntimeError("apply_placement during a forward; call it between steps")
        block = self.blocks[layer]
        check_placement(block, placement, self.group.world_size)
        p2l, slots = placement_message(placement)
        self.group.broadcast_object(("placement", layer, p2l, slots), timeout_s=TIMEOUT_S)
        return move_experts(self.group, block, p2l, slots)

    def describe(self) -> dict:
        return {"ranks": self.group.world_size, "backend": self.group.backend,
                "experts_per_rank": {i: b.placement.slots_per_rank for i, b in self.blocks.items()},
                "worker_pids": [w.pid for w in self.workers]}

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        try:
            if self.group.broken is None:
                self.group.broadcast_object(("stop",), timeout_s=5)
        except RuntimeError:
            pass                                   # a dead rank: the others stop on their own
        stop_ranks(self.workers)
        for h in self.hooks:
            h.remove()
        self.group.close()


def check_placement(block, placement: ExpertPlacement, world: int) -> None:
    if placement.num_logical != block.num_experts or placement.num_ranks != world:
        raise ValueError(f"layer {block.layer_idx}: placement of {placement.num_logical} experts over "
                         f"{placement.num_ranks} ranks; the model has {block.num_experts} experts on {world} ranks")


def wait_ready(workers: list[subprocess.Popen], timeout_s: float) -> None:
    """Until every expert rank printed its ready line (its experts are loaded); RuntimeError
    naming a rank that exits first or the ones not ready in time."""
    pending = {w.stdout.fileno(): (r + 1, w) for r, w in enumerate(workers) if w.stdout is not None}
    deadline = time.monotonic() + timeout_s
    while pending:
        for fd, (rank, w) in list(pending.items()):
            if w.poll() is not None:
                raise RuntimeError(f"expert rank {rank} exited with code {w.returncode} while loading "
                                   f"(its error is above, on stderr)")
        if time.monotonic() > deadline:
            raise RuntimeError(f"expert ranks {sorted(r for r, _ in pending.values())} not ready after {timeout_s:g} s")
        ready, _, _ = select.select(list(pending), [], [], 0.2)
        for fd in ready:
            rank, w = pending[fd]
            line = w.stdout.readline() if w.stdout else b""
            if line.startswith(b'{"ready"') and json.loads(line)["ready"] == rank:
                del pending[fd]


def stop_ranks(workers: list[subprocess.Popen], timeout_s: float = 10.0) -> None:
    for w in workers:
        try:
            w.wait(timeout_s)
        except subprocess.TimeoutExpired:
            w.kill()
            w.wait()


def load_expert_parallel(model, world: int, dtype: str, weights_dtype: str, device: str):
    """(rank 0's LoadedModel, ExpertParallel) for `world` ranks: validates the model and the rank
    count before any process starts, then loads rank 0's experts while the others load theirs."""
    from everybyte.models.loader import LoadedModel, load_config_and_tokenizer, load_model, resolve_model_path
    if isinstance(model, LoadedModel):
        raise ValueError("expert_parallel > 1 loads the model in every rank: pass its path, not a LoadedModel")
    path = resolve_model_path(model)
    mine = placements(load_config_and_tokenizer(path)[0], world, 0, str(path))
    port, workers = ExpertParallel.start_ranks(str(path), world, dtype, weights_dtype, device)
    try:
        loaded = load_model(path, dtype=dtype, device=device, weights_dtype=weights_dtype, placements=mine)
    except BaseException:
        stop_ranks(workers, 0.0)
        raise
    return loaded, ExpertParallel.join(loaded.model, port, workers, device)
