"""PNG plots (matplotlib, Agg): TTFT CDF, throughput vs tokens/s/user, G1 bytes by category."""
from __future__ import annotations

import os


def _plt():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def write_plots(result: dict, out_dir: str) -> list[str]:
    """The plot files written into out_dir (names relative to it)."""
    plt = _plt()
    written = []
    runs = result.get("sweep") or [{"concurrency": result["assumptions"]["replay"].get("concurrency"),
                                    "summary": result["summary"]}]

    fig, ax = plt.subplots(figsize=(6, 4))
    drew = False
    for run in runs:
        c = run["concurrency"]
        ttft = sorted(t["ttft_s"] for t in result["turns"] if t["ok"] and not t["warmup"]
                      and t["ttft_s"] is not None and t.get("concurrency", c) == c)
        if ttft:
            ax.step([ttft[0]] + ttft, [0.0] + [(i + 1) / len(ttft) for i in range(len(ttft))], where="post",
                    label=f"concurrency {c}")
            drew = True
    ax.set_xlabel("time to first token (s)")
    ax.set_ylabel("fraction of turns")
    ax.set_title("TTFT CDF")
    ax.grid(alpha=0.3)
    if drew:
        ax.legend()
    written.append(_save(fig, plt, out_dir, "ttft_cdf.png"))

    fig, ax = plt.subplots(figsize=(6, 4))
    pts = [(r["summary"]["tok_s_per_user_p50"], r["summary"]["output_tok_s"], r["concurrency"]) for r in runs
           if r["summary"].get("tok_s_per_user_p50") is not None and r["summary"].get("output_tok_s") is not None]
    if pts:
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o")
        for x, y, c in pts:
            ax.annotate(f"c={c}", (x, y), textcoords="offset points", xytext=(4, 4))
    ax.set_xlabel("tokens/s/user (p50)")
    ax.set_ylabel("output tokens/s")
    ax.set_title("throughput vs interactivity")
    ax.grid(alpha=0.3)
    written.append(_save(fig, plt, out_dir, "throughput_vs_tok_s_user.png"))

    samples = [s for s in result.get("samples", []) if s.get("g1_bytes")]
    if samples:
        fig, ax = plt.subplots(figsize=(7, 4))
        cats = sorted({c for s in samples for c in s["g1_bytes"]})
        ts = [s["t"] for s in samples]
        ax.stackplot(ts, [[s["g1_bytes"].get(c, 0) / 2 ** 20 for s in samples] for c in cats], labels=cats)
        ax.set_xlabel("time since the run started (s)")
        ax.set_ylabel("G1 (device) MiB")
        ax.set_title("device bytes by ledger category")
        ax.legend(loc="upper left", fontsize="small")
        written.append(_save(fig, plt, out_dir, "g1_bytes.png"))
    return written


def _save(fig, plt, out_dir: str, name: str) -> str:
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, name), dpi=100)
    plt.close(fig)
    return name
