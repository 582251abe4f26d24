"""The side-by-side result of `everybyte bench compare`: what it keeps of each server's agentic
replay, everybyte / peer ratios per metric, the markdown table and the JSON object."""
from __future__ import annotations

EVERYBYTE = "everybyte"

# (summary key, label, higher_is_better; None: a count, no direction)
METRICS = [
    ("output_tok_s", "output tok/s", True),
    ("total_tok_s", "total tok/s", True),
    ("goodput_tok_s", "goodput tok/s", True),
    ("ttft_p50_s", "TTFT p50 (s)", False),
    ("ttft_p90_s", "TTFT p90 (s)", False),
    ("ttft_p99_s", "TTFT p99 (s)", False),
    ("tpot_p50_s", "TPOT p50 (s)", False),
    ("tok_s_per_user_p50", "tok/s/user p50", True),
    ("e2e_p50_s", "end-to-end p50 (s)", False),
    ("prefix_hit_rate", "prefix hit rate", True),
    ("slo_met_fraction", "SLO met fraction", True),
    ("turns_ok", "turns ok", None),
    ("errors", "errors", False),
    ("output_tokens", "output tokens", None),
    ("prompt_tokens", "prompt tokens", None),
    ("window_s", "window (s)", None),
]


def _fmt(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return str(v)
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 1000 else f"{v:.0f}"
    return str(v)


def _join(j) -> str:
    if not isinstance(j, dict):
        return _fmt(j)
    methods = ", ".join(f"{k} x{v}" for k, v in (j.get("methods") or {}).items()) or "-"
    rate = j.get("round_trip_rate")
    return methods + (f" (round-trip rate {_fmt(rate)})" if rate is not None else "")


def ratios(servers: dict, base: str = EVERYBYTE) -> dict:
    """base / peer for every metric both have, per peer: {peer: {metric: ratio}}."""
    out = {}
    b = (servers.get(base) or {}).get("summary") or {}
    for name, entry in servers.items():
        if name == base:
            continue
        s = (entry or {}).get("summary") or {}
        r = {}
        for key, _, _ in METRICS:
            x, y = b.get(key), s.get(key)
            if isinstance(x, (int, float)) and isinstance(y, (int, float)) and y:
                r[key] = x / y
        out[name] = r
    return out


def table(servers: dict, rat: dict, base: str = EVERYBYTE) -> str:
    names = list(servers)
    peers = [n for n in names if n != base and n in rat]
    head = ["metric"] + names + [f"{base} / {p}" for p in peers]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for key, label, higher in METRICS:
        row = [label if higher is None else f"{label} ({'higher' if higher else 'lower'} is better)"]
        row += [_fmt(((servers[n] or {}).get("summary") or {}).get(key)) for n in names]
        row += [_fmt(rat[p].get(key)) for p in peers]
        lines.append("| " + " | ".join(row) + " |")
    extra = []
    for n in names:
        e = servers[n] or {}
        if e.get("error"):
            extra.append(f"- {n}: ERROR {e['error']}")
        else:
            extra.append(f"- {n}: prompts as {e.get('prompt_mode')}, output join {_join(e.get('output_join'))}, "
                         f"output length = max_tokens on {_fmt(e.get('output_length_match'))} of ok turns")
    return "\n".join(lines + [""] + extra) + "\n"


def server_entry(result: dict) -> dict:
    """The part of an agentic result the comparison keeps for one server."""
    a = result.get("assumptions") or {}
    tok = a.get("tokens") or {}
    turns = [t for t in result.get("turns") or [] if t.get("ok") and not t.get("warmup")]
    match = (sum(1 for t in turns if t.get("completion_tokens") == t.get("max_tokens")) / len(turns)
             if turns else None)
    return {"summary": result.get("summary") or {}, "prompt_mode": tok.get("prompt_mode"),
            "output_join": tok.get("output_join"), "output_length_match": match,
            "target": a.get("target"), "scaling": a.get("scaling"), "run": result.get("run")}


def assemble(servers: dict, assumptions: dict) -> dict:
    rat = ratios(servers)
    return {"benchmark": "compare", "servers": servers,
            "ratios": {**rat, "rule": f"{EVERYBYTE} value / peer value; for throughput, hit rate and tok/s/user "
                                      f"above 1 favours {EVERYBYTE}, for latencies below 1 does"},
            "assumptions": assumptions}
