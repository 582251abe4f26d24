"""`everybyte bench weights-sharing`: N servers of one NVFP4 checkpoint keep one copy of its weights.

Packed weights are memory-mapped from the checkpoint's safetensors file (copy-on-write, never
written), so every process serving it maps the same page-cache pages. For each N in --servers,
starts N `everybyte serve` processes on the same checkpoint (written once by `everybyte quantize`
unless --model names one), sends each a request (every weight page is then touched), and reads
/proc/PID/smaps: the weight file's RSS and PSS in each process, and each process's total PSS.
A weight file shared by N processes shows PSS = its size / N in each, so the sum over the
processes stays one copy. The baseline in the same run: the same N servers with
--weights-dtype fp32 (each process dequantizes into private memory).
"""
from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

import httpx

from everybyte.bench.report import emit, environment
from everybyte.bench.servers import ServerProcess, free_port
from everybyte.cli_args import positive


def smaps(pid: int, file: str) -> dict:
    """{"file_rss", "file_pss"} of the mappings of `file` and "pss" of the whole process, in bytes."""
    out, current = {"file_rss": 0, "file_pss": 0, "pss": 0}, None
    with open(f"/proc/{pid}/smaps") as f:
        for line in f:
            head = line.split()
            if head and "-" in head[0] and len(head) >= 5 and not head[0].endswith(":"):
                current = head[5] if len(head) > 5 else ""
            elif head and head[0] in ("Rss:", "Pss:"):
                kb = int(head[1]) * 1024
                if head[0] == "Pss:":
                    out["pss"] += kb
                if current == file:
                    out["file_rss" if head[0] == "Rss:" else "file_pss"] += kb
    return out


def measure(a, model: Path, n: int, weights_dtype: str, log_dir: Path) -> dict:
    servers = []
    try:
        for i in range(n):
            port = free_port()
            cmd = [sys.executable, "-m", "everybyte.cli", "serve", "--model", str(model), "--port", str(port),
                   "--weights-dtype", weights_dtype, "--dtype", a.dtype, "--kv-cache", a.kv_cache, "--kv-tiers",
                   "none", "--max-model-len", "1024", "--log-level", "warning"]
            servers.append(ServerProcess(f"everybyte-{i}", cmd, port, str(log_dir / f"{weights_dtype}-{n}-{i}.log")))
        for s in servers:
            s.wait_ready(a.start_timeout)
            r = httpx.post(s.url + "/v1/completions", timeout=600,
                           json={"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0})
            r.raise_for_status()
        weights = str((model / "model.safetensors").resolve())
        per = [smaps(s.proc.pid, weights) for s in servers]
    finally:
        for s in servers:
            s.stop()
    return {"servers": n, "per_process": per, "sum_pss_bytes": sum(p["pss"] for p in per),
            "sum_weight_file_pss_bytes": sum(p["file_pss"] for p in per),
            "weight_file_rss_bytes_each": [p["file_rss"] for p in per]}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="everybyte bench weights-sharing", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="an NVFP4 checkpoint directory (default: quantize the default model)")
    p.add_argument("--servers", default="1,2,4")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--kv-cache", default="16MiB")
    p.add_argument("--no-baseline", action="store_true", help="skip the --weights-dtype fp32 servers")
    p.add_argument("--start-timeout", type=positive, default=300)
    p.add_argument("--json", default=None)
    return p


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    counts = [int(x) for x in a.servers.split(",")]
    with tempfile.TemporaryDirectory(prefix="everybyte-sharing-") as tmp:
        tmp = Path(tmp)
        model = Path(a.model) if a.model else None
        if model is None:
            cmd = [sys.executable, "-m", "everybyte.cli", "quantize", "--to", "nvfp4", str(tmp / "nvfp4")]
            out = subprocess.run(cmd, check=True, stdout=subprocess.PIPE, text=True).stdout
            model = Path(out.strip().splitlines()[-1])
        size = (model / "model.safetensors").stat().st_size
        runs = {f"nvfp4/{n}": measure(a, model, n, "auto", tmp) for n in counts}
        if not a.no_baseline:
            runs |= {f"fp32/{n}": measure(a, model, n, "fp32", tmp) for n in counts}
    one = runs[f"nvfp4/{counts[0]}"]["sum_pss_bytes"] / counts[0]
    result = {
        "runs": runs,
        "sum_pss_vs_n_times_one": {k: r["sum_pss_bytes"] / (r["servers"] * one) for k, r in runs.items()
                                   if k.startswith("nvfp4/")},
        "weight_file_pss_sum_vs_one_process": {
            k: r["sum_weight_file_pss_bytes"] / runs[f"nvfp4/{counts[0]}"]["sum_weight_file_pss_bytes"]
            for k, r in runs.items() if k.startswith("nvfp4/")},
        "config": {"model": str(a.model or "default model, quantized by everybyte quantize"), "file_bytes": size,
                   "dtype": a.dtype, "kv_cache": a.kv_cache, "env": environment()},
    }
    if not a.no_baseline:
        result["nvfp4_vs_fp32_sum_pss"] = {n: runs[f"nvfp4/{n}"]["sum_pss_bytes"] / runs[f"fp32/{n}"]["sum_pss_bytes"]
                                           for n in counts}
    emit(result, a.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
