"""`everybyte serve`: the OpenAI-compatible server on uvicorn."""
from __future__ import annotations

import argparse
import logging
import os
import re
import signal

from everybyte.cli_args import count, port
from everybyte.engine.engine_args import add_engine_args, engine_kwargs
from everybyte.serve.state import ServerConfig


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="everybyte serve", description="OpenAI-compatible server")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=port, default=8000)
    p.add_argument("--served-model-name", default=None, help="model id clients send (default: the model's)")
    p.add_argument("--api-key", action="append", default=None,
                   help="require `Authorization: Bearer KEY` on every path but /health and /metrics; repeat "
                        "for one key per tenant (env EVERYBYTE_API_KEY, comma-separated)")
    p.add_argument("--cache-salt-from-api-key", action="store_true",
                   help="isolate tenants by key: KV blocks are salted, and session ids namespaced, by a hash "
                        "of the caller's API key (a body's cache_salt nests under it)")
    p.add_argument("--max-queue", type=count, default=256, help="requests in flight before 429")
    p.add_argument("--max-body-bytes", type=count, default=8 * 1024 * 1024)
    p.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="on SIGTERM, seconds in-flight requests may run; then they are cut (streams end "
                        "with an error event and [DONE]) and the server exits")
    p.add_argument("--max-sessions", type=int, default=10000,
                   help="agent sessions remembered; beyond it the least recently active is forgotten")
    p.add_argument("--session-idle-timeout", type=float, default=3600.0,
                   help="seconds without a request, park or resume after which a session is forgotten")
    p.add_argument("--no-auto-park", action="store_true",
                   help="do not park a session when its chat turn ends in tool calls")
    p.add_argument("--role", default="both", choices=["both", "prefill", "decode"],
                   help="disaggregated prefill/decode: prefill answers do_remote_decode requests with "
                        "kv_transfer_params and serves their KV; decode fetches it (do_remote_prefill); both")
    p.add_argument("--kv-connector", default=None, metavar="tcp://HOST:PORT",
                   help="where this worker serves KV blocks to decode workers (port 0: a free one); "
                        "--role prefill binds a free port on 127.0.0.1 without it")
    p.add_argument("--kv-transfer-timeout", type=float, default=5.0,
                   help="seconds a remote KV fetch may take before its blocks are recomputed")
    p.add_argument("--log-level", default="info")
    p.add_argument("--kv-events", default=None, metavar="tcp://HOST:PORT",
                   help="publish KV events (vLLM's schema, msgpack over ZeroMQ PUB) on this endpoint")
    p.add_argument("--kv-events-replay", default=None, metavar="tcp://HOST:PORT",
                   help="the replay (ROUTER) endpoint for --kv-events (default: its port + 1)")
    p.add_argument("--kv-events-buffer", type=count, default=10000, help="batches kept for replay")
    add_engine_args(p)
    return p


def make_app(args: argparse.Namespace):
    from everybyte.engine.llm_engine import LLMEngine
    from everybyte.serve.api import create_app
    from everybyte.serve.state import ServerState

    keys = tuple(args.api_key or [k for k in os.environ.get("EVERYBYTE_API_KEY", "").split(",") if k])
    if args.cache_salt_from_api_key and not keys:
        raise SystemExit("--cache-salt-from-api-key needs --api-key (one per tenant)")
    if args.kv_connector and (args.role == "decode" or not re.fullmatch(r"tcp://[^:/]+:\d+", args.kv_connector)):
        raise SystemExit(f"--kv-connector {args.kv_connector!r}: give tcp://HOST:PORT, on a prefill or both worker")
    if not args.kv_transfer_timeout > 0:
        raise SystemExit(f"--kv-transfer-timeout must be > 0, got {args.kv_transfer_timeout}")
    if not args.shutdown_timeout >= 0:
        raise SystemExit(f"--shutdown-timeout must be >= 0, got {args.shutdown_timeout}")
    if args.kv_events:                  # bad endpoints fail before the model loads
        from everybyte.serve.kv_events_pub import default_replay_endpoint, parse_endpoint
        try:
            parse_endpoint(args.kv_events)
            args.kv_events_replay = args.kv_events_replay or default_replay_endpoint(args.kv_events)
            parse_endpoint(args.kv_events_replay)
        except ValueError as e:
            raise SystemExit(f"--kv-events: {e}")
    elif args.kv_events_replay:
        raise SystemExit("--kv-events-replay needs --kv-events")
    try:
        engine = LLMEngine(args.model, **engine_kwargs(args), max_sessions=args.max_sessions,
                           session_idle_s=args.session_idle_timeout, kv_role=args.role,
                           kv_connector=args.kv_connector, kv_transfer_timeout_s=args.kv_transfer_timeout)
    except (ValueError, OSError) as e:          # a bad setting, a model path that is not there
        raise SystemExit(f"everybyte serve: {e}") from None
    name = args.served_model_name or engine.model_config.model_id
    cfg = ServerConfig(model_name=name, max_model_len=engine.max_model_len,
                       vocab_size=engine.model_config.vocab_size, api_keys=keys,
                       max_queue=args.max_queue, max_body_bytes=args.max_body_bytes,
                       auto_park=not args.no_auto_park, cache_salt_from_api_key=args.cache_salt_from_api_key,
                       role=args.role,
                       kv_connector={"endpoint": engine.kv_transfer.endpoint}
                       if engine.kv_transfer and engine.kv_transfer.endpoint else None)
    state = ServerState(engine, engine.tokenizer, cfg)
    if args.kv_events:
        start_kv_events(state, args)
    app = create_app(state)

    @app.on_event("shutdown")
    def _drain():  # the drain deadline was set by SIGTERM (see main); this waits for the engine loop
        state.engine.shutdown(timeout=args.shutdown_timeout)
        if state.kv_feed is not None:
            state.kv_feed.close()

    return app


def start_kv_events(state, args: argparse.Namespace) -> None:
    """Bind the KV-event feed and publish a batch after every engine step (serve/kv_events_pub)."""
    from everybyte.kv.memory_manager import KVMemoryManager
    from everybyte.serve.kv_events_pub import KVEventFeed, KVEventPublisher

    mem = state.engine.engine.block_manager
    if not isinstance(mem, KVMemoryManager):
        raise SystemExit("--kv-events needs the prefix cache (drop --no-prefix-caching)")
    replay, topic = args.kv_events_replay, f"kv.{mem.ns.digest.hex()}"
    try:
        publisher = KVEventPublisher(args.kv_events, replay, topic, args.kv_events_buffer)
    except (ValueError, RuntimeError) as e:          # a bad buffer size, an address in use
        raise SystemExit(f"--kv-events: {e}")
    state.kv_feed = KVEventFeed(mem.kv_events(), publisher)
    state.engine.on_step = state.kv_feed.flush
    state.config.kv_events = {"endpoint": args.kv_events, "replay_endpoint": replay, "topic": topic}


def main(argv: list[str] | None = None) -> int:
    import uvicorn

    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    app = make_app(args)

    class _Server(uvicorn.Server):
        def handle_exit(self, sig, frame):  # SIGTERM is the normal way to stop: drain, then exit 0
            # one deadline for everything: the engine cuts what still runs at it, so streams end
            # (error event, [DONE]) and uvicorn's connections close before its own, later, timeout
            app.state.eb.engine.begin_shutdown(args.shutdown_timeout)
            super().handle_exit(sig, frame)
            if sig == signal.SIGTERM:
                self._captured_signals.remove(sig)

    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                            timeout_graceful_shutdown=args.shutdown_timeout + 5)
    _Server(config).run()
    return 0
