"""llama-server decode speed, for side-by-side numbers with everybyte's own decode benchmarks.

For each -np value of --parallel it starts llama-server through bench/peers/llamaserver.py's
command() (same flags as `everybyte bench compare --peers llamaserver`, 127.0.0.1 only), sends one
warm-up request, then --parallel concurrent /completion requests of --prompt-tokens token ids and
--max-tokens output tokens (ignore_eos, cache_prompt off, a distinct prompt each), and stops the
server's whole process group (also on Ctrl-C / SIGTERM). At -np 1 that one stream is the batch-1
figure, read from the server's own `timings`. Prints one JSON object:

    {"batch1_ms_per_token", "batch1_tok_s", "batch1_prompt_tok_s", "aggregate_tok_s": {np: tok/s},
     "runs": {np: details}}

aggregate_tok_s = all predicted tokens / wall time of the batch (prefill of the batch included);
runs[np]["decode_tok_s_timings"] = all predicted tokens / the mean of the requests' predicted_ms.
With --repeat N each batch runs N times on the same server and the fastest is kept (all walls and
the 1-minute load average around the kept one are in runs[np]); llama.cpp's spinning thread pool
slows down many-fold when another process takes the cores.

    PYTHONPATH=. python bench/peers/llama_server_decode.py --threads 2 --parallel 1,8,32
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx


def load_peer():
    spec = importlib.util.spec_from_file_location("llamaserver_peer", Path(__file__).with_name("llamaserver.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def free_port() -> int:
    with socket.socket() as s:
        return s.bind(("127.0.0.1", 0)) or s.getsockname()[1]


def stop(proc: subprocess.Popen) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            return
        try:
            proc.wait(15)
            return
        except subprocess.TimeoutExpired:
            pass


def complete(url: str, prompt: list[int], n: int) -> dict:
    body = {"prompt": prompt, "n_predict": n, "ignore_eos": True, "cache_prompt": False, "temperature": 0.0}
    r = httpx.post(url + "/completion", json=body, timeout=1800.0)
    r.raise_for_status()
    return r.json()["timings"]


def measure(peer, args, np_: int) -> dict:
    port = free_port()
    cmd, _ = peer.command(args.model, port, n_ctx=args.ctx, threads=args.threads, parallel=np_)
    log = open(os.path.join(args.log_dir, f"llama-server-np{np_}.log"), "wb")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url, pool = f"http://127.0.0.1:{port}", ThreadPoolExecutor(np_)
    try:
        t0 = time.monotonic()
        while True:
            if proc.poll() is not None:
                raise SystemExit(f"llama-server exited ({proc.returncode}); log {log.name}")
            try:
                if httpx.get(url + "/v1/models", timeout=2.0).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() - t0 > 300:
                raise SystemExit(f"llama-server not ready after 300 s; log {log.name}")
            time.sleep(0.3)
        complete(url, [100 + i for i in range(16)], 8)                       # warm-up
        prompts = [[1000 + 97 * k + (i * 31) % 20000 for i in range(args.prompt_tokens)] for k in range(np_)]
        tries = []                      # (wall, timings, loadavg before/after) per repeat; the fastest is kept
        for _ in range(args.repeat):
            load0, t0 = os.getloadavg()[0], time.perf_counter()
            timings = list(pool.map(lambda p: complete(url, p, args.max_tokens), prompts))
            tries.append((time.perf_counter() - t0, timings, [round(load0, 2), round(os.getloadavg()[0], 2)]))
        wall, timings, load = min(tries, key=lambda t: t[0])
    finally:              # server first: the requests in flight then fail at once and free the pool
        stop(proc)
        log.close()
        pool.shutdown(wait=False, cancel_futures=True)
    predicted = sum(t["predicted_n"] for t in timings)
    mean_ms = sum(t["predicted_ms"] for t in timings) / len(timings)
    return {"command": " ".join(cmd), "wall_s": round(wall, 3), "walls_s": [round(t[0], 3) for t in tries],
            "loadavg_1m_before_after": load, "predicted_tokens": predicted,
            "aggregate_tok_s": round(predicted / wall, 2),
            "decode_tok_s_timings": round(predicted / (mean_ms / 1000), 2),
            **{f"{k}_mean": round(sum(t[k] for t in timings) / len(timings), 3)
               for k in ("predicted_per_second", "predicted_per_token_ms", "prompt_per_second")}}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="GGUF (default: everybyte's default model)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--parallel", default="1,8,32", help="comma-separated -np values; 1 gives the batch-1 figures")
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--ctx", type=int, default=512, help="tokens per slot (-c is ctx * np)")
    p.add_argument("--repeat", type=int, default=1, help="run each batch N times, keep the fastest (noisy hosts)")
    p.add_argument("--log-dir", default=None, help="server logs (default: a temp dir)")
    args = p.parse_args(argv)
    if args.model is None:
        from everybyte.models.default_model import default_model_path
        args.model = str(default_model_path())
    args.log_dir = args.log_dir or tempfile.mkdtemp(prefix="llama-server-decode-")
    os.makedirs(args.log_dir, exist_ok=True)
    peer = load_peer()
    if peer.missing():
        print(f"not installed: {peer.missing()[0]}; build it with: {peer.INSTALL}", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, lambda *a: sys.exit(143))   # the finally in measure() stops the server
    runs = {n: measure(peer, args, n) for n in (int(x) for x in args.parallel.split(",") if x.strip())}
    out = {"version": peer.version(), "model": args.model, "threads": args.threads,
           "prompt_tokens": args.prompt_tokens, "max_tokens": args.max_tokens,
           "aggregate_tok_s": {n: r["aggregate_tok_s"] for n, r in runs.items()}, "runs": runs}
    if 1 in runs:
        out["batch1_ms_per_token"] = runs[1]["predicted_per_token_ms_mean"]
        out["batch1_tok_s"] = runs[1]["predicted_per_second_mean"]
        out["batch1_prompt_tok_s"] = runs[1]["prompt_per_second_mean"]
    print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
