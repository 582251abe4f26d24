"""`everybyte bench ep`: expert parallelism's cost on this machine (a micro benchmark: it uses the
dispatcher's process group directly, and says so).

1. The all-to-all round trip of one MoE layer, alone: two rank processes in a real gloo group on
   127.0.0.1 run what AllToAllDispatcher does per layer in fp32 (counts; token rows with their
   routing metadata out; expert outputs back: three exchanges) with no expert compute, for several
   token counts; microseconds per layer.
2. The engine at EP=1 and at each --ranks N on a MoE model (--model, default: a tiny random
   Qwen3-MoE written by transformers into a temporary directory): prefill tok/s (prompts of
   --prompt-len tokens, one output token) and decode tok/s (--batch sequences, --decode-tokens
   each, from the first to the last token), greedy, fp32 KV; whether EP=N's tokens equal EP=1's;
   rank 0's weight bytes and every rank's private resident memory.
   The ranks share the cores: each gets cores // N threads (--threads sets it).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from everybyte.bench.report import emit, environment
from everybyte.cli_args import count


def exchange_round_trips(rank: int, port: int, hidden: int, top_k: int, rows: list[int], repeats: int) -> dict:
    import torch

    from everybyte.dist import ProcessGroup
    g = ProcessGroup(rank, 2, port)
    out = {}
    for n in rows:
        x = torch.randn(n, hidden + 2 * top_k)        # fp32 token rows with their routing metadata
        split = [n - n // 2, n // 2]          # half the rows stay, half cross to the other rank
        g.barrier()
        t = time.perf_counter()
        for _ in range(repeats):
            recv = g.exchange_counts(split)
            got = g.all_to_all_single(x, recv, split)
            g.all_to_all_single(got[:, :hidden].contiguous(), split, recv)
        out[n] = (time.perf_counter() - t) / repeats * 1e6
    g.barrier()
    g.close()
    return out


def measure_exchange(hidden: int, top_k: int, rows: list[int], repeats: int) -> dict:
    from everybyte.dist import free_port
    port = str(free_port())
    argv = [sys.executable, "-m", "everybyte.bench.micro.expert_parallel", "--exchange-rank", "RANK", "--port", port,
            "--hidden", str(hidden), "--top-k", str(top_k), "--rows", ",".join(map(str, rows)),
            "--repeats", str(repeats)]
    procs = [subprocess.Popen([a.replace("RANK", str(r)) for a in argv], stdout=subprocess.PIPE, text=True)
             for r in range(2)]
    outs = [p.communicate(timeout=600)[0] for p in procs]
    if any(p.returncode for p in procs):
        raise RuntimeError(f"exchange ranks failed: {[p.returncode for p in procs]}")
    return {"hidden": hidden, "us_per_layer_by_tokens": json.loads(outs[0])}


def tiny_moe(path: Path) -> Path:
    import torch
    import transformers
    cfg = transformers.Qwen3MoeConfig(
        vocab_size=1024, hidden_size=256, intermediate_size=512, moe_intermediate_size=256, num_hidden_layers=4,
        num_attention_heads=8, num_key_value_heads=4, head_dim=32, num_experts=16, num_experts_per_tok=4,
        norm_topk_prob=True, max_position_embeddings=1024, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    transformers.Qwen3MoeForCausalLM(cfg).save_pretrained(path)
    from tokenizers import Tokenizer, models
    Tokenizer(models.WordLevel({f"t{i}": i for i in range(1024)}, unk_token="t0")).save(str(path / "tokenizer.json"))
    return path


def private_bytes(pid: int) -> int:
    """Resident anonymous memory: what the process holds itself (mapped checkpoint pages excluded)."""
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("RssAnon:"))


def engine_speed(model: str, ranks: int, args) -> dict:
    from everybyte import LLM, SamplingParams
    threads = args.threads or max(1, (os.cpu_count() or 1) // ranks)       # the cores shared by the ranks
    os.environ["EVERYBYTE_NUM_THREADS"] = str(threads)                       # read by every rank at start
    llm = LLM(model, expert_parallel=ranks, kv_cache_dtype="fp32", kv_cache_bytes="64MiB", kv_tiers="none",
              max_model_len=args.prompt_len + args.decode_tokens + 8, max_num_batched_tokens=args.prompt_len * 4,
              enable_prefix_caching=False)
    try:
        vocab = llm.model_config.vocab_size
        prompts = [[(7 * i + 13 * j) % (vocab - 3) + 3 for j in range(args.prompt_len)] for i in range(args.batch)]
        llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=2))          # warm
        t = time.perf_counter()
        llm.generate(prompts, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
        prefill = args.batch * args.prompt_len / (time.perf_counter() - t)
        outs = llm.generate([p[:8] for p in prompts],
                            SamplingParams(temperature=0, max_tokens=args.decode_tokens, ignore_eos=True))
        start = max(o.metrics.token_times[0] for o in outs)
        end = max(o.metrics.token_times[-1] for o in outs)
        decoded = sum(sum(1 for t in o.metrics.token_times if t > start) for o in outs)
        pids = [os.getpid(), *(llm.expert_parallel.describe()["worker_pids"] if llm.expert_parallel else [])]
        return {"ranks": ranks, "threads_per_rank": threads, "prefill_tok_s": prefill,
                "decode_tok_s": decoded / max(end - start, 1e-9), "rank0_weight_bytes": llm.weights_bytes,
                "private_bytes_per_rank": [private_bytes(pid) for pid in pids], "tokens": [o.token_ids for o in outs]}
    finally:
        llm.close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="everybyte bench ep", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="a MoE Hugging Face directory (default: a tiny random Qwen3-MoE)")
    p.add_argument("--ranks", default="2", help="EP sizes to compare with EP=1, comma-separated")
    p.add_argument("--batch", type=count, default=8)
    p.add_argument("--prompt-len", type=count, default=128)
    p.add_argument("--decode-tokens", type=count, default=32)
    p.add_argument("--rows", default="1,8,64,512", help="token counts for the all-to-all round trip")
    p.add_argument("--hidden", default="256,2048", help="hidden sizes for the all-to-all round trip")
    p.add_argument("--repeats", type=count, default=50)
    p.add_argument("--threads", type=count, default=None,
                   help="CPU threads per rank (default: this machine's cores // ranks)")
    p.add_argument("--json", default=None)
    p.add_argument("--exchange-rank", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--top-k", type=int, default=4, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    rows = [int(r) for r in args.rows.split(",")]
    if args.exchange_rank is not None:
        res = exchange_round_trips(args.exchange_rank, args.port, int(args.hidden), args.top_k, rows, args.repeats)
        print(json.dumps(res))
        return 0
    result: dict = {"bench": "ep", "environment": environment(),
                    "all_to_all": [measure_exchange(int(h), args.top_k, rows, args.repeats)
                                   for h in args.hidden.split(",")]}
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or str(tiny_moe(Path(tmp)))
        runs = [engine_speed(model, n, args) for n in [1, *map(int, args.ranks.split(","))]]
    for r in runs[1:]:
        r["tokens_equal_ep1"] = r["tokens"] == runs[0]["tokens"]
    for r in runs:
        del r["tokens"]
    result["engine"] = {"model": args.model or "tiny random Qwen3-MoE (16 experts, top-4, hidden 256, 4 layers)",
                        "batch": args.batch, "prompt_len": args.prompt_len, "runs": runs}
    emit(result, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
