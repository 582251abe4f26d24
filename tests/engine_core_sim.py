"""Drives EngineCore with no torch importable (sys.modules["torch"] = None): a fake executor
whose forward costs virtual time, a simulated KV mover that moves names instead of bytes, and a
name-only host tier. Run as a script by tests/test_engine_core.py; prints a JSON report."""
import json
import sys

sys.modules["torch"] = None                 # any `import torch` below raises ImportError

from everybyte.engine.core import EngineCore, StepResult  # noqa: E402
from everybyte.engine.sampling_params import SamplingParams  # noqa: E402
from everybyte.engine.scheduler import Scheduler  # noqa: E402
from everybyte.engine.sequence import Sequence  # noqa: E402
from everybyte.kv.block_id import KVNamespace  # noqa: E402
from everybyte.kv.block_manager import BlockManager  # noqa: E402
from everybyte.kv.clock import VirtualClock  # noqa: E402
from everybyte.kv.memory_manager import KVMemoryManager  # noqa: E402
from everybyte.kv.mover import LoadJob  # noqa: E402
from everybyte.kv.tier_movement import TierSet  # noqa: E402
from everybyte.kv.tiers.base import TierBackend  # noqa: E402

BLOCK, BYTES_PER_TOKEN = 4, 100


class Geometry:
    num_blocks, block_size, bytes_per_token = 24, BLOCK, BYTES_PER_TOKEN
    bytes_per_block = BLOCK * BYTES_PER_TOKEN
    budget_bytes = nbytes = num_blocks * bytes_per_block


class NameTier(TierBackend):
    """A host tier that holds what the mover stored (names), nothing else."""
    kind = "host"

    def __init__(self):
        super().__init__(1 << 30, "G2")
        self.held: dict[bytes, object] = {}

    def put(self, name, data):
        self.held[name] = data
        return True

    def get(self, name):
        return self.held.get(name)

    def contains(self, name):
        return name in self.held

    def delete(self, name):
        return self.held.pop(name, None) is not None

    @property
    def used_bytes(self):
        return len(self.held) * Geometry.bytes_per_block


class Done:
    def done(self):
        return True


class SimMover:
    """Loads finish when the virtual clock passes bytes / bandwidth; no byte moves."""
    nbytes = Geometry.bytes_per_block

    def __init__(self, tiers: TierSet, clock: VirtualClock, bandwidth: float = 1e6):
        self.tiers, self.clock, self.bandwidth = tiers, clock, bandwidth
        self.jobs: list[LoadJob] = []
        self.inflight: dict = {}
        self.stored = self.loaded = 0
        self.waited = 0.0

    def store(self, block_ids, names, pin_memory=False):
        self.stored += len(names)
        return list(names)

    def start(self, names, blocks, owner=None, prestage=False):
        ready = self.clock.monotonic() + len(names) * self.nbytes / self.bandwidth
        job = LoadJob(list(names), list(blocks), owner, prestage, ready)
        for i, n in enumerate(job.names):
            self.inflight.setdefault(n, (job, i))
        self.jobs.append(job)
        return job

    def in_flight(self, names):
        out = []
        for n in names:
            if n not in self.inflight:
                break
            out.append(self.inflight[n])
        return out

    def finished(self):
        now, out = self.clock.monotonic(), []
        for job in [j for j in self.jobs if j.deadline <= now]:
            for i, name in enumerate(job.names):
                if not any(t.contains(name) for t in self.tiers.tiers):
                    break
                job.loaded.append("G2")
            job.finished, job.future = True, Done()
            self.jobs.remove(job)
            self.loaded += len(job.loaded)
            for n in job.names:
                if self.inflight.get(n, (None,))[0] is job:
                    del self.inflight[n]
            out.append(job)
        return out

    def wait(self, timeout):
        if not self.jobs:
            return False
        dt = max(min(min(j.deadline for j in self.jobs) - self.clock.monotonic(), timeout), 0.0)
        self.clock.advance(dt)
        self.waited += dt
        return True


class FakeExecutor:
    """Each step costs 1 ms + 0.1 ms per token computed; the token sampled is (position % 50) + 1."""
    def __init__(self, clock: VirtualClock):
        self.clock, self.steps, self.released, self.seconds = clock, 0, [], 0.0

    def execute(self, seqs, num_new_tokens):
        cost = 1e-3 + 1e-4 * sum(num_new_tokens)
        self.clock.advance(cost)
        self.steps, self.seconds = self.steps + 1, self.seconds + cost
        rows = [i for i, (s, n) in enumerate(zip(seqs, num_new_tokens)) if s.num_computed_tokens + n == len(s)]
        return StepResult(rows, [len(seqs[i]) % 50 + 1 for i in rows], [None] * len(rows), cost)

    def release(self, request_id):
        self.released.append(request_id)


def main():
    clock = VirtualClock()
    tiers = TierSet([NameTier()])
    mover = SimMover(tiers, clock)
    bm = KVMemoryManager(Geometry(), KVNamespace("sim-model", block_size=BLOCK), tiers, clock=clock, mover=mover)
    ex = FakeExecutor(clock)
    core = EngineCore(Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=32, max_model_len=64, clock=clock),
                      ex, clock, eos_token_ids=[999])
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
        "elapsed": clock.monotonic() - t0, "executor_s": ex.seconds, "load_wait_s": mover.waited,
        "steps": ex.steps, "mover_stored": mover.stored,
        "mover_loaded": mover.loaded, "g1": mem["g1"], "prefill": mem["prefill_tokens"],
        "hit_tokens": mem["prefix_cache"]["hit_tokens"], "prestaged": mem["blocks"]["prestaged"],
        "free_blocks": bm.num_free_blocks, "used_blocks": bm.num_used_blocks,
    }, default=str))


if __name__ == "__main__":
    main()
