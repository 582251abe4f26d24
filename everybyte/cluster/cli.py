"""`everybyte cluster --workers N [--prefill P --decode D] --port 8000 [--launcher local|ray
--address ADDR] [--policy ...] [serve engine args]`: workers plus a router (cluster/launcher)."""
from __future__ import annotations

import argparse
import logging
import signal
import sys

from everybyte.cli_args import port
from everybyte.cluster.launcher import Cluster, LocalWorker, plan_workers

POLICIES = ("kv", "round-robin", "random", "least-loaded", "session")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="everybyte cluster", description="N `everybyte serve` workers and an `everybyte router` in "
        "front; any other argument (e.g. --model, --kv-cache, --kv-tiers) goes to every worker")
    p.add_argument("--workers", type=int, default=None, help="workers (role both); default 2")
    p.add_argument("--prefill", type=int, default=None, help="prefill workers (with --decode)")
    p.add_argument("--decode", type=int, default=None, help="decode workers (with --prefill)")
    p.add_argument("--port", type=port, default=8000, help="the router's port")
    p.add_argument("--policy", default="kv", choices=POLICIES, help="the router's policy")
    p.add_argument("--disagg-threshold", type=int, default=None, help="passed to the router")
    p.add_argument("--no-events", action="store_true", help="passed to the router (approximate mode)")
    p.add_argument("--launcher", default="local", choices=("local", "ray"))
    p.add_argument("--address", default=None, help="the Ray cluster's address (with --launcher ray)")
    p.add_argument("--worker-host", default=None,
                   help="address workers bind (default 127.0.0.1 locally; with Ray, each node's Ray address)")
    p.add_argument("--threads-per-worker", type=int, default=None,
                   help="CPU threads each worker uses (default: this machine's cores // workers, at least 1)")
    p.add_argument("--expert-parallel", type=int, default=1, metavar="N",
                   help="each worker splits its MoE model's experts over N rank processes (README: Expert "
                        "parallelism); the cores are shared by all ranks of all workers")
    p.add_argument("--no-router", action="store_true", help="start only the workers (print their URLs)")
    p.add_argument("--start-timeout", type=float, default=600.0, help="seconds for every worker to be healthy")
    p.add_argument("--stop-timeout", type=float, default=30.0, help="seconds a worker may drain on stop")
    p.add_argument("--log-level", default="info", help="the launcher's, the workers' and the router's")
    return p


def router_argv(args: argparse.Namespace, serve_args: list[str]) -> list[str] | None:
    if args.no_router:
        return None
    argv = [sys.executable, "-m", "everybyte.cli", "router", "--port", str(args.port), "--policy", args.policy,
            "--log-level", args.log_level]
    if args.disagg_threshold is not None:
        argv += ["--disagg-threshold", str(args.disagg_threshold)]
    if args.no_events:
        argv.append("--no-events")
    if "--cache-salt-from-api-key" in serve_args:     # the router names blocks per tenant as workers do
        argv.append("--cache-salt-from-api-key")
    for i, a in enumerate(serve_args):            # the router tokenizes with the workers' model
        if a == "--model" and i + 1 < len(serve_args):
            argv += ["--model", serve_args[i + 1]]
        elif a.startswith("--model="):
            argv += ["--model", a.split("=", 1)[1]]
    return argv


def main(argv: list[str] | None = None) -> int:
    args, serve_args = build_parser().parse_known_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if args.workers is None and args.prefill is None:
        args.workers = 2
    serve_args = [*serve_args, "--log-level", args.log_level]
    try:
        specs = plan_workers(args.workers, args.prefill, args.decode, serve_args,
                             expert_parallel=args.expert_parallel)
    except ValueError as e:
        print(f"everybyte cluster: {e}", file=sys.stderr)
        return 2
    if args.threads_per_worker is not None:
        if args.threads_per_worker < 1:
            print("everybyte cluster: --threads-per-worker must be >= 1", file=sys.stderr)
            return 2
        for s in specs:
            s.threads = args.threads_per_worker
    if args.launcher == "ray":
        if not args.address:
            print("everybyte cluster: --launcher ray needs --address (e.g. 127.0.0.1:6379)", file=sys.stderr)
            return 2
        from everybyte.cluster.ray_launcher import RayWorker, connect
        connect(args.address)
        make = RayWorker
    elif args.address:
        print("everybyte cluster: --address is for --launcher ray", file=sys.stderr)
        return 2
    else:
        make = LocalWorker        # type: ignore[assignment]
    cluster = Cluster([], router_argv(args, serve_args), args.stop_timeout)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: cluster.stopping.set())
    try:
        for spec in specs:
            cluster.workers.append(make(spec, args.worker_host) if args.worker_host else make(spec))
        cluster.start(args.start_timeout)
        return cluster.watch()
    except RuntimeError as e:
        print(f"everybyte cluster: {e}", file=sys.stderr)
        return 1
    finally:
        cluster.stop()
