"""The request-facing engine: tokenization, validation, add_request / step / abort, and
generate and stream on top of them. The parts come from build_engine; the loop is EngineCore's."""
from __future__ import annotations

from itertools import count
from typing import Iterator

from everybyte.engine.assembly import build_engine
from everybyte.engine.config import EngineConfig
from everybyte.engine.core import CoreRequest
from everybyte.engine.detokenizer import IncrementalDetokenizer
from everybyte.engine.eplb import eplb_stats, start_eplb
from everybyte.engine.kv_transfer import KVTransfer
from everybyte.engine.outputs import RequestOutput
from everybyte.engine.sampling_defaults import sampling_defaults
from everybyte.engine.sampling_params import SamplingParams
from everybyte.engine.sequence import Sequence
from everybyte.kv.clock import SYSTEM, Clock
from everybyte.kv.data.pool import kv_bytes_per_token
from everybyte.kv.memory_manager import KVMemoryManager
from everybyte.models.loader import LoadedModel


class LLMEngine:
    def __init__(self, model: str | LoadedModel | None = None, clock: Clock | None = None, **kwargs):
        """clock: what the engine, scheduler and KV control read for time (default the system's)."""
        self.clock = clock or SYSTEM
        self.config = EngineConfig(**kwargs)
        built = build_engine(model, self.config, self.clock)
        self.loaded, self.model_config, self.tokenizer = built.loaded, built.loaded.config, built.loaded.tokenizer
        self.max_model_len, self.layer_shapes = built.max_model_len, built.layer_shapes
        self.pool, self.weights_bytes, self.model_runner = built.pool, built.weights_bytes, built.model_runner
        self.core = built.core
        self.expert_parallel = built.expert_parallel     # ExpertParallel (apply_placement) when > 1 rank
        self.scheduler, self.block_manager = self.core.scheduler, self.core.block_manager
        self.requests: dict[str, CoreRequest] = self.core.requests
        self.eos_token_ids = self.core.eos_token_ids
        self.sampling_defaults = sampling_defaults(self.model_config)   # for the fields a request leaves unset
        self._ids = count()
        self.kv_transfer = self._kv_transfer()
        self.eplb = start_eplb(self)                     # EplbController when --eplb-interval is set

    def _kv_transfer(self) -> KVTransfer | None:
        c = self.config
        if not isinstance(self.block_manager, KVMemoryManager):
            if c.kv_role != "both" or c.kv_connector:
                raise ValueError(f"kv_role={c.kv_role!r} / kv_connector need the memory system (prefix caching on)")
            return None
        transfer = KVTransfer(self.block_manager, c.kv_role, c.kv_connector, c.kv_transfer_timeout_s)
        self.core.on_finish = transfer.on_finish
        return transfer

    # ---- requests -------------------------------------------------------------------------
    def make_sequence(self, prompt: str | list[int], params: SamplingParams | None = None,
                      request_id: str | None = None, prompt_token_ids: list[int] | None = None,
                      session_id: str | None = None, cache_salt: str | None = None,
                      kv_transfer_params: dict | None = None) -> Sequence:
        """Validate a request and build its sequence (nothing is queued). kv_transfer_params:
        disaggregated prefill/decode (engine/kv_transfer), as in vLLM's API."""
        params = (params or SamplingParams()).with_defaults(self.sampling_defaults)
        params.validate()
        if isinstance(prompt, str):
            if not prompt and not prompt_token_ids:
                raise ValueError("prompt is empty")
            ids = list(prompt_token_ids) if prompt_token_ids is not None else self.tokenizer.encode(prompt)
            text = prompt
        else:
            ids, text = list(prompt), None
        if not ids:
            raise ValueError("prompt is empty (no tokens)")
        vocab = self.model_config.vocab_size
        for i, t in enumerate(ids):
            if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab:
                raise ValueError(f"prompt token id {t!r} at position {i} is outside the vocabulary "
                                 f"[0, {vocab})")
        if len(ids) > self.max_model_len:
            raise ValueError(f"prompt has {len(ids)} tokens, more than max_model_len {self.max_model_len} "
                             f"(the model's context)")
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        seq = Sequence(ids, params, rid, text, arrival_time=self.clock.time())
        seq.session_id, seq.cache_salt = session_id, cache_salt
        self.core.check(seq)               # before anything is queued: a batch is admitted all or none
        if kv_transfer_params is not None:
            if self.kv_transfer is None:
                raise ValueError("kv_transfer_params need the memory system (prefix caching on)")
            self.kv_transfer.admit(seq, kv_transfer_params)
        return seq

    def enqueue(self, seq: Sequence) -> str:
        p = seq.params
        return self.core.add(seq, IncrementalDetokenizer(self.tokenizer, seq.prompt_token_ids, p.stop,
                                                         p.skip_special_tokens))

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None, prompt_token_ids: list[int] | None = None,
                    session_id: str | None = None, cache_salt: str | None = None,
                    kv_transfer_params: dict | None = None) -> str:
        return self.enqueue(self.make_sequence(prompt, params, request_id, prompt_token_ids,
                                               session_id, cache_salt, kv_transfer_params))

    def abort(self, request_id: str) -> RequestOutput | None:
        return self.core.abort(request_id)

    def has_unfinished_requests(self) -> bool:
        return self.core.has_unfinished_requests()

    def has_pending_loads(self) -> bool:
        """Blocks loading from a tier (admissions or resume() prestaging): step() collects them."""
        return self.core.has_pending_loads()

    def step(self) -> list[RequestOutput]:
        """One scheduling decision and one forward (EngineCore.step)."""
        return self.core.step()

    # ---- whole requests -------------------------------------------------------------------
    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 session_id: str | None = None, cache_salt: str | None = None,
                 kv_transfer_params: dict | None = None) -> list[RequestOutput]:
        """Prompts: a string, a token id list, or a list of either. Returns outputs in order.
        session_id names the agent session they belong to (see park/resume); cache_salt keeps
        their KV blocks apart from other tenants'; kv_transfer_params (each prompt's) see
        engine/kv_transfer."""
        seqs = self._make_all(prompts, sampling_params, None, session_id, cache_salt, kv_transfer_params)
        return self.run_to_completion(seqs)

    def run_to_completion(self, seqs: list[Sequence]) -> list[RequestOutput]:
        return self.core.run_to_completion([self.enqueue(s) for s in seqs])

    def stream(self, prompt, params: SamplingParams | None = None,
               prompt_token_ids: list[int] | None = None) -> Iterator[RequestOutput]:
        """Yield the request's output (cumulative, stop-safe text) each time it gets tokens."""
        rid = self.add_request(prompt, params, prompt_token_ids=prompt_token_ids)
        try:
            while True:
                for out in self.step():
                    if out.request_id == rid:
                        yield out
                        if out.finished:
                            return
        finally:
            if rid in self.requests:
                self.abort(rid)

    def _make_all(self, prompts, sampling_params, token_ids=None, session_id=None,
                  cache_salt=None, kv_transfer_params=None) -> list[Sequence]:
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError(f"got {len(sampling_params)} sampling params for {len(prompts)} prompts")
        token_ids = token_ids or [None] * len(prompts)
        return [self.make_sequence(p, sp, prompt_token_ids=t, session_id=session_id, cache_salt=cache_salt,
                                   kv_transfer_params=kv_transfer_params)
                for p, sp, t in zip(prompts, sampling_params, token_ids)]

    # ---- reporting ------------------------------------------------------------------------
    def kv_bytes_per_token(self) -> dict[str, int]:
        return kv_bytes_per_token(self.layer_shapes)

    # ---- sessions ---------------------------------------------------------------------------
    def park(self, session_id: str, expected_gap_s: float | None = None) -> int:
        """The session's agent is in a tool call: its KV leaves the device (to the first tier
        below G1) and is the first to go when G1 needs room. Returns blocks moved off G1."""
        return self.core.park(session_id, expected_gap_s)

    def resume(self, session_id: str) -> int:
        """Start prestaging the session's KV back into G1 before its next turn; returns at once
        with the number of blocks being loaded (session_info(...)["blocks"]["loading"])."""
        return self.core.resume(session_id)

    def drop(self, session_id: str) -> None:
        """Forget the session and free its private blocks in every tier."""
        self.core.drop(session_id)

    def session_info(self, session_id: str) -> dict:
        return self.core.session_info(session_id)

    def reset_prefix_cache(self) -> int:
        """Evict every cached block not used by a running request from the device (G1); with
        lower tiers they are written down first, so later hits load instead of recompute."""
        return self.core.reset_prefix_cache()

    def pending_writes(self) -> list:
        """Write-through puts to the pod-shared tiers still in flight (concurrent futures)."""
        return self.core.pending_writes()

    def close(self) -> None:
        """Finish pending tier writes (write-through to shared tiers) before the process exits."""
        self.core.close()
        if self.kv_transfer is not None:
            self.kv_transfer.close()
        if self.expert_parallel is not None:
            self.expert_parallel.close()

    def stats(self) -> dict:
        out = {**self.core.stats(self.weights_bytes), "kv_pool": self.pool.describe(),
               "max_model_len": self.max_model_len}
        if self.kv_transfer is not None:
            out["kv_transfer"] = self.kv_transfer.stats()
        if self.expert_parallel is not None:
            out["expert_parallel"] = self.expert_parallel.describe()
        if self.eplb is not None:
            out["eplb"] = eplb_stats(self, self.eplb)
        return out
