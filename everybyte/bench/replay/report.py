"""The report: JSON (summary, assumptions, every turn), a markdown page stating every assumption."""
from __future__ import annotations

import json
import os
import platform
import sys
from importlib import metadata

SUMMARY_ROWS = [("output_tok_s", "output tokens/s"), ("total_tok_s", "total tokens/s (prompt + output)"),
                ("goodput_tok_s", "goodput (output tokens/s of turns within the SLO)"),
                ("ttft_p50_s", "TTFT p50 (s)"), ("ttft_p90_s", "TTFT p90 (s)"), ("ttft_p99_s", "TTFT p99 (s)"),
                ("tpot_p50_s", "TPOT p50 (s)"), ("tok_s_per_user_p50", "tokens/s/user p50"),
                ("e2e_p50_s", "end-to-end p50 (s)"), ("prefix_hit_rate", "prefix hit rate (cached_tokens)"),
                ("server_prefix_hit_rate", "prefix hit rate (server counters)"),
                ("output_tok_s_per_gib_kv", "output tokens/s per GiB of KV budget"),
                ("kv_usage_max", "KV usage max"), ("errors", "errors"), ("turns_measured", "turns measured"),
                ("window_s", "measured window (s)")]


def versions() -> dict:
    out = {"python": sys.version.split()[0]}
    for pkg in ("everybyte", "torch", "httpx", "tqdm", "matplotlib", "numpy"):
        try:
            out[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            out[pkg] = None
    return out


def hardware() -> dict:
    cpu = None
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), None)
    except OSError:
        pass
    mem = None
    try:
        with open("/proc/meminfo") as f:
            mem = int(next(ln for ln in f if ln.startswith("MemTotal")).split()[1]) * 1024
    except (OSError, StopIteration, ValueError):
        pass
    hw = {"cpu": cpu or platform.processor(), "cpu_count": os.cpu_count(), "memory_bytes": mem,
          "platform": platform.platform()}
    try:
        import torch
        hw["torch_threads"] = torch.get_num_threads()
        hw["cuda"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    except Exception:
        pass
    return hw


def _fmt(v) -> str:
    if v is None:
        return "n/a"
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def _flatten(d: dict, prefix: str = "") -> list[tuple[str, str]]:
    rows = []
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v and len(json.dumps(v, default=str)) > 100:
            rows += _flatten(v, key + ".")
        else:
            rows.append((key, json.dumps(v, default=str) if isinstance(v, (dict, list)) else _fmt(v)))
    return rows


def markdown(result: dict) -> str:
    s, a = result["summary"], result["assumptions"]
    lines = ["# everybyte bench agentic", "", f"Target: {a['target'].get('target')}  ",
             f"Model: {a['target'].get('model')}  ", f"Trace: {a['trace'].get('path')} "
             f"({a['trace'].get('format')})", "", "## Summary", "", "| metric | value |", "|---|---|"]
    lines += [f"| {label} | {_fmt(s.get(key))} |" for key, label in SUMMARY_ROWS]
    if s.get("error_kinds"):
        lines += ["", "Errors by kind: " + ", ".join(f"{k}: {v}" for k, v in s["error_kinds"].items())]
    if result.get("sweep"):
        lines += ["", "## Concurrency sweep", "", "| concurrency | output tok/s | tok/s/user p50 | TTFT p50 (s) | errors |",
                  "|---|---|---|---|---|"]
        lines += [f"| {x['concurrency']} | {_fmt(x['summary']['output_tok_s'])} | "
                  f"{_fmt(x['summary']['tok_s_per_user_p50'])} | {_fmt(x['summary']['ttft_p50_s'])} | "
                  f"{x['summary']['errors']} |" for x in result["sweep"]]
    lines += ["", "## Assumptions", "", "Everything this run assumed or chose, as used:", "",
              "| assumption | value |", "|---|---|"]
    lines += [f"| {k} | {v.replace('|', '/')} |" for k, v in _flatten(a)]
    run = result.get("run", {})
    if run:
        lines += ["", "## Run", "", "| item | value |", "|---|---|"]
        lines += [f"| {k} | {v.replace('|', '/')} |" for k, v in _flatten(run)]
    if result.get("plots"):
        lines += ["", "## Plots", ""] + [f"![{os.path.splitext(p)[0]}]({p})" for p in result["plots"]]
    return "\n".join(lines) + "\n"


def write_files(result: dict, out_dir: str) -> list[str]:
    """report.json, report.md and the plots in out_dir; returns the paths written."""
    from everybyte.bench.replay.plots import write_plots

    os.makedirs(out_dir, exist_ok=True)
    result["plots"] = write_plots(result, out_dir)
    paths = [os.path.join(out_dir, p) for p in result["plots"]]
    with open(os.path.join(out_dir, "report.json"), "w") as f:
        json.dump(result, f, indent=2, default=float)
        f.write("\n")
    with open(os.path.join(out_dir, "report.md"), "w") as f:
        f.write(markdown(result))
    return [os.path.join(out_dir, "report.json"), os.path.join(out_dir, "report.md")] + paths
