"""Goals, markdown table and G1-ledger plot for `everybyte bench memory`."""
from __future__ import annotations

import json

GOALS = {"prefill_le_1.15x_min": 1.15, "ttft_resumed_p50_le_0.25x_levers_off": 0.25,
         "output_tok_s_ge_2x_levers_off": 2.0, "g2_load_ge_0.5x_memcpy": 0.5, "g3_load_ge_0.5x_disk": 0.5,
         "load_2k_prefix_ge_20x_faster_than_recompute": 20.0}


def goals(runs: dict, tiers: dict | None) -> dict:
    out, base, best = {}, runs.get("levers_off"), runs.get("all")

    def goal(name, value, ge=False):
        t = GOALS[name]
        out[name] = {"value": value, "target": t,
                     "met": None if value is None else (value >= t if ge else value <= t)}
    if best:
        goal("prefill_le_1.15x_min", best["prefill_tokens_computed"] / max(best["min_prefill_tokens"], 1))
    if best and base:
        b, a = base["ttft_resumed_p50_s"], best["ttft_resumed_p50_s"]
        goal("ttft_resumed_p50_le_0.25x_levers_off", None if not b or a is None else a / b)
        goal("output_tok_s_ge_2x_levers_off", best["output_tok_s"] / max(base["output_tok_s"], 1e-9), ge=True)
    if tiers:
        goal("g2_load_ge_0.5x_memcpy", tiers["g2_load_vs_memcpy"], ge=True)
        goal("g3_load_ge_0.5x_disk", tiers["g3_load_vs_disk"], ge=True)
        for k in ("g2_load_ge_0.5x_memcpy", "g3_load_ge_0.5x_disk"):
            out[k]["note"] = f"engine load path, {tiers['prefix']['tokens']}-token {tiers['prefix']['kv_format']} prefix"
        goal("load_2k_prefix_ge_20x_faster_than_recompute", min(tiers["load_speedup_vs_recompute"].values()), ge=True)
    return out


def fmt_num(v, nd=3):
    return "-" if v is None else (f"{v:.{nd}f}" if isinstance(v, float) else str(v))


def markdown(result: dict) -> str:
    mib = 1 << 20
    lines = ["# everybyte bench memory", "",
             "| run | prefill computed | min prefill | ratio | TTFT resumed p50 (s) | p90 (s) | output tok/s | "
             "preemptions | reuse by tier | G1 peak running / parked / cached / free (MiB) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["runs"]:
        pk = r["g1_ledger"]["peak"]
        reuse = ", ".join(f"{k}: {v}" for k, v in r["reuse_by_tier"].items()) or "-"
        lines.append(f"| {r['name']} | {r['prefill_tokens_computed']} | {r['min_prefill_tokens']} | "
                     f"{r['prefill_tokens_computed'] / max(r['min_prefill_tokens'], 1):.2f} | "
                     f"{fmt_num(r['ttft_resumed_p50_s'])} | {fmt_num(r['ttft_resumed_p90_s'])} | {r['output_tok_s']:.2f} | "
                     f"{r['preemptions']} | {reuse} | " +
                     " / ".join(f"{pk[c] / mib:.1f}" for c in ("running_kv", "parked_kv", "cached_kv", "free")) + " |")
    t = result.get("tiers")
    if t:
        lines += ["", "## Tiers", "", "| measure | value |", "|---|---|",
                  f"| G2 load / memcpy | {t['g2_load_vs_memcpy']:.2f} ({t['g2_load_bytes_s'] / 1e9:.2f} / "
                  f"{t['memcpy_bytes_s'] / 1e9:.2f} GB/s) |",
                  f"| G3 load / sequential disk read | {t['g3_load_vs_disk']:.2f} ({t['g3_load_bytes_s'] / 1e9:.2f} / "
                  f"{t['disk_seq_read_bytes_s'] / 1e9:.2f} GB/s) |",
                  f"| recompute {t['prefix']['tokens']}-token prefix | {t['recompute_2k_prefix_s']:.3f} s |"]
        lines += [f"| load it from {k} ({t['prefix']['kv_format']}) | {v:.4f} s "
                  f"({t['load_speedup_vs_recompute'][k]:.0f}x faster, {t['load_2k_prefix_bytes_s'][k] / 1e6:.0f} MB/s) |"
                  for k, v in t["load_2k_prefix_s"].items()]
    lines += ["", "## Goals", "", "| goal | value | target | met | note |", "|---|---|---|---|---|"]
    lines += [f"| {k} | {fmt_num(g['value'])} | {g['target']} | {g['met']} | {g.get('note', '')} |"
              for k, g in result["goals"].items()]
    lines += ["", "## Assumptions", "", "```json", json.dumps(result["assumptions"], indent=2), "```", ""]
    return "\n".join(lines)


def plot(series: dict, path: str) -> str | None:
    names = [n for n in ("levers_off", "all") if series.get(n)] or list(series)[:2]
    if not names:
        return None
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    cats = ("running_kv", "parked_kv", "cached_kv", "waste", "free")
    fig, axes = plt.subplots(len(names), 1, figsize=(8, 3.2 * len(names)), squeeze=False)
    for ax, name in zip(axes[:, 0], names):
        rows = series[name]
        ax.stackplot([r["t"] for r in rows], *[[r[c] / (1 << 20) for r in rows] for c in cats], labels=cats,
                     step="pre")
        ax.set_title(f"{name}: G1 KV bytes by ledger category (weights {rows[0]['weights'] / (1 << 20):.0f} MiB, "
                     "not drawn)", fontsize=9)
        ax.set_xlabel("time since the replay started (s)")
        ax.set_ylabel("MiB")
        ax.grid(alpha=0.3)
        ax.legend(loc="upper right", fontsize=7, ncol=len(cats))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# ---- CLI --------------------------------------------------------------------------------------
