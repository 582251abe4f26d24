"""Peer: llama.cpp's C++ `llama-server` (OpenAI-compatible, parallel slots, continuous batching).

Loaded by `everybyte bench compare --peers llamaserver`; not part of .ci/run. Build it once from the
llama.cpp sources vendored in the llama-cpp-python sdist (17 minutes on 2 shared cores):

    bash bench/peers/build_llama_server.sh

which installs one static binary at $EVERYBYTE_HOME/llama.cpp/bin/llama-server. The binary is
looked up in $EVERYBYTE_LLAMA_SERVER, then that cache path, then PATH. The server is started as
`llama-server -m GGUF -c N*P -np P -t T -tb T --flash-attn on --cont-batching --cache-reuse 256 ...`
(flags checked against the binary's --help), and it is ready when /v1/models answers 200 (it answers
503 while the model loads).
"""
from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

NAME = "llama-server"
BINARY_ENV = "EVERYBYTE_LLAMA_SERVER"
INSTALL = "bash bench/peers/build_llama_server.sh"
INSTALL_NOTE = ("compiles llama.cpp's llama-server from the llama-cpp-python sdist's sources, 17 minutes on "
                f"2 shared cores, into $EVERYBYTE_HOME/llama.cpp/bin/; {BINARY_ENV} names another binary; "
                "see bench/peers/README.md")
CACHE_REUSE = 256          # min chunk (tokens) reused from a slot's cache by KV shifting
_help: dict[str, str] = {}


def cache_path() -> Path:
    home = Path(os.environ.get("EVERYBYTE_HOME") or "~/.cache/everybyte").expanduser()
    return home / "llama.cpp" / "bin" / "llama-server"


def _executable(p: str | Path) -> bool:
    return os.path.isfile(p) and os.access(p, os.X_OK)


def binary() -> str | None:
    """$EVERYBYTE_LLAMA_SERVER when set (None if it is not an executable), else the cache path, else PATH."""
    env = os.environ.get(BINARY_ENV)
    if env:
        return env if _executable(env) else None
    return str(cache_path()) if _executable(cache_path()) else shutil.which("llama-server")


def missing() -> list[str]:
    """What keeps the peer from running (empty: installed): the llama-server binary."""
    if binary():
        return []
    env = os.environ.get(BINARY_ENV)
    if env:   # compare.py appends "not found"
        return [f"an executable llama-server at {BINARY_ENV}={env}"]
    return [f"the llama-server binary (looked in {cache_path()} and PATH; {BINARY_ENV} unset)"]


def version() -> str | None:
    exe = binary()
    if not exe:
        return None
    proc = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=60)
    lines = (proc.stdout + proc.stderr).strip().splitlines()
    return lines[0] if lines else None


def help_text(exe: str) -> str:
    if exe not in _help:
        proc = subprocess.run([exe, "--help"], capture_output=True, text=True, timeout=60)
        _help[exe] = proc.stdout + proc.stderr
    return _help[exe]


def command(model: str, port: int, *, n_ctx: int, threads: int, parallel: int,
            cache_bytes: int | None = None, kv_bytes: int | None = None,
            host: str = "127.0.0.1") -> tuple[list[str], dict]:
    """The server's command line and what each setting means for the comparison.

    llama-server splits its context (-c) evenly among its -np slots (KV not unified when -np is
    given), so -c is n_ctx * parallel for every slot to hold n_ctx tokens. Slots decode together
    (continuous batching); each keeps its last prompt's KV, a request goes to the slot whose cached
    prompt matches it best, and idle slots' prompts are saved to a RAM prompt cache (--cache-ram).
    """
    exe = binary()
    if exe is None:
        from everybyte.bench.servers import PeerError
        raise PeerError(f"peer llamaserver: {missing()[0]} not found; build it with: {INSTALL}")
    h = help_text(exe)
    slots = max(int(parallel), 1)
    fa_line = next((line for line in h.splitlines() if "--flash-attn" in line), "")
    fa = ["--flash-attn", "on"] if "on|off" in fa_line else ["--flash-attn"]   # older builds: a bare switch
    cmd = [exe, "-m", model, "--host", host, "--port", str(port), "-c", str(n_ctx * slots), "-np", str(slots),
           "-t", str(threads), "-tb", str(threads), *fa, "--cont-batching"]
    if "--cache-prompt" in h:
        cmd += ["--cache-prompt"]
    if "--cache-reuse" in h:
        cmd += ["--cache-reuse", str(CACHE_REUSE)]
    ram = None
    if "--cache-ram" in h and cache_bytes:
        ram = max(int(cache_bytes) >> 20, 1)
        cmd += ["--cache-ram", str(ram)]
    if "--no-webui" in h:
        cmd += ["--no-webui"]
    notes = {
        "context": f"-c {n_ctx * slots} -np {slots}: {slots} slot(s) of {n_ctx} tokens each (llama-server divides "
                   f"-c among its slots; KV not unified), f16 KV",
        "threads": f"-t {threads} -tb {threads} (decode and prompt processing); with every core taken, its "
                   "spinning thread pool slows down many-fold while any other process (another job, the replay "
                   "client) runs: compare on an otherwise idle host",
        "parallel_slots": f"{slots} (-np), one per replay lane; --cont-batching decodes them in one batch",
        "flash_attention": " ".join(fa) + " (the CPU backend has a flash-attention kernel)",
        "prompt_cache": ("on: each slot keeps its last prompt's KV and reuses the longest common prefix"
                         + (" (--cache-prompt)" if "--cache-prompt" in h else "")
                         + (f"; --cache-reuse {CACHE_REUSE} also reuses matching chunks of >= {CACHE_REUSE} "
                            f"tokens after a mismatch by KV shifting" if "--cache-reuse" in h else "")
                         + "; requests go to the slot whose cached prompt is most similar (--slot-prompt-similarity "
                           "default 0.1)"
                         + ("; idle slots' prompts are saved to the RAM prompt cache, "
                            + (f"--cache-ram {ram} MiB" if ram else "default 8192 MiB") if "--cache-ram" in h else "")),
        "kv_budget": "not settable like everybyte's --kv-cache" + (f" ({kv_bytes} bytes)" if kv_bytes else "")
                     + ": live KV is -c cells (f16), fixed at start; the RAM prompt cache is bounded by --cache-ram",
        "webui": "--no-webui" if "--no-webui" in h else "not in this build's options",
        "prompts": "token ids: its /v1/completions takes a list of ints as prompt",
        "usage": "usage.prompt_tokens_details.cached_tokens is reported, so prefix_hit_rate is measured",
        "ignore_eos": "honoured (a llama.cpp extension field of /v1/completions)",
    }
    return cmd, notes
