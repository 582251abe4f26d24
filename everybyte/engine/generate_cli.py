"""`everybyte generate "prompt"`: run the engine on one prompt and stream tokens to stdout."""
from __future__ import annotations

import argparse
import sys
import time

from everybyte.engine.engine_args import add_engine_args, engine_kwargs


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="everybyte generate", description=__doc__)
    p.add_argument("prompt", help="the prompt text ('-' reads it from stdin)")
    p.add_argument("--max-tokens", type=int, default=256)
    model = " (default: the model's own, else temperature 0.7, top-p 0.9, repetition penalty 1.1)"
    p.add_argument("--temperature", type=float, default=None, help="0 = greedy" + model)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--min-p", type=float, default=None)
    p.add_argument("--repetition-penalty", type=float, default=None, help="1 = off")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    p.add_argument("--system", default=None, help="system message (with --chat)")
    p.add_argument("--stats", action="store_true", help="print timing stats to stderr")
    return add_engine_args(p)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from everybyte.engine.llm import LLM
    from everybyte.engine.sampling_params import SamplingParams

    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    try:
        params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                                min_p=args.min_p, repetition_penalty=args.repetition_penalty, seed=args.seed, max_tokens=args.max_tokens,
                                stop=args.stop, ignore_eos=args.ignore_eos)
        llm = LLM(args.model, **engine_kwargs(args))
        if args.chat:
            messages = ([{"role": "system", "content": args.system}] if args.system else [])
            stream = llm.stream_chat(messages + [{"role": "user", "content": prompt}], params)
        else:
            stream = llm.stream(prompt, params)
        printed, start, out = 0, time.time(), None
        for out in stream:
            sys.stdout.write(out.text[printed:])
            sys.stdout.flush()
            printed = len(out.text)
    except (ValueError, OSError) as e:          # a bad setting, a model path that is not there
        print(f"everybyte generate: error: {e}", file=sys.stderr)
        return 2
    sys.stdout.write("\n")
    if args.stats and out is not None:
        n, elapsed = len(out.token_ids), time.time() - start
        m = out.metrics
        print(f"[{n} tokens in {elapsed:.2f}s, ttft {m.ttft:.3f}s, finish_reason={out.finish_reason}, "
              f"kv={args.kv_cache_dtype}, dtype={llm.config.dtype}]", file=sys.stderr)
    return 0
