"""`everybyte bench compare`: replay the same agent trace against everybyte's server and peer servers.

Starts everybyte's server (`python -m everybyte.cli serve`) and each peer (bench/peers/NAME.py) one
after another on this machine with the same model (the default GGUF unless --model), context size
and threads, replays the same trace with the same run marker against each through
`everybyte bench agentic --endpoint URL`, and prints a side-by-side table (markdown on stderr, and
--out DIR/compare.md) plus one JSON object {"servers", "ratios", "assumptions"} on stdout (and --json).
Unknown options go to the agentic replay as they are (trace, scaling, SLO flags).
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import uuid

from everybyte.bench.compare_table import EVERYBYTE, assemble, server_entry, table
from everybyte.bench.report import emit
from everybyte.bench.servers import PEERS_DIR, PeerError, ServerProcess, free_port, load_peer, threading_main
from everybyte.cli_args import count, positive

PROG = "everybyte bench compare"

def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter,
                                epilog="Other options (--trace, --token-scale, --max-output, --gap-scale, "
                                       "--slo-ttft, ...) are passed to `everybyte bench agentic` as they are.")
    p.add_argument("--peers", default="llamacpp", help="comma-separated peers from bench/peers/")
    p.add_argument("--no-everybyte", action="store_true", help="run the peers only")
    p.add_argument("--model", default=None, help="the GGUF both servers load (default: everybyte's default model)")
    p.add_argument("--concurrency", type=count, default=2, help="replay session lanes; peers get as many slots")
    p.add_argument("--max-requests", type=count, default=24, help="turns per server, warm-up included")
    p.add_argument("--duration", type=positive, default=180.0, help="wall-time bound of each server's replay (s)")
    p.add_argument("--ctx", type=count, default=4096, help="context size of every server, and the replay's "
                   "--max-context")
    p.add_argument("--threads", type=count, default=os.cpu_count() or 1, help="CPU threads of every server")
    p.add_argument("--kv-cache", default="64MiB", help="everybyte's KV budget (--kv-cache)")
    p.add_argument("--peer-cache-bytes", type=count, default=None,
                   help="a peer's prompt-cache size in bytes where it has one (default: the peer's default)")
    p.add_argument("--everybyte-args", default="", help="extra `everybyte serve` flags, one string")
    p.add_argument("--run-marker", default=None, help="shared by every server's replay (default: random)")
    p.add_argument("--start-timeout", type=positive, default=300.0, help="seconds a server may take to start "
                   "(a peer's START_TIMEOUT_S raises it for that peer)")
    p.add_argument("--out", default=None, help="directory for compare.md, compare.json, each server's "
                   "report and log")
    p.add_argument("--json", default=None, help="write the JSON here too")
    return p


def _replay(name: str, url: str, args, rest: list[str], marker: str, flags: str, work: str) -> dict:
    json_path = os.path.join(work, f"{name}.agentic.json")
    cmd = [sys.executable, "-m", "everybyte.cli", "bench", "agentic", "--endpoint", url,
           "--concurrency", str(args.concurrency), "--max-requests", str(args.max_requests),
           "--duration", str(args.duration), "--max-context", str(args.ctx), "--run-marker", marker,
           "--server-flags", flags, "--no-progress", "--json", json_path] + rest
    if args.out:
        cmd += ["--out", os.path.join(args.out, name.replace(".", ""))]
    print(f"{PROG}: replaying against {name} at {url}", file=sys.stderr)
    rc = subprocess.run(cmd, stdout=subprocess.DEVNULL).returncode
    if rc != 0 or not os.path.exists(json_path):
        raise PeerError(f"the agentic replay against {name} failed (exit {rc}): {' '.join(cmd)}")
    with open(json_path) as f:
        return json.load(f)


def _sigterm(signum, frame):   # stop the running server (its own session) on the way out
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    if threading_main():
        signal.signal(signal.SIGTERM, _sigterm)
    args, rest = build_parser().parse_known_args(argv)
    names = [n.strip() for n in args.peers.split(",") if n.strip()]
    try:
        peers = {n: load_peer(n, PEERS_DIR) for n in names}
    except PeerError as e:
        print(f"{PROG}: {e}", file=sys.stderr)
        return 2
    if args.model is None:
        from everybyte import default_model_path
        args.model = str(default_model_path())
    from everybyte.engine.config import EngineConfig
    if args.out:
        os.makedirs(args.out, exist_ok=True)
    work = args.out or tempfile.mkdtemp(prefix="everybyte-compare-")
    marker = args.run_marker or uuid.uuid4().hex[:12]

    plan = []   # (name, cmd, env, notes)
    if not args.no_everybyte:
        port = free_port()
        cmd = [sys.executable, "-m", "everybyte.cli", "serve", "--port", str(port), "--model", args.model,
               "--max-model-len", str(args.ctx), "--kv-cache", args.kv_cache,
               "--max-num-seqs", str(max(args.concurrency, 1)), "--log-level", "warning"] + args.everybyte_args.split()
        env = {**os.environ, "EVERYBYTE_NUM_THREADS": str(args.threads)}
        notes = {"context": f"--max-model-len {args.ctx}", "threads": f"EVERYBYTE_NUM_THREADS={args.threads}",
                 "kv_budget": f"--kv-cache {args.kv_cache} (G1) plus its --kv-tiers (default host:1GiB)",
                 "prefix_cache": "on (default)", "ignore_eos": "honoured"}
        plan.append((EVERYBYTE, cmd, env, port, notes))
    for n, mod in peers.items():
        port = free_port()
        try:
            cmd, notes = mod.command(args.model, port, n_ctx=args.ctx, threads=args.threads,
                                     parallel=args.concurrency, cache_bytes=args.peer_cache_bytes,
                                     kv_bytes=EngineConfig(kv_cache_bytes=args.kv_cache).kv_cache_bytes)
        except PeerError as e:
            print(f"{PROG}: {e}", file=sys.stderr)
            return 2
        env = {**os.environ, **mod.environment(args.threads)} if hasattr(mod, "environment") else None
        start = max(args.start_timeout, getattr(mod, "START_TIMEOUT_S", 0.0))
        plan.append((mod.NAME, cmd, env, port, {**notes, "version": mod.version(), "start_timeout_s": start}))

    servers, failed = {}, False
    server_assumptions = {}
    for name, cmd, env, port, notes in plan:
        log = os.path.join(work, f"{name.replace('.', '')}.server.log")
        print(f"{PROG}: starting {name}: {' '.join(cmd)}", file=sys.stderr)
        srv = ServerProcess(name, cmd, port, log, env=env)
        server_assumptions[name] = {"command": " ".join(cmd), "log": log, **notes}
        try:
            ready = srv.wait_ready(notes.get("start_timeout_s", args.start_timeout))
            server_assumptions[name]["start_s"] = round(ready, 1)
            servers[name] = server_entry(_replay(name, srv.url, args, rest, marker, " ".join(cmd[1:]), work))
        except PeerError as e:
            print(f"{PROG}: {e}", file=sys.stderr)
            servers[name] = {"error": str(e).splitlines()[0], "summary": {}}
            failed = True
        finally:
            srv.stop()

    assumptions = {
        "model": args.model, "context": args.ctx, "threads": args.threads, "concurrency": args.concurrency,
        "max_requests": args.max_requests, "duration_s": args.duration, "run_marker": marker,
        "order": "servers run one after another on this machine, never at once; each replay starts on a "
                 "freshly started server with the same trace, scaling (--max-context = context) and run marker",
        "agentic_args": rest,
        "prompts": {n: {"prompt_mode": e.get("prompt_mode"), "output_join": e.get("output_join"),
                        "output_length_match": e.get("output_length_match")} for n, e in servers.items()},
        "prompt_rule": "the agentic replay sends token-id prompts where /v1/completions accepts them, else text "
                       "that round-trips through the server's tokenizer (prompt_mode per server above)",
        "servers": server_assumptions,
    }
    try:
        from everybyte.bench.replay.report import hardware, versions
        assumptions["hardware"], assumptions["software"] = hardware(), versions()
    except Exception:   # pragma: no cover - report helpers are optional here
        pass
    result = assemble(servers, assumptions)
    md = table(servers, {k: v for k, v in result["ratios"].items() if k != "rule"})
    print(md, file=sys.stderr)
    if args.out:
        with open(os.path.join(args.out, "compare.md"), "w") as f:
            f.write(f"# {PROG}\n\n{md}\n```\neverybyte bench compare {' '.join(argv or sys.argv[1:])}\n```\n")
        with open(os.path.join(args.out, "compare.json"), "w") as f:
            json.dump(result, f, indent=2, default=float)
    emit(result, args.json)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
