"""`everybyte bench formats`: NVFP4 (and FP8) quantize / dequantize throughput against copy bandwidth.

Throughput is GB/s of the unquantized tensor (its numel * element size over the time), the
median of --repeats runs, interleaved with `torch.Tensor.copy_` of the same tensor into a
preallocated one, measured in the same run. quantize is the validated public API (it computes
the tensor amax, checks for NaN/Inf, allocates its outputs); dequantize writes into a
preallocated tensor as copy_ does (dequantize_alloc_gbps: allocating a fresh output each time,
next to clone_gbps, the allocating copy). Compilation happens in an untimed warm-up run.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from everybyte.bench import report
from everybyte.cli_args import count, positive
from everybyte.formats import cpu_kernels, fastpath, fp8, nvfp4

GOAL = 0.25
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def _median_s(fn, repeats: int, *others) -> list[float]:
    """Median seconds of fn and of each function in others, run interleaved `repeats` times."""
    fns = (fn, *others)
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(repeats):
        for f, ts in zip(fns, times):
            t0 = time.perf_counter()
            f()
            ts.append(time.perf_counter() - t0)
    return [statistics.median(ts) for ts in times]


def _codec(x: torch.Tensor, quantize, dequantize, repeats: int) -> dict:
    gb = x.numel() * x.element_size() / 1e9
    y, out = torch.empty_like(x), torch.empty_like(x)
    t0 = time.perf_counter()
    q = quantize(x)
    dequantize(q, out)
    warmup_s = time.perf_counter() - t0
    copy_s, q_s, dq_s, dqa_s, clone_s = _median_s(
        lambda: y.copy_(x), repeats, lambda: quantize(x), lambda: dequantize(q, out),
        lambda: dequantize(q, None), lambda: x.clone())
    return {
        "quantize_gbps": gb / q_s, "dequantize_gbps": gb / dq_s, "copy_gbps": gb / copy_s,
        "quantize_vs_copy": copy_s / q_s, "dequantize_vs_copy": copy_s / dq_s,
        "dequantize_alloc_gbps": gb / dqa_s, "clone_gbps": gb / clone_s, "warmup_s": warmup_s,
    }


def _nvfp4(x: torch.Tensor, repeats: int) -> dict:
    result = _codec(x, nvfp4.quantize, lambda t, out: nvfp4.dequantize(t, x.dtype, out=out), repeats)
    t = nvfp4.quantize(x)
    result["bits_per_value"] = 8 * t.nbytes / x.numel()
    result["rmse_rel"] = float((nvfp4.dequantize(t) - x.float()).pow(2).mean().sqrt() / x.float().pow(2).mean().sqrt())
    return result


def _fp8(x: torch.Tensor, repeats: int) -> dict:
    def dequantize(t, out):
        res = fp8.dequantize(t, x.dtype)
        return res if out is None else out.copy_(res)
    return _codec(x, fp8.quantize, dequantize, repeats)


def _path(device: str) -> str:
    if fastpath.get_mode() == "never":
        return "torch reference (eager)"
    if device == "cpu":
        return "cpu_kernels (C)" if cpu_kernels.available() else f"torch reference ({cpu_kernels.error()})"
    return "torch.compile"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="everybyte bench formats", description=__doc__.splitlines()[0])
    ap.add_argument("--json", metavar="PATH", help="also write the JSON result here")
    ap.add_argument("--size-mib", type=positive, default=64.0, help="size of each unquantized tensor (default 64)")
    ap.add_argument("--repeats", type=count, default=5, help="timed runs per figure; the median is reported")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--fast", choices=("auto", "always", "never"), default="auto", help="fast path mode")
    ap.add_argument("--no-fp8", action="store_true", help="skip the FP8 figures")
    args = ap.parse_args(argv)
    fastpath.set_mode(args.fast)
    gen = torch.Generator().manual_seed(0)
    result: dict = {}
    fp8_result: dict = {}
    for name, dtype in DTYPES.items():
        numel = max(1024, int(args.size_mib * 2**20) // dtype.itemsize // 1024 * 1024)
        x = torch.randn(numel // 1024, 1024, generator=gen).to(dtype).to(args.device)
        result[name] = _nvfp4(x, args.repeats)
        if not args.no_fp8:
            fp8_result[name] = _fp8(x, args.repeats)
        del x
    if fp8_result:
        result["fp8"] = fp8_result
    ratios = [result[n][k] for n in DTYPES for k in ("quantize_vs_copy", "dequantize_vs_copy")]
    result["goal"] = {"min_vs_copy": GOAL, "met": min(ratios) >= GOAL}
    result["config"] = {
        "size_mib": args.size_mib, "repeats": args.repeats, "device": args.device, "fast": args.fast,
        "nvfp4_path": _path(args.device), "statistic": "median", "gbps": "unquantized bytes / s, 1e9",
        **report.environment(),
    }
    report.emit(result, args.json)
    return 0
