"""`everybyte bench moe`: a MoE at expert-parallel sizes 1, 2, 4: expert bytes and KV tokens per
rank, prefill/decode tok/s, and the imbalance (max/mean tokens per rank, per layer) before and
after EPLB with 0, 1, 2 redundant experts per rank on a replay of the shared agent sessions.

The routing is recorded once (MoEBlock.load_counter on every engine step of the replay, EP 1)
and every placement is judged on it (bench/micro/moe_placement). Bytes come from formats/sizes
arithmetic (models/expert_ledger) beside what the loaded model measures. tok/s runs the engine
at each EP size where this build has --expert-parallel.
"""
from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from everybyte.bench.report import emit, environment
from everybyte.cli_args import count, positive

PROG = "everybyte bench moe"


def _ints(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 0:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers >= 0, got {text!r}")
    return values


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="a MoE model directory (default: the real-routing MoE "
                   "`everybyte moe-ify` builds from the default model, 8 experts, top-2, cached)")
    p.add_argument("--ep", type=_ints, default=[1, 2, 4], help="expert-parallel sizes (default 1,2,4)")
    p.add_argument("--redundant", type=_ints, default=[0, 1, 2], help="redundant experts per rank (default 0,1,2)")
    p.add_argument("--eplb-interval", type=int, default=50, help="steps between rebalances (default 50)")
    p.add_argument("--eplb-window", type=_ints, default=[0], metavar="STEPS,...",
                   help="load windows to compare, each >= the interval; 0 = 4 intervals (default 0)")
    r = p.add_argument_group("routing replay")
    r.add_argument("--trace", default=None, help="agent sessions (default: the shared ones; see bench agentic)")
    r.add_argument("--max-sessions", type=count, default=8, help="sessions replayed (default 8)")
    r.add_argument("--max-turns", type=count, default=6, help="turns per session (default 6)")
    r.add_argument("--concurrency", type=count, default=4, help="sessions batched together (default 4)")
    r.add_argument("--token-scale", type=positive, default=None, help="divide recorded input tokens by this")
    r.add_argument("--max-context", type=count, default=2048, help="prompt + output cap per turn (default 2048)")
    r.add_argument("--max-output", type=count, default=16, help="cap on output tokens per turn (default 16)")
    r.add_argument("--routing", default=None, help="judge placements on this recorded routing instead of replaying")
    r.add_argument("--save-routing", default=None, help="write the recorded routing here (torch file)")
    m = p.add_argument_group("memory and speed")
    m.add_argument("--kv-cache", default="64MiB", help="KV budget of the EP 1 rank; the per-rank memory budget "
                   "is EP 1's weights + this (default 64MiB)")
    m.add_argument("--kv-cache-dtype", default="nvfp4")
    m.add_argument("--weights-dtype", default="auto")
    m.add_argument("--no-throughput", action="store_true", help="skip the tok/s runs")
    m.add_argument("--prefill-len", type=count, default=256)
    m.add_argument("--decode-batch", type=count, default=4)
    m.add_argument("--new-tokens", type=count, default=16)
    p.add_argument("--json", default=None, help="also write the JSON here")
    return p


def _check(a: argparse.Namespace) -> None:
    if 0 in a.ep:
        raise ValueError("--ep sizes must be >= 1")
    from everybyte.models.expert_load import EplbSettings

    for w in a.eplb_window:
        EplbSettings(interval=a.eplb_interval, window=w)    # its range errors
    for name in ("eplb_interval", "max_sessions", "concurrency", "max_turns", "prefill_len", "decode_batch",
                 "new_tokens", "max_output"):
        if getattr(a, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(a, name)}")


def default_model(experts: int = 8, top_k: int = 2) -> str:
    """The real-routing MoE `everybyte moe-ify` makes from the default model, built once into the
    cache (~/.cache/everybyte/moe/, about a minute and 0.5 GB in fp32)."""
    from everybyte.engine.moeify_cli import moeify
    from everybyte.models.default_model import everybyte_home

    path = everybyte_home() / "moe" / f"default-e{experts}-k{top_k}"
    if not (path / "config.json").is_file():
        print(f"{PROG}: building {path} with `everybyte moe-ify --experts {experts} --top-k {top_k}` (once)",
              file=sys.stderr)
        moeify(None, path, experts=experts, top_k=top_k, force=True)
    return str(path)


def _engine_kwargs(a: argparse.Namespace) -> dict[str, Any]:
    return {"kv_cache_bytes": a.kv_cache, "kv_cache_dtype": a.kv_cache_dtype, "weights_dtype": a.weights_dtype,
            "kv_tiers": "none", "max_num_seqs": max(a.concurrency, a.decode_batch),
            "max_model_len": max(a.max_context, a.prefill_len + 1, 64 + a.new_tokens) + 16}


def ledger(llm: Any, a: argparse.Namespace) -> dict[str, Any]:
    """Per-rank bytes at each EP size and redundancy, at EP 1's weights + --kv-cache per rank."""
    from everybyte.bench.micro.moe_routing import moe_layer_indices
    from everybyte.models.expert_ledger import ExpertShape, rank_ledger, stored_format
    from everybyte.models.expert_load import moe_blocks
    from everybyte.models.nvfp4_linear import weight_bytes

    mc, model = llm.model_config, llm.loaded.model
    shape = ExpertShape(mc.hidden_size, mc.moe_intermediate_size, mc.num_experts, len(moe_layer_indices(mc)),
                        stored_format(llm.loaded.weights_format, str(next(model.parameters()).dtype)))
    measured_experts = sum(weight_bytes(b.experts) for b in moe_blocks(model))
    dense = weight_bytes(model) - measured_experts
    budget = weight_bytes(model) + int(llm.config.kv_cache_bytes)
    rows = [rank_ledger(shape, n, r, dense, budget, llm.pool.layer_shapes, llm.pool.kv_cache_dtype,
                        llm.pool.block_size).to_dict() for n in a.ep for r in a.redundant
            if shape.num_experts % n == 0 and shape.num_experts // n + r <= shape.num_experts]
    return {"weights_format": shape.weights_format, "one_expert_bytes": shape.expert_bytes(),
            "expert_bytes_all_measured": measured_experts,
            "expert_bytes_all_arithmetic": shape.expert_bytes() * shape.num_experts * shape.num_moe_layers,
            "dense_bytes": dense, "budget_bytes_per_rank": budget, "kv_bytes_per_token": llm.pool.bytes_per_token,
            "per_rank": rows}


def routing_for(llm: Any, a: argparse.Namespace) -> Any:
    from everybyte.bench.agentic import default_trace
    from everybyte.bench.micro.moe_routing import Routing, record_routing
    from everybyte.traces import load_trace
    from everybyte.traces.scaling import Scaling

    if a.routing:
        return Routing.load(a.routing)
    trace = load_trace(a.trace or default_trace())
    scaling = Scaling.defaults(trace.format, model_window=llm.max_model_len, token_scale=a.token_scale,
                               max_context=a.max_context, max_output=a.max_output)
    routing = record_routing(llm, trace, scaling, a.max_sessions, a.concurrency, a.max_turns)
    if a.save_routing:
        routing.save(a.save_routing)
    return routing


def throughput(model: str, ep: int, a: argparse.Namespace) -> dict[str, Any]:
    """Prefill tok/s (one prompt of --prefill-len, best of 2) and decode tok/s (--decode-batch
    prompts, --new-tokens each, whole generate call) at expert-parallel size `ep`."""
    from everybyte import LLM, SamplingParams
    from everybyte.bench.engine import _prompts
    from everybyte.engine.config import EngineConfig

    kw = _engine_kwargs(a)
    if ep > 1:
        if "expert_parallel" not in EngineConfig.__dataclass_fields__:
            return {"ep": ep, "skipped": "this build has no expert parallelism (LLM(expert_parallel=N))"}
        kw["expert_parallel"] = ep
    llm = LLM(model, **kw)
    try:
        tok = lambda s: llm.tokenizer.encode(s, add_special_tokens=False)
        one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
        best = float("inf")
        for r, prompt in enumerate(_prompts(tok, 3, a.prefill_len)):
            t = time.perf_counter()
            llm.generate([prompt], one)
            if r:                                      # the first call warms up
                best = min(best, time.perf_counter() - t)
        prompts = _prompts(tok, a.decode_batch, 64, offset=4 * a.prefill_len)
        t = time.perf_counter()
        outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=a.new_tokens, ignore_eos=True))
        decode_s = time.perf_counter() - t
        return {"ep": ep, "prefill_tok_s": round(a.prefill_len / best, 1),
                "decode_tok_s": round(sum(len(o.token_ids) for o in outs) / decode_s, 1)}
    finally:
        close = getattr(llm, "shutdown", None) or getattr(llm, "close", None)
        if close is not None:
            close()


def run(a: argparse.Namespace) -> dict[str, Any]:
    from everybyte.bench.micro.moe_placement import expert_skew, replay_imbalance
    from everybyte.engine.llm_engine import LLMEngine

    _check(a)
    model = a.model or default_model()
    llm = LLMEngine(model, **_engine_kwargs(a))
    routing = routing_for(llm, a)
    mc = llm.model_config
    imbalance = [replay_imbalance(routing, n, r, a.eplb_interval, w) for n in a.ep if n > 1 for r in a.redundant
                 for w in a.eplb_window if mc.num_experts % n == 0 and mc.num_experts // n + r <= mc.num_experts]
    out: dict[str, Any] = {
        "benchmark": "moe", "model": mc.model_id, "num_experts": mc.num_experts, "top_k": mc.num_experts_per_tok,
        "moe_layers": len(routing.moe_layers), "eplb_interval_steps": a.eplb_interval,
        "routing": {"steps": len(routing.steps), "requests": routing.requests, "prompt_tokens": routing.prompt_tokens,
                    "generated_tokens": routing.generated_tokens, "routed_tokens_per_layer": routing.routed_tokens,
                    "expert_skew": expert_skew(routing), "scaling": routing.scaling},
        "imbalance": imbalance,
        "goal_after_max_mean": 1.15,
        "ledger": ledger(llm, a),
    }
    del llm
    out["throughput"] = [] if a.no_throughput else [throughput(model, n, a) for n in a.ep]
    out["environment"] = environment()
    return out


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    try:
        result = run(a)
    except ValueError as e:
        print(f"{PROG}: {e}", file=sys.stderr)
        return 2
    emit(result, a.json)
    return 0
