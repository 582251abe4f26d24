"""Drives EngineCore with no torch importable (sys.modules["torch"] = None) through the simulator's
parts (everybyte.sim): an executor whose forward costs virtual time, the simulated KV mover that
moves names instead of bytes, and a name-only host tier. Run as a script by
tests/test_engine_core.py; prints a JSON report."""
import json
import sys

sys.modules["torch"] = None                 # any `import torch` below raises ImportError

from everybyte.engine.core import EngineCore  # noqa: E402
from everybyte.engine.sampling_params import SamplingParams  # noqa: E402
from everybyte.engine.scheduler import Scheduler  # noqa: E402
from everybyte.engine.sequence import Sequence  # noqa: E402
from everybyte.kv.block_manager import BlockManager  # noqa: E402
from everybyte.sim.executor import CostExecutor  # noqa: E402
from everybyte.sim.worker import SimPool, SimWorker, WorkerSpec  # noqa: E402

BLOCK, BYTES_PER_TOKEN = 4, 100


def main():
    # each step costs 1 ms + 0.1 ms per token computed; the token sampled is (position % 50) + 1;
    # a tier load costs bytes / 1 MB/s
    spec = WorkerSpec(SimPool(24, BLOCK, BYTES_PER_TOKEN), model_id="sim-model", kv_format="fp16",
                      host_tier_bytes=1 << 30, max_num_seqs=4, max_num_batched_tokens=32, max_model_len=64)
    w = SimWorker(0, spec, lambda clock: CostExecutor(clock, lambda seqs, n: 1e-3 + 1e-4 * sum(n),
                                                      token=lambda pos: pos % 50 + 1, record_releases=True),
                  lambda level, nbytes: nbytes / 1e6, eos=[999])
    clock, mover, bm, ex, core = w.clock, w.mover, w.memory, w.executor, w.core
    t0 = clock.monotonic()
    prompt = list(range(100, 120))                  # 20 tokens: 5 blocks
    p = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)

    def seq(rid, ids, sid=None):
        s = Sequence(list(ids), p, rid, None, arrival_time=clock.time())
        s.session_id = sid
        return s

    out1 = core.run_to_completion([core.add(seq("turn1", prompt, "agent"))])[0]
    core.park("agent", expected_gap_s=30.0)
    parked = core.session_info("agent")
    core.reset_prefix_cache()                       # G1 is needed elsewhere: the session's blocks leave it
    loading = core.resume("agent")
    turn2 = prompt + out1.token_ids + [7, 8, 9, 10]
    out2 = core.run_to_completion([core.add(seq("turn2", turn2, "agent"))])[0]
    a = core.add(seq("aborted", list(range(300, 330))))
    rejected = []                                   # core.add runs the engine-side request checks itself
    small = EngineCore(Scheduler(BlockManager(2, BLOCK), max_model_len=64, clock=clock), ex, clock)
    for target, bad in ((core, seq("aborted", [1, 2, 3])), (small, seq("huge", prompt))):
        try:
            target.add(bad)
        except ValueError as e:
            rejected.append(str(e))
    core.step()
    aborted = core.abort(a)
    others = core.run_to_completion([core.add(seq(f"r{i}", list(range(200 + i, 230 + i)))) for i in range(3)])
    mem = core.stats()["memory"]
    print(json.dumps({
        "torch_loaded": sys.modules.get("torch") is not None,
        "turn1": out1.token_ids, "turn2_cached": out2.num_cached_tokens, "turn2_finish": out2.finish_reason,
        "parked_blocks": parked["blocks"], "resume_loading": loading,
        "aborted_finish": aborted.finish_reason if aborted else None,
        "others_finish": [o.finish_reason for o in others], "others_len": [len(o.token_ids) for o in others],
        "released": ex.released, "requests_left": len(core.requests), "rejected": rejected,
        "elapsed": clock.monotonic() - t0, "executor_s": ex.busy_s, "load_wait_s": mover.waited,
        "steps": ex.steps, "mover_stored": mover.stored,
        "mover_loaded": mover.loaded, "g1": mem["g1"], "prefill": mem["prefill_tokens"],
        "hit_tokens": mem["prefix_cache"]["hit_tokens"], "prestaged": mem["blocks"]["prestaged"],
        "free_blocks": bm.num_free_blocks, "used_blocks": bm.num_used_blocks,
    }, default=str))


if __name__ == "__main__":
    main()
