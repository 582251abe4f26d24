"""The step-level engine: add_request / step / abort, and generate on top of them."""
from __future__ import annotations

import time
import weakref
from dataclasses import dataclass
from itertools import count
from typing import Iterator

import torch

from everybyte.engine.config import EngineConfig, set_threads
from everybyte.engine.detokenizer import IncrementalDetokenizer
from everybyte.engine.kv_budget import resolve_kv_budget
from everybyte.engine.model_runner import CALIBRATION_TEXT, ModelRunner, calibrate_kv_amax
from everybyte.engine.outputs import RequestOutput
from everybyte.engine.sampler import Sampler
from everybyte.engine.sampling_defaults import sampling_defaults
from everybyte.engine.sampling_params import SamplingParams
from everybyte.engine.scheduler import Scheduler
from everybyte.engine.sequence import Sequence
from everybyte.kv.block_id import KVNamespace
from everybyte.kv.block_manager import BlockManager
from everybyte.kv.clock import SYSTEM, Clock
from everybyte.kv.memory_manager import KVMemoryManager
from everybyte.kv.pool import KVPool, format_size, kv_bytes_per_token, min_pool_bytes
from everybyte.kv.tier_config import build_tiers
from everybyte.kv.tier_movement import TierSet
from everybyte.models.kv_scales import read_kv_scales
from everybyte.models.loader import LoadedModel, load_model
from everybyte.models.nvfp4_linear import weight_bytes

_AMAX_CACHE: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


@dataclass
class _Request:
    seq: Sequence
    detok: IncrementalDetokenizer
    generator: torch.Generator | None


class LLMEngine:
    LOAD_WAIT_S = 0.05

    def __init__(self, model: str | LoadedModel | None = None, clock: Clock | None = None, **kwargs):
        """clock: what the engine, scheduler and KV control read for time (default the system's)."""
        self.clock = clock or SYSTEM
        cfg = self.config = EngineConfig(**kwargs)
        set_threads()
        loaded = model if isinstance(model, LoadedModel) else load_model(model, dtype=cfg.dtype,
                                                                         device=cfg.device,
                                                                         weights_dtype=cfg.weights_dtype)
        self.loaded, self.model_config, self.tokenizer = loaded, loaded.config, loaded.tokenizer
        mc = loaded.config
        self.max_model_len = cfg.max_model_len or mc.max_position_embeddings
        self.layer_shapes = [(mc.num_key_value_heads, mc.head_dim)] * mc.num_hidden_layers
        if cfg.kv_cache_bytes == "auto":
            cfg.kv_cache_bytes, self.max_model_len = resolve_kv_budget(
                self.layer_shapes, cfg.kv_cache_dtype, cfg.block_size, self.max_model_len, cfg.max_model_len is not None)
        need = min_pool_bytes(self.layer_shapes, cfg.kv_cache_dtype, self.max_model_len, cfg.block_size)
        if cfg.kv_cache_bytes < need:
            raise ValueError(
                f"KV cache of {cfg.kv_cache_bytes} bytes ({format_size(cfg.kv_cache_bytes)}) in "
                f"{cfg.kv_cache_dtype} is too small for one request of max_model_len={self.max_model_len} "
                f"tokens: it needs at least {need} bytes ({format_size(need)}); raise kv_cache_bytes "
                f"(--kv-cache) or lower max_model_len (--max-model-len)")
        self.pool = KVPool(self.layer_shapes, cfg.kv_cache_dtype, cfg.kv_cache_bytes, cfg.block_size,
                           cfg.device)
        if self.pool.fmt.scaled:
            k_amax, v_amax, grid = self._kv_amax(loaded)
            self.pool.set_scales_from_amax(k_amax, v_amax, headroom=cfg.kv_scale_headroom, grid=grid)
        self.weights_bytes = weight_bytes(loaded.model)
        self.model_runner = ModelRunner(loaded.model, self.pool, Sampler(cfg.seed), cfg.kv_exact_tail)
        self.block_manager = self._block_manager(mc)
        self.scheduler = Scheduler(self.block_manager, cfg.max_num_seqs, cfg.max_num_batched_tokens,
                                   self.max_model_len, self.clock)
        self.eos_token_ids = set(self.tokenizer.eos_token_ids) | set(mc.eos_token_ids)
        self.sampling_defaults = sampling_defaults(mc)      # for the fields a request leaves unset
        self.requests: dict[str, _Request] = {}
        self._ids = count()

    def _block_manager(self, mc) -> BlockManager:
        cfg = self.config
        if not cfg.enable_prefix_caching:
            return BlockManager(self.pool.num_blocks, cfg.block_size)
        # KV bytes also depend on the weights as computed with: their format and the compute dtype
        revision = f"{mc.revision}|weights={self.loaded.weights_format}|dtype={str(self.config.dtype)}"
        ns = KVNamespace.for_pool(self.pool, mc.model_id, revision)
        tiers = TierSet(build_tiers(cfg.kv_tiers or "none", pin_memory=str(cfg.device).startswith("cuda")))
        tail = self.model_runner.exact_tail          # reuse restarts where its exact span starts
        return KVMemoryManager(self.pool, ns, tiers, offload_on_park=cfg.offload_on_park,
                               load_timeout_s=cfg.kv_load_timeout_s,
                               restart_blocks=tail.span // tail.block_size if tail else 1,
                               max_sessions=cfg.max_sessions, session_idle_s=cfg.session_idle_s, clock=self.clock)

    def _kv_amax(self, loaded: LoadedModel) -> tuple[list[float], list[float], bool]:
        """Per-layer K/V amax, and whether they go on the power-of-two grid: the checkpoint's own
        k_scale/v_scale when it has them (used as they are), else the deterministic calibration
        (see calibrate_kv_amax; its tokens and block size depend on the model only), cached per model."""
        if (ckpt := read_kv_scales(loaded.path, loaded.config)) is not None:
            return [k for k, _ in ckpt], [v for _, v in ckpt], False
        if loaded.model not in _AMAX_CACHE:
            ids = self.tokenizer.encode(CALIBRATION_TEXT)[:loaded.config.max_position_embeddings]
            _AMAX_CACHE[loaded.model] = calibrate_kv_amax(loaded.model, self.layer_shapes, ids)
        return (*_AMAX_CACHE[loaded.model], True)

    # ---- requests -------------------------------------------------------------------------
    def make_sequence(self, prompt: str | list[int], params: SamplingParams | None = None,
                      request_id: str | None = None, prompt_token_ids: list[int] | None = None,
                      session_id: str | None = None, cache_salt: str | None = None) -> Sequence:
        """Validate a request and build its sequence (nothing is queued)."""
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
        if rid in self.requests:
            raise ValueError(f"request_id {rid!r} is already in use")
        seq = Sequence(ids, params, rid, text, arrival_time=self.clock.time())
        seq.session_id, seq.cache_salt = session_id, cache_salt
        self.scheduler.check(seq)
        return seq

    def enqueue(self, seq: Sequence) -> str:
        p = seq.params
        gen = torch.Generator().manual_seed(p.seed) if p.seed is not None else None
        detok = IncrementalDetokenizer(self.tokenizer, seq.prompt_token_ids, p.stop, p.skip_special_tokens)
        self.requests[seq.request_id] = _Request(seq, detok, gen)
        self.scheduler.add(seq)
        return seq.request_id

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None, prompt_token_ids: list[int] | None = None,
                    session_id: str | None = None, cache_salt: str | None = None) -> str:
        return self.enqueue(self.make_sequence(prompt, params, request_id, prompt_token_ids,
                                               session_id, cache_salt))

    def abort(self, request_id: str) -> RequestOutput | None:
        req = self.requests.pop(request_id, None)
        if req is None or self.scheduler.abort(request_id) is None:
            return None
        return self._output(req)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def has_pending_loads(self) -> bool:
        """Blocks loading from a tier (admissions or resume() prestaging): step() collects them."""
        return self.block_manager.has_pending_loads()

    # ---- stepping -------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One scheduling decision and one forward; outputs for every request that got a token.
        With nothing to compute but blocks loading from a tier, waits for a load (up to
        LOAD_WAIT_S, so a server loop still takes new requests) instead of returning at once."""
        sched = self.scheduler.schedule()
        bm = self.block_manager
        if not sched.seqs and bm.has_pending_loads():      # one real wait: a virtual clock may stand still
            bm.wait_loads(self.LOAD_WAIT_S)
            sched = self.scheduler.schedule()
        if not sched.seqs:
            return []
        gens = [self.requests[s.request_id].generator for s in sched.seqs]
        t0 = time.perf_counter()
        rows, out = self.model_runner.run(sched.seqs, sched.num_new_tokens, gens)
        self._account_prefill(sched, time.perf_counter() - t0)
        for seq, n in zip(sched.seqs, sched.num_new_tokens):
            seq.num_computed_tokens += n
        now, outputs = self.clock.time(), []
        for k, i in enumerate(rows):
            req = self.requests[sched.seqs[i].request_id]
            self._append(req, out.token_ids[k], out.logprobs[k], now)
            outputs.append(self._output(req))
            if req.seq.is_finished:
                del self.requests[req.seq.request_id]
        return outputs

    def _account_prefill(self, sched, seconds: float) -> None:
        """Prompt tokens computed this step (vs reused), and the prefill speed that decides
        whether loading a block from a tier beats recomputing it."""
        bm = self.block_manager
        if not isinstance(bm, KVMemoryManager):
            return
        prefill = sum(max(min(n, s.num_prompt_tokens - s.num_computed_tokens), 0)
                      for s, n in zip(sched.seqs, sched.num_new_tokens))
        if prefill:
            bm.ledger.record_prefill(prefill)
        if prefill >= 64 and seconds > 0:
            speed, old = prefill / seconds, bm.tiers.prefill_tok_s
            bm.tiers.prefill_tok_s = speed if old is None else 0.7 * old + 0.3 * speed

    def _append(self, req: _Request, token: int, logprobs, now: float) -> None:
        seq, p = req.seq, req.seq.params
        seq.append_token(token)
        m = seq.metrics
        m.token_times.append(now)
        if m.first_token_time is None:
            m.first_token_time = now
        if seq.logprobs is not None:
            seq.logprobs.append(logprobs)
        reason = None
        if token in p.stop_token_ids:
            reason, seq.stop_reason = "stop", token
        elif not p.ignore_eos and token in self.eos_token_ids:
            reason = "stop"
        elif (hit := req.detok.add(token)) is not None:
            reason, seq.stop_reason = "stop", hit
        elif seq.num_completion_tokens >= p.max_tokens or len(seq) >= self.max_model_len:
            reason = "length"
        if reason:
            self.scheduler.finish(seq, reason)

    def _output(self, req: _Request) -> RequestOutput:
        seq = req.seq
        text = req.detok.text if seq.finish_reason else req.detok.stable_text()
        return RequestOutput(seq.request_id, seq.prompt, seq.prompt_token_ids, text,
                             seq.completion_token_ids, seq.finish_reason,
                             None if seq.logprobs is None else list(seq.logprobs), seq.metrics,
                             seq.stop_reason, seq.num_cached_tokens, seq.session_id)

    # ---- whole requests -------------------------------------------------------------------
    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 session_id: str | None = None, cache_salt: str | None = None) -> list[RequestOutput]:
        """Prompts: a string, a token id list, or a list of either. Returns outputs in order.
        session_id names the agent session they belong to (see park/resume); cache_salt keeps
        their KV blocks apart from other tenants'."""
        return self.run_to_completion(self._make_all(prompts, sampling_params, None, session_id, cache_salt))

    def run_to_completion(self, seqs: list[Sequence]) -> list[RequestOutput]:
        reqs = [self.requests[self.enqueue(s)] for s in seqs]
        while not all(r.seq.is_finished for r in reqs):
            if self.scheduler.is_finished():
                raise RuntimeError("scheduler idle with unfinished requests")
            self.step()
        return [self._output(r) for r in reqs]

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
                  cache_salt=None) -> list[Sequence]:
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError(f"got {len(sampling_params)} sampling params for {len(prompts)} prompts")
        token_ids = token_ids or [None] * len(prompts)
        return [self.make_sequence(p, sp, prompt_token_ids=t, session_id=session_id, cache_salt=cache_salt)
                for p, sp, t in zip(prompts, sampling_params, token_ids)]

    # ---- reporting ------------------------------------------------------------------------
    def kv_bytes_per_token(self) -> dict[str, int]:
        return kv_bytes_per_token(self.layer_shapes)

    # ---- sessions ---------------------------------------------------------------------------
    def _memory(self) -> KVMemoryManager:
        if not isinstance(self.block_manager, KVMemoryManager):
            raise ValueError("sessions need the memory system: enable_prefix_caching=True")
        return self.block_manager

    def park(self, session_id: str, expected_gap_s: float | None = None) -> int:
        """The session's agent is in a tool call: its KV leaves the device (to the first tier
        below G1) and is the first to go when G1 needs room. Returns blocks moved off G1."""
        return self._memory().park(session_id, expected_gap_s)

    def resume(self, session_id: str) -> int:
        """Start prestaging the session's KV back into G1 before its next turn; returns at once
        with the number of blocks being loaded (session_info(...)["blocks"]["loading"])."""
        return self._memory().resume(session_id)

    def drop(self, session_id: str) -> None:
        """Forget the session and free its private blocks in every tier."""
        self._memory().drop(session_id)

    def session_info(self, session_id: str) -> dict:
        return self._memory().session_info(session_id)

    def reset_prefix_cache(self) -> int:
        """Evict every cached block not used by a running request from the device (G1); with
        lower tiers they are written down first, so later hits load instead of recompute."""
        bm = self.block_manager
        return bm.evict_all() if isinstance(bm, KVMemoryManager) else 0

    def close(self) -> None:
        """Finish pending tier writes (write-through to shared tiers) before the process exits."""
        if isinstance(self.block_manager, KVMemoryManager):
            self.block_manager.tiers.flush()

    def stats(self) -> dict:
        bm = self.block_manager
        mem = bm.stats(self.weights_bytes) if isinstance(bm, KVMemoryManager) else {}
        extra = {"memory": mem} if mem else {}
        if mem:
            extra["prefix_cache_queries"] = mem["prefix_cache"]["query_tokens"]
            extra["prefix_cache_hits"] = mem["prefix_cache"]["hit_tokens"]
        return {**extra, "num_running": len(self.scheduler.running), "num_waiting": len(self.scheduler.waiting),
                "num_preemptions": self.scheduler.num_preemptions,
                "kv_blocks_total": bm.num_blocks, "kv_blocks_free": bm.num_free_blocks,
                "kv_usage": bm.num_used_blocks / bm.num_blocks, "kv_pool": self.pool.describe(),
                "max_model_len": self.max_model_len}
