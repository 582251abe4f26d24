"""One entry point: everybyte generate|serve|convert|quantize|moe-ify|bench|sim ...

Each subcommand lives in its own module with a `main(argv) -> int`; this file only
dispatches, so importing the CLI stays cheap and layers stay apart.
"""
from __future__ import annotations

import importlib
import os
import sys

COMMANDS = {
    "generate": ("everybyte.engine.generate_cli", "generate text with the engine, streaming to stdout"),
    "serve": ("everybyte.serve.cli", "start the OpenAI-compatible HTTP server"),
    "router": ("everybyte.cluster.router_cli", "a KV-aware OpenAI-compatible router over serve workers"),
    "convert": ("everybyte.models.convert_cli", "write a model as a Hugging Face directory: [MODEL] --to hf DIR"),
    "quantize": ("everybyte.engine.quantize_cli", "write an NVFP4 (ModelOpt) checkpoint: [MODEL] --to nvfp4 DIR"),
    "moe-ify": ("everybyte.engine.moeify_cli", "a MoE with routers fitted on real text from a dense model: [MODEL] OUTDIR"),
    "cluster": ("everybyte.cluster.cli", "start N serve workers and a router: --workers N [--prefill P --decode D]"),
    "sim": ("everybyte.sim.cli", "simulate a fleet on the engine's control plane: everybyte sim run|calibrate|whatif|hardware|models"),
    "bench": (None, "run a benchmark: everybyte bench NAME [--json PATH] (see `everybyte bench --help`)"),
}

BENCHMARKS = {
    "formats": ("everybyte.bench.micro.formats", "NVFP4/FP8 quantize and dequantize throughput vs copy"),
    "engine": ("everybyte.bench.engine", "prefill and decode tokens/s vs transformers"),
    "serve": ("everybyte.bench.serve", "the same 64-client workload over HTTP and in process"),
    "kv-quality": ("everybyte.bench.micro.kv_quality", "perplexity and speed per KV cache format"),
    "weights-quality": ("everybyte.bench.micro.weights_quality", "perplexity of NVFP4 weights vs fp32 weights, and of each choice"),
    "weights-sharing": ("everybyte.bench.weights_sharing", "PSS of N servers of one NVFP4 checkpoint: one copy of the weights"),
    "agentic": ("everybyte.bench.agentic", "replay recorded agent sessions against an endpoint or the embedded engine"),
    "memory": ("everybyte.bench.micro.memory", "levers off vs each lever vs all: prefill computed, resumed-turn TTFT, tok/s, G1 ledger"),
    "disk-reader": ("everybyte.bench.micro.disk_reader", "the disk tier's reader (C and Python) vs a plain sequential read"),
    "router": ("everybyte.bench.micro.router", "router microbenchmark: decision p50/p99 and KV event ingestion at 64 workers, 1M blocks"),
    "sim-speed": ("everybyte.bench.sim_speed", "simulated requests per wall- and CPU-second of `everybyte sim run` at 64 workers"),
    "sim-accuracy": ("everybyte.bench.sim_accuracy", "the simulator vs the real engine on held-out agent sessions: TTFT, tok/s, prefill"),
    "compare": ("everybyte.bench.compare", "everybyte's server vs peer servers (bench/peers/) on the same trace"),
    "kv-transfer": ("everybyte.bench.micro.kv_transfer", "disaggregated prefill->decode: bytes and bandwidth per KV format over the connector"),
    "cluster": ("everybyte.bench.cluster", "agent replay through `everybyte cluster`: round-robin vs kv vs kv+disagg"),
    "ep": ("everybyte.bench.micro.expert_parallel", "expert parallelism: all-to-all per MoE layer, EP=1 vs N prefill/decode tok/s"),
    "moe": ("everybyte.bench.micro.moe", "MoE at EP 1/2/4: expert bytes and KV tokens per rank, tok/s, imbalance before/after EPLB"),
}


def _usage(table: dict, prog: str) -> str:
    lines = [f"usage: {prog} COMMAND [args]", "", "commands:"]
    lines += [f"  {name:<12} {help_}" for name, (_, help_) in table.items()]
    return "\n".join(lines)


def _run(module: str, argv: list[str]) -> int:
    return int(importlib.import_module(module).main(argv) or 0)


def _activate_compiled() -> None:
    """EVERYBYTE_COMPILED=1: the control plane compiled with mypyc (native/compiled), else Python."""
    from everybyte.native import compiled
    try:
        root = compiled.activate(announce=lambda: print(
            "everybyte: building the compiled control plane (mypyc; a few minutes, once)", file=sys.stderr))
    except Exception as e:  # noqa: BLE001 - any failure: the same modules as Python
        print(f"everybyte: compiled control plane unavailable, running it as Python ({e})", file=sys.stderr)
        return
    print(f"everybyte: compiled control plane from {root}", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if os.environ.get("EVERYBYTE_COMPILED") == "1":
        _activate_compiled()
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage(COMMANDS, "everybyte"))
        return 0 if argv else 2
    cmd, rest = argv[0], argv[1:]
    if cmd == "bench":
        if not rest or rest[0] in ("-h", "--help"):
            print(_usage(BENCHMARKS, "everybyte bench"))
            return 0 if rest else 2
        if rest[0] not in BENCHMARKS:
            print(f"everybyte bench: unknown benchmark {rest[0]!r}; choose from {', '.join(BENCHMARKS)}",
                  file=sys.stderr)
            return 2
        return _run(BENCHMARKS[rest[0]][0], rest[1:])
    if cmd not in COMMANDS:
        print(f"everybyte: unknown command {cmd!r}; choose from {', '.join(COMMANDS)}", file=sys.stderr)
        return 2
    return _run(COMMANDS[cmd][0], rest)


if __name__ == "__main__":
    sys.exit(main())
