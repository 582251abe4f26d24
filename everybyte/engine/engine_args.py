"""Engine command-line options shared by `everybyte generate` and `everybyte serve`."""
from __future__ import annotations

import argparse

from everybyte.formats.kv_layout import KV_CACHE_DTYPES
from everybyte.models.loader import WEIGHTS_DTYPES


def add_engine_args(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    g = p.add_argument_group("engine")
    g.add_argument("--model", default=None,
                   help="a .gguf file or a Hugging Face directory (default: the embedded SmolLM2-135M-Instruct)")
    g.add_argument("--kv-cache-dtype", default="nvfp4", choices=KV_CACHE_DTYPES)
    g.add_argument("--kv-cache", default="auto",
                   help="KV cache budget, e.g. 64MiB, 1GiB; auto (default): $EVERYBYTE_KV_CACHE_SPACE if set, else "
                        "one max-model-len request in the KV format and at least 64MiB (README: KV cache formats)")
    g.add_argument("--dtype", default="auto", help="compute dtype: auto, float32, bfloat16, float16")
    g.add_argument("--weights-dtype", default="auto", choices=WEIGHTS_DTYPES,
                   help="weights in memory: auto (what the checkpoint holds; NVFP4 for a 4-bit GGUF), nvfp4 "
                        "(quantize at load), bf16 or fp32")
    g.add_argument("--block-size", type=int, default=16)
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--max-num-seqs", type=int, default=64)
    g.add_argument("--max-num-batched-tokens", type=int, default=512)
    g.add_argument("--device", default="cpu")
    g.add_argument("--expert-parallel", type=int, default=1, metavar="N",
                   help="split a MoE model's experts over N rank processes (this one is rank 0; must divide "
                        "the expert count); README: Expert parallelism")
    g.add_argument("--eplb-interval", type=int, default=0, metavar="STEPS",
                   help="with --expert-parallel: rebalance the experts (DeepSeek's EPLB) every STEPS steps from "
                        "the load window (--eplb-window); 0 (default) = never; README: Expert placement")
    g.add_argument("--eplb-window", type=int, default=0, metavar="STEPS",
                   help="with --eplb-interval: the load history a placement is computed from, >= the interval; "
                        "0 (default) = 4 intervals")
    g.add_argument("--eplb-redundant", type=int, default=0, metavar="R",
                   help="redundant expert slots per rank a rebalance may fill with replicas of hot experts")
    g.add_argument("--kv-tiers", default="host:1GiB",
                   help="KV tiers below the device, e.g. host:2GiB,disk:/path:20GiB,redis://127.0.0.1:6379:8GiB,"
                        "shared:/mnt/kv:100GiB,cold:/mnt/cold:1TiB; 'none' for none")
    g.add_argument("--no-prefix-caching", action="store_true", help="never reuse KV across requests")
    g.add_argument("--no-kv-exact-tail", action="store_true",
                   help="fp8/nvfp4: quantize each sequence's last block too (no unquantized slot per sequence)")
    g.add_argument("--no-offload-on-park", action="store_true",
                   help="keep a parked session's KV on the device until G1 needs the room")
    return p


def engine_kwargs(args: argparse.Namespace) -> dict:
    return {"kv_cache_dtype": args.kv_cache_dtype, "kv_cache_bytes": args.kv_cache,
            "dtype": args.dtype, "weights_dtype": args.weights_dtype, "block_size": args.block_size, "max_model_len": args.max_model_len,
            "max_num_seqs": args.max_num_seqs, "max_num_batched_tokens": args.max_num_batched_tokens,
            "device": args.device, "kv_tiers": args.kv_tiers, "expert_parallel": args.expert_parallel,
            "eplb_interval": args.eplb_interval, "eplb_redundant": args.eplb_redundant,
            "eplb_window": args.eplb_window,
            "enable_prefix_caching": not args.no_prefix_caching, "offload_on_park": not args.no_offload_on_park,
            "kv_exact_tail": not args.no_kv_exact_tail}
