"""Per-turn records and the run summary: latency, throughput, interactivity, goodput, bytes.

TTFT = first output chunk - send; TPOT = (end - first token) / (output tokens - 1);
tokens/s/user = (output tokens - 1) / (end - first token), per request (rule 7); throughput counts
every token of the measured turns over the measured window (first send to last end); goodput
counts the output tokens of measured turns that met both SLO thresholds over the same window.
"""
from __future__ import annotations

from collections import Counter, defaultdict

from everybyte.bench.replay.backend import GenResult

GIB = 1 << 30


def turn_record(res: GenResult, t0: float, **fields) -> dict:
    n = res.completion_tokens or 0
    first = res.t_first
    ttft = (first - res.t_send) if (res.ok and first is not None) else None
    decode = (res.t_end - first) if (res.ok and first is not None) else None
    itl = [b - a for a, b in zip(res.token_times, res.token_times[1:])] if res.ok else []
    return {**fields, "ok": res.ok, "error": res.error, "status": res.status,
            "t_start_s": round(res.t_send - t0, 6), "t_end_s": round(res.t_end - t0, 6),
            "ttft_s": ttft, "e2e_s": (res.t_end - res.t_send) if res.ok else None,
            "tpot_s": decode / (n - 1) if decode is not None and n > 1 else None,
            "tok_s_user": (n - 1) / decode if decode and n > 1 else None,
            "itl_max_s": max(itl) if itl else None,
            "prompt_tokens": res.prompt_tokens if res.prompt_tokens is not None else fields.get("prompt_len"),
            "completion_tokens": n if res.ok else 0, "cached_tokens": res.cached_tokens,
            "finish_reason": res.finish_reason}


def pct(values: list[float], q: float) -> float | None:
    v = sorted(x for x in values if x is not None)
    if not v:
        return None
    pos = (len(v) - 1) * q
    lo = int(pos)
    hi = min(lo + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (pos - lo)


def summarize(turns: list[dict], samples: list[dict], slo_ttft_s: float, slo_tok_s_user: float,
              kv_budget_bytes: int | None) -> dict:
    measured = [t for t in turns if not t["warmup"]]
    ok = [t for t in measured if t["ok"]]
    errors = [t for t in turns if not t["ok"]]
    if measured:
        window = max(t["t_end_s"] for t in measured) - min(t["t_start_s"] for t in measured)
    else:
        window = 0.0
    out_tok = sum(t["completion_tokens"] for t in ok)
    all_tok = out_tok + sum(t["prompt_tokens"] or 0 for t in ok)
    good = [t for t in ok if t["ttft_s"] is not None and t["ttft_s"] <= slo_ttft_s
            and (t["tok_s_user"] is None or t["tok_s_user"] >= slo_tok_s_user)]
    with_cache = [t for t in ok if t["cached_tokens"] is not None]
    rate = lambda x: x / window if window > 0 else None
    output_tok_s = rate(out_tok)
    s = {"output_tok_s": output_tok_s, "total_tok_s": rate(all_tok),
         "ttft_p50_s": pct([t["ttft_s"] for t in ok], 0.5), "ttft_p90_s": pct([t["ttft_s"] for t in ok], 0.9),
         "ttft_p99_s": pct([t["ttft_s"] for t in ok], 0.99), "tpot_p50_s": pct([t["tpot_s"] for t in ok], 0.5),
         "tok_s_per_user_p50": pct([t["tok_s_user"] for t in ok], 0.5),
         "goodput_tok_s": rate(sum(t["completion_tokens"] for t in good)),
         "prefix_hit_rate": (sum(t["cached_tokens"] for t in with_cache) /
                             max(1, sum(t["prompt_tokens"] or 0 for t in with_cache))) if with_cache else None,
         "errors": len(errors),
         "e2e_p50_s": pct([t["e2e_s"] for t in ok], 0.5), "e2e_p90_s": pct([t["e2e_s"] for t in ok], 0.9),
         "tpot_p90_s": pct([t["tpot_s"] for t in ok], 0.9),
         "tok_s_per_user_session_p50": pct(_per_session(ok), 0.5),
         "slo_met_fraction": len(good) / len(ok) if ok else None,
         "turns_measured": len(measured), "turns_ok": len(ok), "turns_warmup": len(turns) - len(measured),
         "output_tokens": out_tok, "prompt_tokens": all_tok - out_tok, "window_s": window,
         "error_kinds": dict(Counter(_kind(t["error"]) for t in errors)),
         "errors_in_warmup": sum(1 for t in errors if t["warmup"])}
    s.update(_server_side(samples))
    s["kv_budget_bytes"] = kv_budget_bytes
    s["output_tok_s_per_gib_kv"] = (output_tok_s / (kv_budget_bytes / GIB)
                                    if output_tok_s is not None and kv_budget_bytes else None)
    return s


def _per_session(turns: list[dict]) -> list[float]:
    tokens, secs = defaultdict(int), defaultdict(float)
    for t in turns:
        if t["tpot_s"] is not None:
            key = (t["session"], t["instance"])
            tokens[key] += t["completion_tokens"] - 1
            secs[key] += t["tpot_s"] * (t["completion_tokens"] - 1)
    return [tokens[k] / secs[k] for k in tokens if secs[k] > 0]


def _kind(error: str | None) -> str:
    e = error or "unknown"
    return e.split(":")[0] if e.startswith("HTTP") else e.split(":")[0][:60]


def _server_side(samples: list[dict]) -> dict:
    out = {"server_prefix_hit_rate": None, "kv_usage_p50": None, "kv_usage_max": None, "g1_bytes_max": {}}
    if not samples:
        return out
    hits = [(s["prefix_cache_hits"], s["prefix_cache_queries"]) for s in samples
            if s.get("prefix_cache_hits") is not None and s.get("prefix_cache_queries") is not None]
    if len(hits) >= 2 and hits[-1][1] > hits[0][1]:
        out["server_prefix_hit_rate"] = (hits[-1][0] - hits[0][0]) / (hits[-1][1] - hits[0][1])
    usage = [s["kv_usage"] for s in samples if s.get("kv_usage") is not None]
    out["kv_usage_p50"], out["kv_usage_max"] = pct(usage, 0.5), (max(usage) if usage else None)
    peak: dict = {}
    for s in samples:
        for cat, v in (s.get("g1_bytes") or {}).items():
            peak[cat] = max(peak.get(cat, 0), v)
    out["g1_bytes_max"] = peak
    return out
