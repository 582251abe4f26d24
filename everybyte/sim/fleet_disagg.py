"""Disaggregated prefill/decode in the simulator, as the cluster router does it (cluster/disagg,
engine/kv_transfer): a turn whose uncached prefill exceeds the threshold (`disagg_wanted`, the
router's rule) first runs on a prefill worker as its prompt with max_tokens=1; when that
finishes, the names of the prompt's full blocks it holds in G1 become loadable on the decode
worker the router then picks (the real `RemoteBlocks` tier, `expect(TransferParams)`), and the
turn goes there: the decode worker loads those blocks like any tier's, at the `remote` link's
cost (sim/fleet_links: NVLink in one domain, else the network), and computes only what is
missing (the prompt's last partial block). No byte moves; the names are the transfer."""
from __future__ import annotations

from typing import Any

from everybyte.cluster.decide import disagg_wanted
from everybyte.engine.sampling_params import SamplingParams
from everybyte.engine.sequence import Sequence
from everybyte.kv.block_id import chain_block_ids
from everybyte.kv.connector import RemoteBlocks, TransferParams, TransferRefused
from everybyte.sim.fleet_router import FleetRouter
from everybyte.sim.runner import Runner, SessionState, SimRequest
from everybyte.sim.worker import SimWorker


class SimConnector:
    """The connector scheme of sim:// peers: the simulated mover prices and 'fetches' the blocks
    (contains() is all it asks), so fetch() is never reached."""
    path = "sim"

    def fetch(self, endpoint: str, digest: bytes, names: list[bytes]) -> list[Any]:
        raise AssertionError("the simulated mover never fetches bytes")


class Disaggregation:
    def __init__(self, router: FleetRouter, threshold_tokens: int):
        if threshold_tokens < 0:
            raise ValueError(f"--disagg-threshold must be >= 0 tokens, got {threshold_tokens}")
        self.router, self.threshold = router, threshold_tokens
        self.remote: dict[int, RemoteBlocks] = {}
        self.stats = {"remote_prefills": 0, "blocks_offered": 0, "refused": 0, "prefill_rejected": 0}
        self.disaggregated: set[str] = set()          # request ids of the turns that took this path

    def _remote(self, w: SimWorker) -> RemoteBlocks:
        """The decode worker's source of peers' blocks, added to its tiers as engine/kv_transfer does."""
        r = self.remote.get(w.index)
        if r is None:
            r = self.remote[w.index] = RemoteBlocks({"sim": SimConnector()}, w.memory.ns.digest, w.clock.monotonic)
            w.memory.tiers.add_remote(r)
            w.memory.ledger.add_tier(r)
        return r

    def __call__(self, runner: Runner, req: SimRequest, seq: Sequence, st: SessionState) -> bool:
        """The Runner's dispatch hook: True when the turn went to a prefill worker first."""
        r = self.router
        first = r.plan(req.prompt, req.session_id)
        prefill = r.candidates(("prefill",), first.worker.digest)
        if not disagg_wanted(first, self.threshold, bool(prefill)):
            return False
        pplan = r.decider.plan(prefill, req.prompt)
        pseq = Sequence(list(req.prompt), SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True),
                        f"{req.request_id}-prefill", None, arrival_time=runner.now)
        pi = r.index_of[pplan.worker.url]
        try:
            runner.add_side(pseq, pi, lambda out, w: self._prefilled(runner, w, pseq, seq, st))
        except ValueError:
            self.stats["prefill_rejected"] += 1           # the real router's failed prefill: decode computes it
            return False
        r.begin(pplan, pseq.request_id)
        self.stats["remote_prefills"] += 1
        return True

    def _prefilled(self, runner: Runner, p: SimWorker, pseq: Sequence, seq: Sequence, st: SessionState) -> None:
        m, bs = p.memory, p.memory.block_size
        names = []
        for name in chain_block_ids(m.ns, pseq.prompt_token_ids[:len(pseq.prompt_token_ids) // bs * bs], bs):
            if m.cache.block_of(name) is None:
                break
            names.append(name)
        params = TransferParams(f"sim://{p.index}", m.ns.digest, tuple(names), len(names) * bs)
        runner.later(p.clock.now, lambda: self._decode(runner, params, seq, st))

    def _decode(self, runner: Runner, params: TransferParams, seq: Sequence, st: SessionState) -> None:
        r = self.router
        plan = r.plan(seq.prompt_token_ids, seq.session_id, digest=params.namespace_digest.hex())
        wi = r.index_of[plan.worker.url]
        try:
            self._remote(runner.workers[wi]).expect(params)
            self.stats["blocks_offered"] += len(params.block_hashes)
        except TransferRefused:
            self.stats["refused"] += 1
        if runner.submit(seq, wi, st):
            r.begin(plan, seq.request_id)
            self.disaggregated.add(seq.request_id)

    def describe(self) -> dict[str, Any]:
        return {"threshold_tokens": self.threshold, **self.stats}
