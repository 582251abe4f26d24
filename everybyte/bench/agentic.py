"""`everybyte bench agentic`: replay recorded agent sessions against an endpoint or the embedded engine.

Prints one JSON object (summary, assumptions, turns) and writes it to --json; --out DIR also gets
report.json, report.md (every assumption) and PNG plots.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import sys
import uuid

from everybyte.bench.replay.backend import EndpointError
from everybyte.bench.replay.driver import Replay, ReplayConfig
from everybyte.bench.replay.metrics import summarize
from everybyte.bench.replay.report import hardware, versions, write_files
from everybyte.bench.report import emit
from everybyte.cli_args import count, non_negative, non_negative_int, positive
from everybyte.json_output import check_writable
from everybyte.traces import FORMATS, TraceError, load_trace
from everybyte.traces.locate import default_trace
from everybyte.traces.scaling import Scaling
from everybyte.traces.tokens import MARKER_LEN, TokenSpace

PROG = "everybyte bench agentic"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter,
                                epilog="--model names the embedded engine's model (a .gguf or HF directory); "
                                       "with --endpoint it is the model id sent (default: the server's first).")
    t = p.add_argument_group("trace")
    t.add_argument("--trace", default=None, help="session .json file or directory, Mooncake .jsonl, Azure .csv, "
                   "or synthetic[:sessions=8,turns=6,seed=0,...] (default: the shared agent sessions)")
    t.add_argument("--trace-format", choices=FORMATS, default=None, help="skip format detection")
    t.add_argument("--skip-bad", action="store_true", help="skip malformed records (counted) instead of failing")
    t.add_argument("--max-sessions", type=count, default=None, help="use only the first N sessions")
    s = p.add_argument_group("scaling (defaults depend on the trace format; all are printed)")
    s.add_argument("--token-scale", type=float, default=None, help="divide input token counts by this")
    s.add_argument("--output-scale", type=float, default=None, help="divide output token counts by this")
    s.add_argument("--max-context", type=int, default=None, help="prompt + output cap (default min(4096, window))")
    s.add_argument("--max-output", type=int, default=None, help="cap on max_tokens (default 64)")
    s.add_argument("--gap-scale", type=float, default=None, help="multiply recorded gaps (default 0.1)")
    s.add_argument("--max-gap", type=float, default=None, help="cap on a gap in seconds (default 3)")
    s.add_argument("--arrival-scale", type=float, default=None, help="open loop: multiply recorded arrival times")
    r = p.add_argument_group("replay")
    tgt = r.add_mutually_exclusive_group()
    tgt.add_argument("--endpoint", default=None, help="base URL of an OpenAI-compatible server")
    tgt.add_argument("--embedded", action="store_true", help="the everybyte engine in this process (also when --endpoint is not given)")
    r.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"))
    r.add_argument("--prompt-mode", choices=("auto", "ids", "text"), default="auto")
    r.add_argument("--concurrency", type=int, default=4, help="session lanes (open loop: most sessions at once)")
    r.add_argument("--sweep", default=None, help="comma-separated concurrencies, e.g. 1,2,4,8 (one run each)")
    r.add_argument("--mode", choices=("lanes", "open"), default="lanes")
    r.add_argument("--rate", type=positive, default=None, help="open loop: sessions/s (default: recorded arrivals)")
    r.add_argument("--max-requests", type=count, default=48, help="turns sent per run, warm-up included")
    r.add_argument("--duration", type=positive, default=300.0, help="wall-time bound of a run (s)")
    r.add_argument("--warmup", type=non_negative_int, default=1, help="first turns sent that are excluded from results")
    r.add_argument("--idle-skip", type=non_negative, default=10.0, help="when idle, skip ahead so the next turn is at "
                   "most this far away (s); 0 turns it off")
    r.add_argument("--park", action="store_true", help="park/resume sessions around gaps (everybyte API)")
    r.add_argument("--park-min-gap", type=non_negative, default=0.5)
    r.add_argument("--recycle", action="store_true", help="replay sessions again when the trace runs out")
    r.add_argument("--temperature", type=non_negative, default=0.0)
    r.add_argument("--vocab-range", default="1000,30000", help="token ids drawn from [LOW,HIGH)")
    r.add_argument("--run-marker", default=None, help="per-run marker (default: random)")
    r.add_argument("--request-timeout", type=positive, default=300.0)
    r.add_argument("--drain", type=non_negative, default=30.0, help="after --duration, seconds in-flight turns may "
                   "take before they are cancelled (and counted as errors)")
    r.add_argument("--metrics-interval", type=positive, default=1.0, help="seconds between /metrics samples")
    r.add_argument("--server-flags", default=None, help="the server's flags, recorded in the assumptions")
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--no-progress", action="store_true")
    m = p.add_argument_group("metrics and report")
    m.add_argument("--slo-ttft", type=positive, default=2.0, help="goodput: TTFT at most this (s)")
    m.add_argument("--slo-tok-s-user", type=non_negative, default=5.0, help="goodput: tokens/s/user at least this")
    m.add_argument("--kv-budget-bytes", type=count, default=None, help="KV budget for bytes efficiency "
                   "(default: the engine's, or the server's /metrics)")
    m.add_argument("--out", default=None, help="directory for report.json, report.md and the plots")
    m.add_argument("--json", default=None, help="write the JSON here too")
    from everybyte.engine.engine_args import add_engine_args
    add_engine_args(p)         # --model etc.: the embedded engine (an endpoint's model id for --endpoint)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        sweep = [int(x) for x in args.sweep.split(",")] if args.sweep else [args.concurrency]
        vocab = TokenSpace.parse(args.vocab_range)
        if any(c < 0 for c in sweep):
            raise ValueError("concurrency must be >= 0")
        check_writable(args.out, directory=True)
        check_writable(args.json)
    except (ValueError, OSError) as e:
        print(f"{PROG}: bad option: {e}", file=sys.stderr)
        return 2
    path = args.trace or default_trace()
    try:
        trace = load_trace(path, skip_bad=args.skip_bad, fmt=args.trace_format)
    except (TraceError, OSError) as e:
        print(f"{PROG}: {e}", file=sys.stderr)
        return 2
    if args.max_sessions:
        trace.sessions = trace.sessions[:args.max_sessions]
    try:
        result = asyncio.run(_run(args, trace, path, sweep, vocab.low, vocab.high))
    except EndpointError as e:
        print(f"{PROG}: {e}", file=sys.stderr)
        return 2
    if args.out:
        write_files(result, args.out)
        result["files"] = sorted(os.listdir(args.out))
    emit(result, args.json)
    return 0


def _backend(args):
    if args.endpoint:
        from everybyte.bench.replay.http_backend import HttpBackend
        return HttpBackend(args.endpoint, model=args.model, api_key=args.api_key, prompt_mode=args.prompt_mode,
                           timeout_s=args.request_timeout, temperature=args.temperature,
                           max_connections=max(8, 4 * max(1, args.concurrency)))
    from everybyte.bench.replay.embedded import EmbeddedBackend
    from everybyte.engine.engine_args import engine_kwargs
    return EmbeddedBackend(args.model, temperature=args.temperature, **engine_kwargs(args))


async def _run(args, trace, path: str, sweep: list[int], low: int, high: int) -> dict:
    backend = _backend(args)
    try:
        info = await backend.start()
        if backend.vocab_size:
            high = min(high, backend.vocab_size)
        window = info.get("max_model_len")
        scaling = Scaling.defaults(trace.format, window, token_scale=args.token_scale,
                                   output_scale=args.output_scale, max_context=args.max_context,
                                   max_output=args.max_output, gap_scale=args.gap_scale,
                                   max_gap_s=args.max_gap, arrival_scale=args.arrival_scale)
        space = TokenSpace(low, high)
        marker = args.run_marker or uuid.uuid4().hex[:12]
        print(f"{PROG}: {trace.describe()['sessions']} sessions / {trace.num_turns} turns from {path} "
              f"({trace.format}); target {info.get('target')} model {info.get('model')}; prompts as "
              f"{backend.prompt_mode}; scaling: {scaling.describe()['rule']}", file=sys.stderr)
        turns, samples, runs, offset = [], [], [], 0.0
        for c in sweep:
            cfg = ReplayConfig(concurrency=c, mode=args.mode, rate=args.rate, max_requests=args.max_requests,
                               duration_s=args.duration, warmup=args.warmup, park=args.park,
                               park_min_gap_s=args.park_min_gap, idle_skip_s=args.idle_skip or None,
                               recycle=args.recycle, metrics_interval_s=args.metrics_interval, drain_s=args.drain,
                               progress=not args.no_progress, seed=args.seed)
            run_marker = marker if len(sweep) == 1 else f"{marker}-c{c}"
            replay = Replay(trace, backend, scaling, cfg, space, run_marker)
            run = await replay.run()
            budget = args.kv_budget_bytes or info.get("kv_budget_bytes") or next(
                (s["kv_budget_bytes"] for s in replay.samples if s.get("kv_budget_bytes")), None)
            summary = summarize(replay.turns, replay.samples, args.slo_ttft, args.slo_tok_s_user, budget)
            for t in replay.turns:
                t["concurrency"] = c
            for s in replay.samples:
                s["concurrency"], s["t"] = c, round(s["t"] + offset, 3)
            offset += run["t_end"]
            turns += replay.turns
            samples += replay.samples
            runs.append({"concurrency": c, "summary": summary, "run": run})
    finally:
        await backend.close()
    last = runs[-1]
    result = {"benchmark": "agentic", "summary": last["summary"],
              "assumptions": _assumptions(args, trace, path, scaling, space, marker, info, backend, sweep, last,
                                          budget),
              "run": last["run"], "turns": turns, "samples": samples}
    if len(sweep) > 1:
        result["sweep"] = [{"concurrency": r["concurrency"], "summary": r["summary"], "run": r["run"]} for r in runs]
    return result


def _assumptions(args, trace, path, scaling, space, marker, info, backend, sweep, last, budget) -> dict:
    join = last["run"]["output_join"]
    return {
        "trace": {"path": os.path.abspath(path) if os.path.exists(path) else path, **trace.describe(),
                  "skipped_records_detail": trace.skipped[:20],
                  "sub_agents": "a sub-agent request is replayed in recorded order inside its session's lane, "
                                "with session id <session>.sub<k>; a turn builds on the earlier turn whose hash "
                                "prefix it shares"},
        "scaling": {**scaling.describe(), "defaults_for": trace.format,
                    "context_rule": "a turn extending an earlier one sends that turn's prompt + the ids generated "
                                    "for it + its new input; the new input is shortened by the extra output "
                                    "tokens (outputs are scaled less than inputs) so contexts keep their scaled "
                                    "recorded length, with at least one new token"},
        "tokens": {"token_id_range": [space.low, space.high], "marker_tokens": MARKER_LEN, "run_marker": marker,
                   "rule": "token at scaled position s = f(namespace, hash id of the block holding recorded "
                           "position s*token_scale, s); namespace = the trace for global hash ids, the session "
                           "for local ones; the first tokens of every prompt are the run marker",
                   "prompt_mode": backend.prompt_mode,
                   "output_join": join,
                   "output_join_rule": "server_ids: the ids the server generated; tokenize: the generated text "
                                       "through the server's /tokenize (round trip exact when it gives as many "
                                       "tokens as generated); text: prompts are text and the generated text joins "
                                       "as is; filler: stand-in ids of the generated length (the server offered "
                                       "neither ids nor /tokenize)"},
        "replay": {"mode": args.mode, "concurrency": sweep[-1], "sweep": sweep if len(sweep) > 1 else None,
                   "rate_sessions_s": args.rate, "max_requests": args.max_requests, "duration_s": args.duration,
                   "warmup_turns": args.warmup, "idle_skip_s": args.idle_skip or None, "park": args.park,
                   "park_min_gap_s": args.park_min_gap, "recycle": args.recycle, "temperature": args.temperature,
                   "ignore_eos": True, "max_tokens": "the recorded output, scaled", "endpoint_api": "/v1/completions "
                   "streaming, session_id in the body and X-Session-Id header", "request_timeout_s":
                   args.request_timeout, "drain_s": args.drain, "max_sessions": args.max_sessions, "seed": args.seed},
        "metrics": {"slo_ttft_s": args.slo_ttft, "slo_tok_s_user": args.slo_tok_s_user,
                    "kv_budget_bytes": budget, "kv_budget_source": "--kv-budget-bytes" if args.kv_budget_bytes
                    else ("engine" if info.get("kv_budget_bytes") else ("server /metrics" if budget else None)),
                    "definitions": "TTFT = first output chunk - send; TPOT = (end - first token)/(output-1); "
                                   "tokens/s/user = (output-1)/(end - first token) per turn; throughput over the "
                                   "measured window (first send to last end, warm-up excluded); goodput = output "
                                   "tokens of turns with TTFT <= slo_ttft and tokens/s/user >= slo_tok_s_user "
                                   "(one-token outputs count on TTFT alone) over the same window; prefix hit rate "
                                   "= cached_tokens / prompt_tokens from the server's usage",
                    "metrics_interval_s": args.metrics_interval},
        "target": {**info, "server_flags": args.server_flags},
        "hardware": hardware(),
        "software": versions(),
    }
