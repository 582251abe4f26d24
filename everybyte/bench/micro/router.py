"""Router microbenchmark (uses cluster internals: KVIndex, Policy, the event feed's decoder).

A synthetic fleet: `--workers` workers and about `--blocks` distinct indexed blocks shaped like
agent traffic: a few shared system prompts, sessions that extend one of them turn by turn, each
session's chain cached on its home worker (G1, its older part in G2), some on a second worker,
part of the shared prompts in the pod-shared tier. The index is filled from KV event batches in
the wire format (msgpack, as a worker publishes them), timing decode + apply: events/s. Then
`--decisions` routing decisions for session continuations and new sessions (names given, as the
router has them after hashing): the index walk (the depths of every worker holding some of the
prefix) + Dynamo's cost over every worker + pick, p50/p99. The block-hashing step a real request
adds (kv/block_id over the prompt) is timed separately.

    everybyte bench router [--workers 64] [--blocks 1000000] [--decisions 2000] [--json PATH]
"""
from __future__ import annotations

import argparse
import os
import platform
import random
import statistics
import sys
import time

import msgspec

from everybyte.bench import report
from everybyte.cluster.event_feed import decode_events
from everybyte.cluster.kv_index import KVIndex
from everybyte.cluster.policy import Policy, Request
from everybyte.cluster.workers import Worker
from everybyte.kv.block_id import KVNamespace, chain_block_ids

BLOCK_SIZE = 16


def build_traffic(workers: int, blocks: int, rng: random.Random) -> tuple[list[list[bytes]], list[list[bytes]]]:
    """(system prompts' chains, sessions' chains); sessions extend a system prompt."""
    systems = [[os.urandom(16) for _ in range(rng.randint(16, 96))] for _ in range(32)]
    sessions, total = [], sum(map(len, systems))
    while total < blocks:
        own = [os.urandom(16) for _ in range(rng.randint(32, 480))]
        sessions.append(rng.choice(systems) + own)
        total += len(own)
    return systems, sessions


def event_batches(workers: list[str], systems: list[list[bytes]], sessions: list[list[bytes]],
                  rng: random.Random) -> list[tuple[str, bytes, int]]:
    """(worker, payload, events) as workers would publish them: one BlockStored per request step,
    prefill chunks of up to 32 blocks, decode growth one block at a time, G1->G2 moves."""
    out = []
    for s, chain in enumerate(sessions):
        homes = [workers[s % len(workers)]] + ([rng.choice(workers)] if rng.random() < 0.2 else [])
        for w in homes:
            cut = len(chain) // 2
            events = [["BlockStored", chain[i:i + 32], None, [], BLOCK_SIZE, None, "G1"] for i in range(0, cut, 32)]
            events += [["BlockStored", [h], None, [], BLOCK_SIZE, None, "G1"] for h in chain[cut:]]
            old = chain[len(systems[0]):cut // 2]              # the session's oldest blocks went to host memory
            events += [["BlockRemoved", old, "G1"], ["BlockStored", old, None, [], BLOCK_SIZE, None, "G2"]]
            for i in range(0, len(events), 64):
                part = events[i:i + 64]
                out.append((w, msgspec.msgpack.encode([time.time(), part, None]), len(part)))
    for chain in systems[:8]:
        out.append((workers[0], msgspec.msgpack.encode([time.time(), [["BlockStored", chain, None, [], BLOCK_SIZE,
                                                                        None, "G3.5"]], None]), 1))
    return out


def percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="everybyte bench router", description=__doc__.split("\n\n")[0])
    p.add_argument("--workers", type=int, default=64)
    p.add_argument("--blocks", type=int, default=1_000_000)
    p.add_argument("--decisions", type=int, default=2000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    if args.workers < 1 or args.blocks < 1000 or args.decisions < 1:
        p.error("--workers >= 1, --blocks >= 1000 and --decisions >= 1")
    rng = random.Random(args.seed)
    names = [f"http://10.0.0.{i}:8000" for i in range(args.workers)]
    systems, sessions = build_traffic(args.workers, args.blocks, rng)
    batches = event_batches(names, systems, sessions, rng)

    index = KVIndex()
    for w in names:
        index.add_worker(w, "ns")
    n_events = sum(n for _, _, n in batches)
    t0, c0 = time.perf_counter(), time.thread_time()
    for w, payload, _ in batches:
        index.apply(w, decode_events(payload)[1])
    ingest_s, ingest_cpu_s = time.perf_counter() - t0, time.thread_time() - c0
    n_blocks = len({h for chain in sessions for h in chain})

    workers = [Worker(url, healthy=True) for url in names]
    for i, wk in enumerate(workers):
        wk.active_blocks = rng.randint(0, 2000)
        wk.in_flight = i % 5
    policy = Policy("kv")
    lat, cpu, depths = [], [], []
    for i in range(args.decisions):
        if i % 4:                                             # a session's next turn: its chain + new blocks
            chain = rng.choice(sessions) + [os.urandom(16) for _ in range(4)]
        else:                                                 # a new session on a shared system prompt
            chain = rng.choice(systems) + [os.urandom(16) for _ in range(rng.randint(8, 64))]
        t, c = time.perf_counter(), time.thread_time()
        overlaps = index.reached(chain)                      # as cluster/decide asks: the workers reaching some
        d = policy.choose(Request(len(chain) * BLOCK_SIZE, BLOCK_SIZE, overlaps), workers)
        lat.append(time.perf_counter() - t)
        cpu.append(time.thread_time() - c)
        depths.append(d.overlap.total / len(chain))

    ns = KVNamespace("bench", block_size=BLOCK_SIZE)
    hash_lat = []
    for n_blocks_prompt in (64, 256, 512):
        tokens = [rng.randrange(50000) for _ in range(n_blocks_prompt * BLOCK_SIZE)]
        times = []
        for _ in range(21):
            t = time.thread_time()
            chain_block_ids(ns, tokens)
            times.append(time.thread_time() - t)
        hash_lat.append({"blocks": n_blocks_prompt, "cpu_median_ms": round(statistics.median(times) * 1e3, 3)})

    result = {
        "benchmark": "router",
        "workers": args.workers,
        "indexed_blocks": n_blocks,
        "index_entries": sum(sum(index.counts(w).values()) for w in names),
        "sessions": len(sessions),
        "ingest": {"events": n_events, "batches": len(batches), "seconds": round(ingest_s, 3),
                   "events_per_s": round(n_events / ingest_s),
                   "blocks_per_s": round(sum(sum(index.counts(w).values()) for w in names) / ingest_s),
                   "cpu_events_per_s": round(n_events / ingest_cpu_s),
                   "what": "msgpack decode + KVIndex.apply of every batch, one thread"},
        "decision": {"count": args.decisions, "p50_ms": round(statistics.median(lat) * 1e3, 4),
                     "p99_ms": round(percentile(lat, 0.99) * 1e3, 4),
                     "max_ms": round(max(lat) * 1e3, 4),
                     "cpu_p50_ms": round(statistics.median(cpu) * 1e3, 4),
                     "cpu_p99_ms": round(percentile(cpu, 0.99) * 1e3, 4),
                     "mean_prefix_hit": round(statistics.fmean(depths), 3),
                     "what": "KVIndex.reached (the workers holding some of the prefix) + kv cost over all workers + "
                             "pick, block names given; "
                             "p50/p99 wall clock, cpu_* the thread's CPU time (without time the OS "
                             "scheduled other processes: on a shared, oversubscribed host wall p99 is "
                             "a scheduler time slice)"},
        "load_average": os.getloadavg()[0],
        "hashing": {"per_prompt": hash_lat, "what": "kv/block_id chain_block_ids, added per request"},
        "goals": {"decision_p99_ms": 1.0, "events_per_s": 100_000},
        "environment": {"python": sys.version.split()[0], "platform": platform.platform(),
                        "cpu_count": os.cpu_count()},
    }
    report.emit(result, args.json)
    return 0
