"""`everybyte bench cluster`: the agent-session replay against `everybyte cluster` under each routing policy.

For each worker count in --workers and each policy in --policies (round-robin, kv, kv+disagg, ...),
starts a fresh `everybyte cluster` (router + N workers on this machine, each with a small KV budget
so that no worker holds every session), replays the same agent sessions (tool gaps kept) through the
router with `everybyte bench agentic`, and reads every worker's /metrics before and after: prompt
tokens computed vs reused per tier, KV bytes moved per tier and connector path. The runs in one
invocation share the trace, scaling and run marker, and run one after another, never at once.
Every worker is warmed first; each run states its budget in tokens next to the live sessions' peak
context (the premise: one worker cannot hold them all) and splits its recomputed prompt tokens into
reusable_missed and unavoidable (recompute_breakdown). Ratios: kv / round-robin for prefill tokens
computed and TTFT p90 (goal <= 0.5 each), kv+disagg / kv for TPOT p99 (goal <= 0.6 when long
prefills arrive).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import uuid

import httpx

from everybyte.bench.replay.backend import parse_prometheus
from everybyte.bench.report import emit
from everybyte.bench.servers import PeerError, ServerProcess, free_port
from everybyte.cli_args import count, non_negative_int, positive

PROG = "everybyte bench cluster"
POLICIES = ("round-robin", "random", "least-loaded", "session", "kv", "kv+disagg")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter,
                                epilog="Other options (--trace, --token-scale, --max-output, --gap-scale, ...) "
                                       "are passed to `everybyte bench agentic` as they are.")
    p.add_argument("--workers", default="2", help="comma-separated worker counts")
    p.add_argument("--policies", default="round-robin,kv,kv+disagg",
                   help=f"comma-separated, from {', '.join(POLICIES)}")
    p.add_argument("--kv-cache", default="16MiB",
                   help="G1 KV budget per worker: less than the live sessions' context (the report's "
                        "live_sessions_peak_tokens), so no worker holds every session")
    p.add_argument("--kv-tiers", default="none", help="each worker's --kv-tiers")
    p.add_argument("--disagg-threshold", type=non_negative_int, default=256,
                   help="kv+disagg: uncached prompt tokens above which a request is prefilled apart")
    p.add_argument("--concurrency", type=count, default=4, help="replay session lanes")
    p.add_argument("--max-requests", type=count, default=32, help="turns per run, warm-up included")
    p.add_argument("--duration", type=positive, default=300.0, help="wall-time bound of each run's replay (s)")
    p.add_argument("--ctx", type=count, default=2048, help="context of every worker and the replay's --max-context")
    p.add_argument("--cluster-args", default="", help="extra `everybyte cluster` flags, one string")
    p.add_argument("--start-timeout", type=positive, default=300.0)
    p.add_argument("--out", default=None, help="directory for each run's replay JSON and cluster log")
    p.add_argument("--json", default=None, help="write the JSON here too")
    return p


def cluster_command(n: int, policy: str, port: int, args) -> list[str]:
    cmd = [sys.executable, "-m", "everybyte.cli", "cluster", "--workers", str(n), "--port", str(port),
           "--policy", "kv" if policy == "kv+disagg" else policy, "--kv-cache", args.kv_cache,
           "--kv-tiers", args.kv_tiers, "--max-model-len", str(args.ctx),
           "--max-num-seqs", str(max(args.concurrency, 1))]
    if policy == "kv+disagg":
        cmd += ["--prefill", "1", "--decode", str(n - 1), "--disagg-threshold", str(args.disagg_threshold)]
    return cmd + args.cluster_args.split()


def counter(metrics: dict, name: str) -> dict:
    """A counter's series, under its name or the `_total` name the Prometheus client renders."""
    return metrics.get(name) or metrics.get(name + "_total") or {}


def worker_counters(urls: list[str]) -> dict:
    """Summed over the workers: prefill tokens computed and reused per tier, bytes moved per tier/direction."""
    out: dict = {"prefill_computed": 0.0, "prefill_reused": {}, "bytes_moved": {}}
    for url in urls:
        m = parse_prometheus(httpx.get(url + "/metrics", timeout=10).text)
        for labels, v in counter(m, "everybyte:prefill_tokens").items():
            src = dict(labels).get("source", "?")
            if src == "computed":
                out["prefill_computed"] += v
            else:
                out["prefill_reused"][src] = out["prefill_reused"].get(src, 0.0) + v
        for labels, v in counter(m, "everybyte:kv_bytes_moved").items():
            d = dict(labels)
            key = f"{d.get('tier', '?')}/{d.get('direction', '?')}"
            out["bytes_moved"][key] = out["bytes_moved"].get(key, 0.0) + v
        for labels, v in counter(m, "everybyte:kv_transfer_bytes_received").items():
            key = f"connector:{dict(labels).get('path', '?')}/received"
            out["bytes_moved"][key] = out["bytes_moved"].get(key, 0.0) + v
    return out


def warm_workers(workers: list[dict]) -> None:
    """One tiny request straight to each worker (under a block, so nothing is cached), so no policy pays
    a worker's first-request costs inside the measured turns."""
    for w in workers:
        body: dict = {"prompt": list(range(1000, 1008)), "max_tokens": 2}
        if w.get("role") == "prefill":
            body.update(max_tokens=1, kv_transfer_params={"do_remote_decode": True})
        r = httpx.post(w["url"] + "/v1/completions", json=body, timeout=120)
        if r.status_code != 200:
            raise PeerError(f"warming {w['url']} failed: {r.status_code} {r.text[:200]}")


def budget_tokens(urls: list[str]) -> int | None:
    """One worker's G1 budget in tokens (its device pool's blocks x block size, from /v1/kv/info)."""
    info = httpx.get(urls[0] + "/v1/kv/info", timeout=10).json()
    total = (info.get("load") or {}).get("kv_blocks_total")
    return int(total) * int(info["block_size"]) if total and info.get("block_size") else None


def delta(after: dict, before: dict) -> dict:
    if isinstance(after, dict):
        return {k: delta(v, before.get(k, 0 if not isinstance(v, dict) else {})) for k, v in after.items()}
    return after - before


def tpot_p99(turns: list[dict]) -> float | None:
    vals = sorted(t["tpot_s"] for t in turns if t.get("ok") and not t.get("warmup") and t.get("tpot_s") is not None)
    return vals[min(len(vals) - 1, int(0.99 * len(vals)))] if vals else None


def replay(url: str, args, rest: list[str], marker: str, json_path: str) -> dict:
    cmd = [sys.executable, "-m", "everybyte.cli", "bench", "agentic", "--endpoint", url,
           "--concurrency", str(args.concurrency), "--max-requests", str(args.max_requests),
           "--duration", str(args.duration), "--max-context", str(args.ctx), "--run-marker", marker,
           "--no-progress", "--json", json_path] + rest
    rc = subprocess.run(cmd, stdout=subprocess.DEVNULL).returncode
    if rc != 0 or not os.path.exists(json_path):
        raise PeerError(f"the agentic replay failed (exit {rc}): {' '.join(cmd)}")
    with open(json_path) as f:
        return json.load(f)


def run_one(n: int, policy: str, args, rest: list[str], marker: str, work: str) -> dict:
    name = f"{n}w-{policy}"
    port = free_port()
    cmd = cluster_command(n, policy, port, args)
    print(f"{PROG}: {name}: {' '.join(cmd)}", file=sys.stderr)
    srv = ServerProcess(name, cmd, port, os.path.join(work, f"{name}.log"))
    try:
        start_s = srv.wait_ready(args.start_timeout)
        listed = httpx.get(srv.url + "/v1/workers", timeout=10).json()["data"]
        warm_workers(listed)
        workers = [w["url"] for w in listed]
        budget = budget_tokens(workers)
        before, load_before = worker_counters(workers), os.getloadavg()[0]
        result = replay(srv.url, args, rest, marker, os.path.join(work, f"{name}.agentic.json"))
        after, load_after = worker_counters(workers), os.getloadavg()[0]
        router = parse_prometheus(httpx.get(srv.url + "/metrics", timeout=10).text)
    finally:
        srv.stop()
    s = result.get("summary") or {}
    counters = delta(after, before)
    return {"workers": n, "policy": policy, "command": " ".join(cmd[3:]), "start_s": round(start_s, 1),
            "prefill_tokens_computed": counters["prefill_computed"],
            "prefill_tokens_reused": counters["prefill_reused"], "kv_bytes_moved": counters["bytes_moved"],
            "ttft_p50_s": s.get("ttft_p50_s"), "ttft_p90_s": s.get("ttft_p90_s"),
            "tpot_p50_s": s.get("tpot_p50_s"), "tpot_p99_s": tpot_p99(result.get("turns") or []),
            "goodput_tok_s": s.get("goodput_tok_s"), "output_tok_s": s.get("output_tok_s"),
            "prefix_hit_rate": s.get("prefix_hit_rate"), "kv_budget_tokens_per_worker": budget,
            "live_sessions_peak_tokens": live_sessions_peak_tokens(result.get("turns") or []),
            "turns_ok": s.get("turns_ok"), "errors": s.get("errors"),
            "host_load_avg_1m": [round(load_before, 2), round(load_after, 2)],   # others' jobs share the cores
            "router_decisions": {"|".join(f"{k}={v}" for k, v in labels): v for labels, v in
                                 counter(router, "everybyte:router_decisions").items()},
            "_turns": result.get("turns") or []}


def live_sessions_peak_tokens(turns: list[dict]) -> int:
    """The most context the sessions open at once held: at each turn's send, the sum over sessions already
    started and not yet finished of their latest prompt + output, so a reader can see whether one worker's
    budget holds every live session (the issue's premise: it must not)."""
    spans: dict[tuple, list] = {}
    for t in sorted((t for t in turns if t.get("ok")), key=lambda t: t["t_start_s"]):
        key = (t.get("session"), t.get("instance"), t.get("agent"))
        span = spans.setdefault(key, [t["t_start_s"], t["t_end_s"], []])
        span[1] = max(span[1], t["t_end_s"])
        span[2].append((t["t_start_s"], (t.get("prompt_len") or 0) + (t.get("completion_tokens") or 0)))
    peak = 0
    for now in sorted(s for span in spans.values() for s, _ in span[2]):
        peak = max(peak, sum(max((n for s, n in span[2] if s <= now), default=0)
                             for span in spans.values() if span[0] <= now <= span[1]))
    return peak


def turn_key(t: dict) -> tuple:
    return t.get("session"), t.get("instance"), t.get("agent"), t.get("turn")


def recompute_breakdown(runs: list[dict]) -> None:
    """Where each run's prompt tokens were computed: `reusable_missed` are tokens of a prefix that another
    aggregated run of the same worker count reused on the same turn (so a cache held them: a routing or
    eviction loss), `unavoidable` the rest (a session's first turn, a context the trace rewrote). Sets
    `recompute` on each run, from its `_turns` (popped). kv+disagg is left out of the best case: its
    cached_tokens count the blocks the prefill worker sent."""
    for n in {r["workers"] for r in runs}:
        group = [r for r in runs if r["workers"] == n and "_turns" in r]
        best: dict = {}
        for r in group:
            if r["policy"] != "kv+disagg":
                for t in r["_turns"]:
                    if t.get("ok") and not t.get("warmup"):
                        best[turn_key(t)] = max(best.get(turn_key(t), 0), t.get("cached_tokens") or 0)
        for r in group:
            turns = [t for t in r.pop("_turns") if t.get("ok") and not t.get("warmup")]
            missed = sum(max(0, best.get(turn_key(t), 0) - (t.get("cached_tokens") or 0)) for t in turns)
            uncached = sum((t.get("prompt_len") or 0) - (t.get("cached_tokens") or 0) for t in turns)
            r["recompute"] = {"uncached_tokens": uncached, "reusable_missed": missed,
                              "unavoidable": uncached - missed,
                              "turns_missing_reuse": sum(1 for t in turns if best.get(turn_key(t), 0)
                                                         - (t.get("cached_tokens") or 0) >= 64)}
    for r in runs:
        r.pop("_turns", None)


def ratio(a, b):
    return a / b if isinstance(a, (int, float)) and isinstance(b, (int, float)) and b else None


def ratios(runs: list[dict]) -> dict:
    out = {}
    for n in sorted({r["workers"] for r in runs}):
        by = {r["policy"]: r for r in runs if r["workers"] == n and "error" not in r}
        rr, kv, dis = by.get("round-robin"), by.get("kv"), by.get("kv+disagg")
        row = {}
        if rr and kv:
            row["kv_vs_round_robin_prefill_computed"] = ratio(kv["prefill_tokens_computed"], rr["prefill_tokens_computed"])
            row["kv_vs_round_robin_ttft_p90"] = ratio(kv["ttft_p90_s"], rr["ttft_p90_s"])
        if kv and dis:
            row["disagg_vs_kv_tpot_p99"] = ratio(dis["tpot_p99_s"], kv["tpot_p99_s"])
        out[f"{n}_workers"] = row
    return out


def main(argv: list[str] | None = None) -> int:
    args, rest = build_parser().parse_known_args(argv)
    counts = [int(x) for x in args.workers.split(",") if x.strip()]
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    bad = [p for p in policies if p not in POLICIES]
    if bad or not policies:
        print(f"{PROG}: unknown policy {bad[0] if bad else '(none)'!r}; choose from {', '.join(POLICIES)}",
              file=sys.stderr)
        return 2
    if any(n < 1 for n in counts) or ("kv+disagg" in policies and any(n < 2 for n in counts)):
        print(f"{PROG}: --workers must be >= 1 (>= 2 with kv+disagg: one prefill, the rest decode)", file=sys.stderr)
        return 2
    work = args.out or tempfile.mkdtemp(prefix="everybyte-bench-cluster-")
    os.makedirs(work, exist_ok=True)
    marker, runs, failed = uuid.uuid4().hex[:12], [], False
    for n in counts:
        for policy in policies:
            try:
                runs.append(run_one(n, policy, args, rest, marker, work))
            except (PeerError, httpx.HTTPError, KeyError) as e:
                print(f"{PROG}: {n}w-{policy}: {e}", file=sys.stderr)
                runs.append({"workers": n, "policy": policy, "error": str(e).splitlines()[0]})
                failed = True
    recompute_breakdown(runs)
    result = {"benchmark": "cluster", "runs": runs, "ratios": ratios(runs),
              "goals": {"kv_vs_round_robin_prefill_computed": "<= 0.5", "kv_vs_round_robin_ttft_p90": "<= 0.5",
                        "disagg_vs_kv_tpot_p99": "<= 0.6"},
              "assumptions": {"kv_cache_per_worker": args.kv_cache, "kv_tiers": args.kv_tiers, "context": args.ctx,
                              "concurrency": args.concurrency, "max_requests": args.max_requests,
                              "run_marker": marker, "agentic_args": rest, "work_dir": work,
                              "order": "runs one after another on this machine, each on a fresh cluster; "
                                       "workers share the machine's cores"}}
    emit(result, args.json)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
