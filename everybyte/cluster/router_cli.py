"""`everybyte router --port 8000 --worker URL --worker URL [--policy kv] [--no-events] ...`"""
from __future__ import annotations

import argparse
import logging

from fastapi import FastAPI

from everybyte.cli_args import port
from everybyte.cluster.policy import POLICIES, Policy
from everybyte.cluster.request_blocks import RequestBlocks, load_tokenizer
from everybyte.cluster.routing import Routing


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="everybyte router",
                                description="an OpenAI-compatible, KV-aware router over `everybyte serve` workers")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=port, default=8000)
    p.add_argument("--worker", action="append", required=True, metavar="URL",
                   help="a worker's base URL, e.g. http://127.0.0.1:8001 (repeat for each)")
    p.add_argument("--policy", choices=POLICIES, default="kv")
    p.add_argument("--model", default=None,
                   help="the workers' model (GGUF or HF directory) for the tokenizer; default: the default model")
    p.add_argument("--overlap-weight", type=float, default=1.0, help="Dynamo's overlap_score_weight")
    p.add_argument("--no-events", action="store_true",
                   help="approximate mode: predict caches from the router's own decisions, not KV events")
    p.add_argument("--approx-ttl", type=float, default=120.0,
                   help="seconds a routed prompt's blocks are assumed cached in approximate mode")
    p.add_argument("--disagg-threshold", type=int, default=None, metavar="TOKENS",
                   help="send a request whose uncached prefill exceeds TOKENS to a prefill worker first")
    p.add_argument("--cache-salt-from-api-key", action="store_true",
                   help="name blocks per API key, as workers started with the same flag do")
    p.add_argument("--request-timeout", type=float, default=600.0, help="seconds to wait on a worker's answer")
    p.add_argument("--seed", type=int, default=None, help="seed of the random policy")
    p.add_argument("--log-level", default="info")
    return p


def make_app(args: argparse.Namespace) -> FastAPI:
    from everybyte.cluster.router import create_app
    urls = [u.rstrip("/") for u in args.worker]
    if len(set(urls)) != len(urls):
        raise SystemExit("everybyte router: a --worker is given twice")
    for u in urls:
        if not u.startswith(("http://", "https://")):
            raise SystemExit(f"everybyte router: --worker {u!r} is not an http(s) URL")
    if args.disagg_threshold is not None and args.disagg_threshold < 0:
        raise SystemExit(f"everybyte router: --disagg-threshold must be >= 0, got {args.disagg_threshold}")
    if not args.approx_ttl > 0:
        raise SystemExit(f"everybyte router: --approx-ttl must be > 0, got {args.approx_ttl}")
    if not args.request_timeout > 0:
        raise SystemExit(f"everybyte router: --request-timeout must be > 0 seconds, got {args.request_timeout}")
    if not args.overlap_weight >= 0:            # a negative weight would steer prompts away from their cache
        raise SystemExit(f"everybyte router: --overlap-weight must be >= 0, got {args.overlap_weight}")
    routing = Routing(urls, RequestBlocks(load_tokenizer(args.model)),
                      Policy(args.policy, args.overlap_weight, args.seed),
                      events=not args.no_events, approx_ttl_s=args.approx_ttl)
    return create_app(routing, disagg_threshold=args.disagg_threshold, request_timeout_s=args.request_timeout,
                      cache_salt_from_api_key=args.cache_salt_from_api_key)


def main(argv: list[str] | None = None) -> int:
    import uvicorn

    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    app = make_app(args)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level, timeout_graceful_shutdown=5)
    return 0
